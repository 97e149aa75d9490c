"""The embedded default corpus, built on first use from material every Python machine has.

- Text stream: the source files of the Python standard library (tests and IDLE excluded), one
  document per file, up to `corpus_text_bytes`.
- Multimodal stream: images rendered with Pillow from that material, each followed by the text it
  shows, so the stream is learnable: (a) 1-4 lines of stdlib code drawn as an image, target = the lines;
  (b) a bar chart of 3-6 small numbers, target = "bar chart: " + the numbers.
- A byte-level BPE tokenizer trained on both (data/tokenizer.py), saved as tokenizer.json.
- A held-out part that training never reads (`val-text-*.tar`, `val-mm-*.tar`; the default
  `data.val_shards`, train/evaluation/heldout.py): text from the stdlib folders the training stream leaves out
  (`HELDOUT_DIRS`: IDLE and lib2to3, ordinary library code), up to `corpus_val_text_bytes`, and
  `corpus_val_mm_docs` images rendered from that text (another seed for the bar charts). Where a Python
  installation lacks those folders, the last training files that add up to `corpus_val_text_bytes` are
  moved to the held-out part instead (logged). The tokenizer is trained on the training part only.

It is written to a temporary directory and renamed into place when complete, under a name that
encodes everything it depends on (vocabulary, image token, image settings, sizes), so a changed model
config builds a new one and an interrupted build is never used. Building takes well under a minute
on 2 cores; later runs find it cached.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import random
import shutil
import socket
import sysconfig
from pathlib import Path

import numpy as np

from flashtrain.data.config import DataConfig, TokenSpec
from flashtrain.data.shards import Document, write_shards
from flashtrain.data.tokenizer import train_tokenizer

VERSION = 2
HELDOUT_DIRS = ("idlelib", "lib2to3")  # stdlib folders the training stream never reads: the held-out text
EXCLUDE_DIRS = {"site-packages", "__pycache__", "test", "tests", *HELDOUT_DIRS}
log = logging.getLogger(__name__)


def stdlib_texts(max_bytes: int, only: tuple[str, ...] = ()) -> list[str]:
    """The stdlib's .py files in sorted walk order, up to `max_bytes` characters: the training text
    (every folder but `EXCLUDE_DIRS`), or with `only` the files under those top-level folders."""
    root = sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for d, dirs, files in os.walk(root):
        if only and d == root:
            dirs[:] = sorted(x for x in dirs if x in only)
            continue
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDE_DIRS)
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            with open(os.path.join(d, f), encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            if not text.strip():
                continue
            texts.append(text)
            total += len(text)
            if total >= max_bytes:
                return texts
    return texts


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def render_code(lines: list[str]):
    from PIL import Image, ImageDraw

    w = 8 + 7 * max(len(line) for line in lines)
    img = Image.new("RGB", (max(w, 64), 12 + 14 * len(lines)), "white")
    draw = ImageDraw.Draw(img)
    for i, line in enumerate(lines):
        draw.text((4, 6 + 14 * i), line, fill="black")
    return img


def render_bars(values: list[int]):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (24 * len(values) + 16, 120), "white")
    draw = ImageDraw.Draw(img)
    for i, v in enumerate(values):
        draw.rectangle([10 + 24 * i, 110 - 10 * v, 26 + 24 * i, 110], fill=(40, 90, 200))
    return img


def multimodal_examples(texts: list[str], n: int, seed: int = 0) -> list[tuple[bytes, str]]:
    rng = random.Random(seed)
    lines = [line.rstrip() for t in texts for line in t.splitlines() if 8 <= len(line.strip()) and len(line) <= 48]
    out = []
    for i in range(n):
        if i % 2 == 0 and lines:
            start = rng.randrange(len(lines))
            chunk = lines[start:start + rng.randint(1, 4)]
            out.append((_png(render_code(chunk)), "\n".join(chunk)))
        else:
            values = [rng.randint(1, 9) for _ in range(rng.randint(3, 6))]
            out.append((_png(render_bars(values)), "bar chart: " + " ".join(map(str, values))))
    return out


def heldout_texts(train: list[str], max_bytes: int) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): the `HELDOUT_DIRS` files, or, where the installation has none,
    the last training files up to `max_bytes` (taken out of training)."""
    held = stdlib_texts(max_bytes, only=HELDOUT_DIRS)
    if held or max_bytes <= 0:
        return train, held
    n, total = len(train), 0
    while n > 1 and total < max_bytes:
        n, total = n - 1, total + len(train[n - 1])
    log.warning("the stdlib has no %s folders: holding out its last %d file(s) for evaluation instead",
                "/".join(HELDOUT_DIRS), len(train) - n)
    return train[:n], train[n:]


