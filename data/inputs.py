"""Text documents from the files people have, streamed (launch/prepare_data.py; docs/data.md):

- `.txt`: one document per file, or one per non-empty line (`per_line`);
- `.jsonl`, `.jsonl.gz`, `.jsonl.zst`: one document per line, its "text" field (gzip from the standard
  library, zstd through `zstandard`);
- `.parquet`: one document per row of its `text` column, read in record batches (through `pyarrow`).

A directory stands for every such file below it, sorted. Nothing reads a whole file into memory but a
`.txt` document; what cannot be used (a line that is not a JSON object with a string "text", an empty
document, a parquet file without a `text` column, the rest of a truncated compressed file) is skipped
and counted by reason in `InputStats`.
`zstandard` and `pyarrow` are the optional extra `.[data]`.
"""

from __future__ import annotations

import gzip
import io
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from flashtrain.config.errors import DataError, InputNotFoundError

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
PARQUET_BATCH_ROWS = 1024


@dataclass
class InputStats:
    """Documents read and documents skipped, by reason."""

    documents: int = 0
    skipped: Counter = field(default_factory=Counter)


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in TEXT_SUFFIXES if name.endswith(s)), None)


def text_files(paths: list[str]) -> list[Path]:
    """The input files named by `paths` (files, or directories searched for `TEXT_SUFFIXES`)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.is_file() and _kind(q))
        elif p.is_file():
            if _kind(p) is None:
                raise DataError(f"--text {str(p)!r}: not a text input; use {', '.join(TEXT_SUFFIXES)} files")
            files.append(p)
        else:
            raise InputNotFoundError(f"--text {str(p)!r} does not exist")
    return files


def _lines(path: Path, kind: str) -> Iterator[str]:
    if kind == ".jsonl.gz":
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as fh:
            yield from fh
        return
    if kind == ".jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst needs zstandard (pip install -e '.[data]')") from None
        with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            yield from io.TextIOWrapper(reader, encoding="utf-8", errors="replace")
        return
    with open(path, encoding="utf-8", errors="replace") as fh:
        yield from fh


def _parquet_texts(path: Path, stats: InputStats) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install -e '.[data]')") from None
    pf = pq.ParquetFile(path)
    if "text" not in pf.schema_arrow.names:
        stats.skipped["parquet file without a text column"] += 1
        return
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["text"]):
        for value in batch.column(0).to_pylist():
            if isinstance(value, str):
                yield value
            else:
                stats.skipped["parquet row whose text is not a string"] += 1


def iter_texts(files: list[Path], per_line: bool, stats: InputStats) -> Iterator[str]:
    """The text documents of `files`, in order (module docstring)."""
    for f in files:
        kind = _kind(f)
        if kind == ".txt":
            content = f.read_text(encoding="utf-8", errors="replace")
            docs: Iterator[str] = iter(content.splitlines() if per_line else [content])
        elif kind == ".parquet":
            docs = _parquet_texts(f, stats)
        else:
            docs = _json_texts(f, kind, stats)
        for doc in docs:
            if not doc.strip():
                if not (per_line and kind == ".txt"):  # blank lines between line documents are no documents
                    stats.skipped["empty document"] += 1
                continue
            stats.documents += 1
            yield doc


def _json_texts(path: Path, kind: str, stats: InputStats) -> Iterator[str]:
    lines = _lines(path, kind)
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except (EOFError, OSError, ValueError) as e:  # a truncated or corrupt compressed file: what it had
            stats.skipped["rest of a truncated or corrupt file"] += 1
            print(f"{path}: stopped reading ({type(e).__name__}: {e})", file=sys.stderr)
            return
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError):
            stats.skipped["not a JSON object with a text field"] += 1
            continue
        if not isinstance(text, str):
            stats.skipped["text field not a string"] += 1
            continue
        yield text
