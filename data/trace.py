"""Which data did step N see? (`data.trace`, issue 48 item 2; docs/data.md "The data trace").

With `data.trace=true`, every rank that reads data (pipeline rank 0, context-parallel rank 0 of each
data-parallel rank) appends one JSON line per micro-batch it trains on to `<run dir>/data_trace/
dp<dp rank>-of-<readers>.jsonl`:

    {"step": 12, "micro_batch": 0, "dp_rank": 1, "readers": 2,
     "rows": [[[SOURCE, SHARD, KEY, EPOCH, START, END], ...], ...]}

one list per row of the micro-batch, one entry per piece of a document packed into it, in row order:
the data source's name, the shard, the document's sample key in it, the epoch of the source that read
it, and the document's positions [START, END) in its `[BOS] + segments + [EOS]` sequence. It is how a
user finds the documents behind a loss spike (`grep '"step": 12,'`), and how the tests check that every
document is read once over a run with restarts and layout changes.

A start that resumes from step N first removes every line after step N from every trace file (rank 0,
before any rank writes): the steps a lost start traced are traced again by the re-run, once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

TRACE_DIR = "data_trace"


def truncate_traces(run_dir: str | Path, step: int) -> int:
    """Remove the lines after `step` from every trace file of the run directory; returns how many."""
    removed = 0
    for path in sorted((Path(run_dir) / TRACE_DIR).glob("*.jsonl")):
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        keep = [line for line in lines if line.strip() and _step(line) <= step]
        if len(keep) != len(lines):
            removed += len(lines) - len(keep)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(keep), encoding="utf-8")
            tmp.replace(path)
    return removed


def _step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):  # a line cut by a kill: not a step that was trained
        return 1 << 62


class DataTrace:
    """One rank's trace file (module docstring); `record(step, batches)` per training step."""

    def __init__(self, run_dir: str | Path, source_names: list[str], dp_rank: int, readers: int):
        self.names = source_names
        self.dp_rank, self.readers = dp_rank, readers
        path = Path(run_dir) / TRACE_DIR / f"dp{dp_rank}-of-{readers}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def record(self, step: int, batches: list[dict]) -> None:
        for i, batch in enumerate(batches):
            rows = [[[self.names[s], *origin] for s, origin in row if origin is not None] for row in batch["trace"]]
            self._file.write(json.dumps({"step": step, "micro_batch": i, "dp_rank": self.dp_rank,
                                         "readers": self.readers, "rows": rows}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def open_trace(on: bool, run_dir: str | Path, step: int, names: list[str], dims, reads: bool) -> DataTrace | None:
    """`data.trace` (`on`) at a start after `step` steps: rank 0 removes what a lost start traced after the resumed
    step, then each rank that `reads` data opens its file; None when off or not reading."""
    if not on:
        return None
    if dims.rank == 0:
        truncate_traces(run_dir, step)
    if dist.is_initialized():
        dist.barrier()
    return DataTrace(run_dir, names, dims.dp_rank, dims.dp) if reads else None
