"""Text documents from the files people have, streamed (launch/prepare_data.py; docs/data.md):

- `.txt`: one document per file, or one per non-empty line (`per_line`);
- `.jsonl`, `.jsonl.gz`, `.jsonl.zst`: one document per line, its "text" field (gzip from the standard
  library, zstd through `zstandard`);
- `.parquet`: one document per row of its `text` column, read in record batches (through `pyarrow`).

A directory stands for every such file below it, sorted. Nothing reads a whole file into memory but a
`.txt` document; what cannot be used (a line that is not a JSON object with a string "text", an empty
document, text that is not UTF-8 (`undecoded`), a parquet file without a `text` column, the rest of a
truncated compressed file) is skipped and counted by reason in `InputStats`, which also names where
(`file`, `file:line` of a jsonl line or of a `.txt` line, `file:row N` of a parquet row; the first
`MAX_NAMED` of each reason) and reports each as it is found. A line number is the line's number in the
file as an editor shows it: every line counted, blank ones too, lines ending at a newline only (not at
the other characters `str.splitlines` breaks at, such as a form feed or U+2028, which JSON strings may
hold as they are).

Bytes are decoded as UTF-8, what is not UTF-8 read as U+FFFD; a document with more than
`MAX_UNDECODED_SHARE` of its characters U+FFFD or NUL is "not UTF-8 text" (a binary file, random bytes,
UTF-16, a Latin-1 file), so it never becomes a training document of replacement characters. `.txt` with
`per_line` checks the whole file first (one skip, named `file`) and then each line.
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
# A document is not UTF-8 text when more than this share of its characters are U+FFFD (what a byte that is
# not UTF-8 decodes to; one already in the text marks bytes lost before, and counts the same) or NUL. Text that
# is not UTF-8 lands far above it: random bytes or a binary file about half, UTF-16 half (a NUL beside every
# Latin letter), Latin-1 French a few percent (each accented letter). A UTF-8 document with a stray bad byte
# stays under it and is kept, that byte read as U+FFFD (in a short document one bad byte is already more than
# 1%: a line of 50 characters with one is skipped).
MAX_UNDECODED_SHARE = 0.01

# why an input is skipped (the keys of InputStats.skipped)
NOT_JSON = "not JSON"
NO_TEXT = "no text field"
TEXT_NOT_STRING = "text field not a string"
EMPTY = "empty document"
NOT_UTF8 = "not UTF-8 text"
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


def undecoded(text: str) -> str | None:
    """Why `text` is not UTF-8 text (`MAX_UNDECODED_SHARE`), as the detail of a NOT_UTF8 skip; None if it is."""
    bad = text.count("\ufffd") + text.count("\x00")
    if bad <= MAX_UNDECODED_SHARE * len(text):
        return None
    return (f"{bad:,} of {len(text):,} characters are bytes that are not UTF-8 or NUL; at most "
            f"{MAX_UNDECODED_SHARE:.0%} may be")


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


def numbered_lines(path: Path, stats: InputStats) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline) of a jsonl file (.jsonl, .jsonl.gz, .jsonl.zst), streamed:
    every line counted, blank ones too, so that `file:line` is where an editor shows it. A truncated or
    corrupt compressed file gives what it had, then one TRUNCATED skip named at the line where reading
    stopped."""
    lines = _lines(path, _kind(path))
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
        yield n, line.removesuffix("\n")


def _texts_of(column) -> list:
    """A parquet batch's text column as Python values; a string column holding bytes that are not UTF-8 (which
    pyarrow does not check on reading) is decoded with U+FFFD for them, for `undecoded` to judge per row."""
    import pyarrow as pa

    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        raw = column.view(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
        return [v if v is None else v.decode("utf-8", errors="replace") for v in raw.to_pylist()]


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
        for value in _texts_of(batch.column(0)):
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
            content = f.read_text(encoding="utf-8", errors="replace")  # universal newlines: every line ends in \n
            if per_line and (why := undecoded(content)):  # a file that is not text: one skip, not one per line
                stats.skip(NOT_UTF8, str(f), why)
                continue
            docs: Iterator[tuple[str, str]] = (
                ((f"{f}:{n}", line) for n, line in enumerate(content.split("\n"), 1)) if per_line
                else iter([(str(f), content)]))
        elif kind == ".parquet":
            docs = _parquet_texts(f, stats)
        else:
            docs = _json_texts(f, stats)
        for where, doc in docs:
            if not doc.strip():
                if not (per_line and kind == ".txt"):  # blank lines between line documents are no documents
                    stats.skip(EMPTY, where)
                continue
            if why := undecoded(doc):
                stats.skip(NOT_UTF8, where, why)
                continue
            stats.documents += 1
            yield doc


def _json_texts(path: Path, stats: InputStats) -> Iterator[tuple[str, str]]:
    for n, line in numbered_lines(path, stats):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            if why := undecoded(line):  # bytes that are not UTF-8 rather than a JSON mistake
                stats.skip(NOT_UTF8, where, why)
                continue
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
