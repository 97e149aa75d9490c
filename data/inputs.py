"""Text documents from the files people have, streamed (launch/prepare_data.py; docs/data.md):

- `.txt`: one document per file, or one per non-empty line (`per_line`);
- `.jsonl`, `.jsonl.gz`, `.jsonl.zst`: one document per line, its "text" field (gzip from the standard
  library, zstd through `zstandard`);
- `.parquet`: one document per row of its `text` column, read in record batches (through `pyarrow`).

A directory stands for every such file below it, sorted. Nothing reads a whole file into memory but a
`.txt` document; what cannot be used (a line that is not a JSON object with a string "text", an empty
document, a parquet file without a `text` column, the rest of a truncated compressed file) is skipped
and counted by reason in `InputStats`, which also names where (`file`, `file:line` of a jsonl line,
`file:row N` of a parquet row; the first `MAX_NAMED` of each reason) and reports each as it is found.
`zstandard` and `pyarrow` are the optional extra `.[data]`.
"""

from __future__ import annotations

import gzip
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from flashtrain.config.errors import DataError, InputNotFoundError

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
PARQUET_BATCH_ROWS = 1024
MAX_NAMED = 100  # skipped inputs named per reason (every one is counted)

# why an input is skipped (the keys of InputStats.skipped)
NOT_JSON = "not JSON"
NO_TEXT = "no text field"
TEXT_NOT_STRING = "text field not a string"
EMPTY = "empty document"
TRUNCATED = "rest of a truncated or corrupt file"
NO_TEXT_COLUMN = "parquet file without a text column"
ROW_NOT_STRING = "parquet row whose text is not a string"


@dataclass
class InputStats:
    """Documents read and inputs skipped: counted by reason (`skipped`) and named by where they are
    (`named`: reason -> the first MAX_NAMED `file`, `file:line` or `file:row N`). `report`, when set,
    receives one line per named skip as it happens (launch/prepare_data.py prints them)."""

    documents: int = 0
    skipped: Counter = field(default_factory=Counter)
    named: dict = field(default_factory=dict)
    report: Callable[[str], None] | None = None

    def skip(self, reason: str, where: str, detail: str = "", quiet: bool = False) -> None:
        """Count a skipped input under `reason`, name it (`where`) and report it (unless `quiet`: the caller
        has said so already)."""
        self.skipped[reason] += 1
        named = self.named.setdefault(reason, [])
        if len(named) < MAX_NAMED:
            named.append(where)
            if self.report is not None and not quiet:
                self.report(f"skipping {where}: {reason}" + (f" ({detail})" if detail else ""))
        elif self.skipped[reason] == MAX_NAMED + 1 and self.report is not None and not quiet:
            self.report(f"more inputs skipped as '{reason}': counted, no longer named")


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


def _parquet_texts(path: Path, stats: InputStats) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install -e '.[data]')") from None
    pf = pq.ParquetFile(path)
    if "text" not in pf.schema_arrow.names:
        stats.skip(NO_TEXT_COLUMN, str(path), f"columns: {', '.join(pf.schema_arrow.names)}")
        return
    row = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["text"]):
        for value in batch.column(0).to_pylist():
            row += 1
            if isinstance(value, str):
                yield f"{path}:row {row}", value
            else:
                stats.skip(ROW_NOT_STRING, f"{path}:row {row}", f"{type(value).__name__}")


def iter_texts(files: list[Path], per_line: bool, stats: InputStats) -> Iterator[str]:
    """The text documents of `files`, in order (module docstring)."""
    for f in files:
        kind = _kind(f)
        if kind == ".txt":
            content = f.read_text(encoding="utf-8", errors="replace")
            docs: Iterator[tuple[str, str]] = (
                ((f"{f}:{n}", line) for n, line in enumerate(content.splitlines(), 1)) if per_line
                else iter([(str(f), content)]))
        elif kind == ".parquet":
            docs = _parquet_texts(f, stats)
        else:
            docs = _json_texts(f, kind, stats)
        for where, doc in docs:
            if not doc.strip():
                if not (per_line and kind == ".txt"):  # blank lines between line documents are no documents
                    stats.skip(EMPTY, where)
                continue
            stats.documents += 1
            yield doc


def _json_texts(path: Path, kind: str, stats: InputStats) -> Iterator[tuple[str, str]]:
    lines = _lines(path, kind)
    n = 0
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except (EOFError, OSError, ValueError) as e:  # a truncated or corrupt compressed file: what it had
            stats.skip(TRUNCATED, f"{path}:{n + 1}", f"stopped reading: {type(e).__name__}: {e}")
            return
        n += 1
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            stats.skip(NOT_JSON, where, str(e))
            continue
        if not isinstance(obj, dict) or "text" not in obj:
            stats.skip(NO_TEXT, where, f"keys: {', '.join(map(str, obj))}" if isinstance(obj, dict) else
                       f"a JSON {type(obj).__name__}, not an object")
            continue
        if not isinstance(obj["text"], str):
            stats.skip(TEXT_NOT_STRING, where, f"{type(obj['text']).__name__}")
            continue
        yield where, obj["text"]
