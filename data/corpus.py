"""The embedded default corpus, built on first use from material every Python machine has.

- Text stream: the source files of the Python standard library (tests and IDLE excluded), one
  document per file, up to `corpus_text_bytes`.
- Multimodal stream: images rendered with Pillow from that material, each followed by the text it
  shows, so the stream is learnable: (a) 1-4 lines of stdlib code drawn as an image, target = the lines;
  (b) a bar chart of 3-6 small numbers, target = "bar chart: " + the numbers.
- A byte-level BPE tokenizer trained on both (data/tokenizer.py), saved as tokenizer.json.

It is written to a temporary directory and renamed into place when complete, under a name that
encodes everything it depends on (vocabulary, image token, image settings, sizes), so a changed model
config builds a new one and an interrupted build is never used. Building takes well under a minute
on 2 cores; later runs find it cached.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import shutil
import sysconfig
from pathlib import Path

import numpy as np

from flashtrain.data.config import DataConfig, TokenSpec
from flashtrain.data.shards import Document, write_shards
from flashtrain.data.tokenizer import train_tokenizer

VERSION = 1
EXCLUDE_DIRS = {"site-packages", "__pycache__", "test", "tests", "idlelib", "lib2to3"}


def stdlib_texts(max_bytes: int) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for d, dirs, files in os.walk(root):
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


def corpus_key(cfg: DataConfig, spec: TokenSpec) -> str:
    facts = json.dumps([VERSION, spec.vocab_size, spec.bos_id, spec.eos_id, spec.pad_id, spec.image_token_id,
                        cfg.corpus_text_bytes, cfg.corpus_mm_docs, cfg.corpus_shards], sort_keys=True)
    return f"v{VERSION}-vocab{spec.vocab_size}-{hashlib.sha256(facts.encode()).hexdigest()[:10]}"


def ensure_default_corpus(cfg: DataConfig, spec: TokenSpec) -> Path:
    """Directory holding manifest.json, tokenizer.json, text-*.tar and mm-*.tar (built if missing)."""
    root = cfg.cache_dir()
    final = root / corpus_key(cfg, spec)
    if (final / "manifest.json").is_file():
        return final
    tmp = root / f".building-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    texts = stdlib_texts(cfg.corpus_text_bytes)
    examples = multimodal_examples(texts, cfg.corpus_mm_docs, seed=cfg.seed)
    tok = train_tokenizer(texts + [cap for _, cap in examples], spec)
    tok.save(str(tmp / "tokenizer.json"))

    def encode(batch: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(batch, add_special_tokens=False)]

    text_docs = [Document([("text", ids)]) for ids in encode(texts)]
    mm_docs = [Document([("image", png, "png"), ("text", ids)])
               for (png, _), ids in zip(examples, encode([cap for _, cap in examples]))]
    manifest = {"version": VERSION, "tokenizer": "tokenizer.json", "source": "python stdlib + rendered images"}
    for name, docs in (("text", text_docs), ("mm", mm_docs)):
        per_shard = max(1, math.ceil(len(docs) / cfg.corpus_shards))
        manifest[name] = write_shards(docs, tmp, name, per_shard)
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
