"""Webdataset tar shards of tokenized documents (format: data/README.md).

A document is a list of segments: text (already tokenized, int32) or an image (encoded bytes + file
extension). In a shard, document `k` is the members `k.json` (segment layout), `k.tokens.npy` (all its
text tokens, concatenated) and `k.<i>.<ext>` (its i-th image) -- the webdataset convention of one key
per sample. Readers skip and count what they cannot read; they never raise on bad data.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Document:
    """segments: ("text", int32 array) or ("image", bytes, extension)."""

    segments: list = field(default_factory=list)

    @property
    def n_text_tokens(self) -> int:
        return sum(len(s[1]) for s in self.segments if s[0] == "text")

    @property
    def n_images(self) -> int:
        return sum(1 for s in self.segments if s[0] == "image")


@dataclass
class ReadStats:
    """Counts of what readers skipped (exposed to metrics)."""

    corrupt_shards: int = 0
    bad_samples: int = 0

    def as_dict(self) -> dict:
        return {"corrupt_shards": self.corrupt_shards, "bad_samples": self.bad_samples}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0  # reproducible shards
    tar.addfile(info, io.BytesIO(data))


def write_shards(docs: Iterable[Document], out_dir: str | Path, prefix: str, docs_per_shard: int) -> list[dict]:
    """Write documents into `<out_dir>/<prefix>-<n>.tar`; returns one manifest entry per shard."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries: list[dict] = []
    tar, entry = None, None

    def close():
        if tar is not None:
            tar.close()
            entries.append(entry)

    for i, doc in enumerate(docs):
        if i % docs_per_shard == 0:
            close()
            path = out_dir / f"{prefix}-{len(entries):05d}.tar"
            tar = tarfile.open(path, "w")
            entry = {"path": path.name, "documents": 0, "text_tokens": 0, "images": 0}
        key = f"{i:09d}"
        layout, tokens, n_img = [], [], 0
        for seg in doc.segments:
            if seg[0] == "text":
                layout.append({"text": int(len(seg[1]))})
                tokens.append(np.asarray(seg[1], dtype=np.int32))
            else:
                name = f"{n_img}.{seg[2]}"
                layout.append({"image": name})
                _add(tar, f"{key}.{name}", seg[1])
                n_img += 1
        buf = io.BytesIO()
        np.save(buf, np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32))
        _add(tar, f"{key}.json", json.dumps({"segments": layout}).encode())
        _add(tar, f"{key}.tokens.npy", buf.getvalue())
        entry["documents"] += 1
        entry["text_tokens"] += sum(len(t) for t in tokens)
        entry["images"] += n_img
    close()
    return entries


def _parse(members: dict[str, bytes]) -> Document:
    layout = json.loads(members["json"])["segments"]
    tokens = np.load(io.BytesIO(members["tokens.npy"]), allow_pickle=False).astype(np.int64)
    doc, pos = Document(), 0
    for seg in layout:
        if "text" in seg:
            n = int(seg["text"])
            if pos + n > len(tokens):
                raise ValueError("layout asks for more text tokens than the sample holds")
            doc.segments.append(("text", tokens[pos:pos + n]))
            pos += n
        else:
            name = seg["image"]
            doc.segments.append(("image", members[name], name.rsplit(".", 1)[-1]))
    return doc


def _ends_cleanly(path: str) -> bool:
    """A complete tar ends with two zero 512-byte blocks (tarfile's stream reader does not notice
    truncation on its own)."""
    try:
        size = os.path.getsize(path)
        if size < 1024 or size % 512:
            return False
        with open(path, "rb") as f:
            f.seek(size - 1024)
            return not any(f.read(1024))
    except OSError:
        return False


def read_shard(path: str, stats: ReadStats, skip: int = 0) -> Iterator[Document | None]:
    """Documents of a shard in order, after skipping the first `skip`. A sample that cannot be parsed
    yields None (counted in stats.bad_samples) so positions stay countable; a truncated tar (checked
    up front) or one that fails to parse is counted in stats.corrupt_shards, and only its complete
    samples are read."""
    current, members, index = None, {}, 0

    def finish():
        nonlocal index
        idx = index
        index += 1
        if idx < skip:
            return False, None
        try:
            return True, _parse(members)
        except Exception as e:  # noqa: BLE001 - any malformed sample is skipped and counted
            stats.bad_samples += 1
            log.warning("skipping bad sample %s in %s: %s", current, path, e)
            return True, None

    if not _ends_cleanly(path):
        stats.corrupt_shards += 1
        log.warning("shard %s is truncated (no end-of-archive blocks); reading its complete samples only", path)
    try:
        with tarfile.open(path, "r|") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, _, ext = m.name.partition(".")
                if key != current and current is not None:
                    emit, doc = finish()
                    if emit:
                        yield doc
                    members = {}
                current = key
                members[ext] = tar.extractfile(m).read() if index >= skip else b""
            if current is not None:
                emit, doc = finish()
                if emit:
                    yield doc
    except (tarfile.TarError, EOFError, OSError) as e:
        stats.corrupt_shards += 1
        log.warning("shard %s is corrupt or truncated (%s); skipping the rest of it", path, e)