def corpus_key(cfg: DataConfig, spec: TokenSpec) -> str:
    facts = json.dumps([VERSION, spec.vocab_size, spec.bos_id, spec.eos_id, spec.pad_id, spec.image_token_id,
                        cfg.corpus_text_bytes, cfg.corpus_mm_docs, cfg.corpus_shards, cfg.corpus_val_text_bytes,
                        cfg.corpus_val_mm_docs], sort_keys=True)
    return f"v{VERSION}-vocab{spec.vocab_size}-{hashlib.sha256(facts.encode()).hexdigest()[:10]}"


def ensure_default_corpus(cfg: DataConfig, spec: TokenSpec) -> Path:
    """Directory holding manifest.json, tokenizer.json, text-*.tar and mm-*.tar (built if missing)."""
    root = cfg.cache_dir()
    final = root / corpus_key(cfg, spec)
    if (final / "manifest.json").is_file():
        return final
    log.info("building the default corpus in %s (once per cache: every later start finds it there)", final)
    tmp = root / f".building-{final.name}-{socket.gethostname()}-{os.getpid()}"  # a node's pid is not unique
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    texts, held = heldout_texts(stdlib_texts(cfg.corpus_text_bytes), cfg.corpus_val_text_bytes)
    examples = multimodal_examples(texts, cfg.corpus_mm_docs, seed=cfg.seed)
    held_examples = multimodal_examples(held, cfg.corpus_val_mm_docs, seed=cfg.seed + 1) if held else []
    tok = train_tokenizer(texts + [cap for _, cap in examples], spec)
    tok.save(str(tmp / "tokenizer.json"))

    def encode(batch: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(batch, add_special_tokens=False)]

    def documents(texts: list[str], examples: list[tuple[bytes, str]]) -> tuple[list[Document], list[Document]]:
        return ([Document([("text", ids)]) for ids in encode(texts)],
                [Document([("image", png, "png"), ("text", ids)])
                 for (png, _), ids in zip(examples, encode([cap for _, cap in examples]))])

    text_docs, mm_docs = documents(texts, examples)
    val_text, val_mm = documents(held, held_examples)
    manifest = {"version": VERSION, "tokenizer": "tokenizer.json", "source": "python stdlib + rendered images"}
    for name, docs, shards in (("text", text_docs, cfg.corpus_shards), ("mm", mm_docs, cfg.corpus_shards),
                               ("val-text", val_text, 1), ("val-mm", val_mm, 1)):
        if docs:
            manifest[name] = write_shards(docs, tmp, name, max(1, math.ceil(len(docs) / shards)))
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    try:
        tmp.rename(final)
    except OSError:  # another process finished first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def corpus_shards(path: Path) -> tuple[list[str], list[str], str]:
    """(text shards, multimodal shards, tokenizer path) of a directory written with a manifest."""
    manifest = json.loads((path / "manifest.json").read_text())
    text = [str(path / e["path"]) for e in manifest.get("text", [])]
    mm = [str(path / e["path"]) for e in manifest.get("mm", [])]
    return text, mm, str(path / manifest["tokenizer"])


def corpus_val_shards(path: Path) -> list[str]:
    """The held-out shards (text, then multimodal) of a default corpus directory."""
    manifest = json.loads((path / "manifest.json").read_text())
    return [str(path / e["path"]) for name in ("val-text", "val-mm") for e in manifest.get(name, [])]
