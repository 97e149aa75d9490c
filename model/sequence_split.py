"""Context parallelism, the model's side: which positions of a sequence this rank holds, and the two
exchanges CSA2 needs across that split (V41_SPEC §2; DESIGN.md "Context parallel").

Under context parallelism `size` ranks share every sequence. The **queries** are split, not the heads:
each rank holds the residual streams, queries and top-k of its positions; all 64 heads share one 512-d
compressed KV and one index-K, which are small and are gathered whole.

Chunk assignment (`balance`): causal attention and indexing cost grow with position, so by default
(`zigzag`) the sequence is cut into 2C chunks (as even as possible) and rank r holds chunks r and
2C - 1 - r: every rank gets one early and one late chunk. `contiguous` gives rank r the r-th of C.
A rank's positions are its chunks concatenated in order (`positions`); RoPE and visibility use them.

Exchanges, both with autograd (the gradient of a value goes back to the rank that computed it):
- `halo`: for each local chunk starting at g0, the rows of the previous `width` positions
  [g0 - width, g0) from whichever ranks hold them -- the sliding window's keys/values (window - 1) and
  the compressor's per-token projections of a group that straddles g0 (m - 1). Each rank contributes
  the last `width` rows of each of its chunks; one all-gather of these tails serves every chunk.
- `gather_entries`: compressed entries. Group j (tokens [j m, (j + 1) m)) is owned by the chunk holding
  its last token, (j + 1) m - 1; its owner pools it (with the halo for the straddling part) and the
  all-gather returns every entry in order.
- `sum`: whole-sequence statistics (balance-loss counts, loss denominators), no gradient.

The collectives are injected (`comm`, parallel/context.py: `gather(x)` all-gathers equal-shaped tensors
along dim 0 with autograd, `sum(x)` all-reduces); model/ itself never touches torch.distributed.
With `size` 1 (`whole`), nothing is exchanged and every method is the identity on one chunk [0, S).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flashtrain.config.errors import ConfigError

BALANCE_MODES = ("zigzag", "contiguous")


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


@functools.cache
def chunk_ranges(seq_len: int, size: int, balance: str) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rank, its [start, end) chunks of a `seq_len` sequence, in increasing order."""
    if balance not in BALANCE_MODES:
        raise ConfigError(f"parallel.cp_balance={balance!r}: use one of {', '.join(BALANCE_MODES)}")
    n = 2 * size if balance == "zigzag" and size > 1 else size
    if seq_len < n:
        raise ConfigError(f"a sequence of {seq_len} tokens cannot be cut into {n} context-parallel chunks; lower "
                          f"parallel.cp or raise data.seq_len")
    bounds = [0]
    for k in _even(seq_len, n):
        bounds.append(bounds[-1] + k)
    chunks = [(bounds[i], bounds[i + 1]) for i in range(n)]
    if n == size:
        return tuple((c,) for c in chunks)
    return tuple((chunks[r], chunks[n - 1 - r]) for r in range(size))


def causal_cost(ranges, seq_len: int, window: int = 0) -> float:
    """Relative attention / indexing work of queries in `ranges`: each query scores every earlier
    compressed entry (proportional to its position) plus a window band."""
    return float(sum((b * (b + 1) - a * (a + 1)) / 2 + (b - a) * window for a, b in ranges))


@dataclass(frozen=True)
class SequenceSplit:
    seq_len: int
    size: int = 1
    rank: int = 0
    balance: str = "zigzag"
    comm: object = field(default=None, compare=False, repr=False)

    @classmethod
    def whole(cls, seq_len: int) -> "SequenceSplit":
        return cls(seq_len)

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        return chunk_ranges(self.seq_len, self.size, self.balance)[self.rank]

    @property
    def length(self) -> int:
        return sum(b - a for a, b in self.chunks)

    @property
    def offsets(self) -> list[int]:
        """Where each local chunk starts in the local (concatenated) order."""
        out, o = [], 0
        for a, b in self.chunks:
            out.append(o)
            o += b - a
        return out

    def positions(self, device=None) -> torch.Tensor:
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.chunks])

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of a whole-sequence tensor `x` (sequence along `dim`)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"a whole-sequence tensor of {x.shape[dim]} positions along dim {dim}, but the split "
                             f"is for {self.seq_len}")
        if self.size == 1:
            return x
        return torch.cat([x.narrow(dim, a, b - a) for a, b in self.chunks], dim=dim)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks of the split (no gradient)."""
        return t if self.size == 1 else self.comm.sum(t)

    # --- exchanges -------------------------------------------------------------------------------
    def halo(self, feats: torch.Tensor, width: int) -> list[torch.Tensor]:
        """feats [B, L, F] (local order) -> per local chunk [g0, g1), the rows of positions
        [g0 - h, g0) with h = min(width, g0), from their owners (with autograd). When every chunk is at
        least `width` long the previous chunk holds them all: point-to-point with its owner (or a local
        copy); otherwise one all-gather of every chunk's tail."""
        if self.size == 1:  # (never decided per rank: every rank of the split must take part in the exchange)
            return [feats[:, :0] for _ in self.chunks]
        plan = halo_plan(self.seq_len, self.size, self.balance, width, self.rank)
        if plan is not None:
            return list(self.comm.neighbours(feats, plan))
        tails = []
        for (a, b), o in zip(self.chunks, self.offsets):
            n = min(width, b - a)
            tails.append(F.pad(feats[:, o + b - a - n:o + b - a], (0, 0, width - n, 0)))
        table = self._gather(torch.stack(tails))  # [size * chunks, B, width, F]
        table = table.movedim(0, 1).flatten(1, 2)
        rows = _halo_rows(self.seq_len, self.size, self.balance, width, self.rank)
        return [table[:, torch.tensor(r, dtype=torch.long, device=feats.device)] for r in rows]

    def gather_entries(self, parts: list[torch.Tensor], ratio: int) -> torch.Tensor:
        """parts[k] [B, n_k, F]: the compressed entries owned by local chunk k (groups g0 // m ..
        g1 // m - 1) -> every entry of the sequence [B, seq_len // m, F], in order."""
        if self.size == 1:
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        width, index = _entry_rows(self.seq_len, self.size, self.balance, ratio)
        padded = torch.stack([F.pad(p, (0, 0, 0, width - p.shape[1])) for p in parts])
        table = self._gather(padded).movedim(0, 1).flatten(1, 2)
        return table[:, torch.tensor(index, dtype=torch.long, device=table.device)]

    def gather_ranks(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [counts[rank], F] of this rank -> every rank's rows concatenated in rank order."""
        if self.size == 1:
            return rows
        width = max(counts)
        table = self._gather(F.pad(rows, (0, 0, 0, width - rows.shape[0])).unsqueeze(0))
        return torch.cat([table[r, :n] for r, n in enumerate(counts)])

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else self.comm.gather(x)


@dataclass(frozen=True)
class HaloPlan:
    """Point-to-point halo of one rank: per local chunk, where its halo rows come from -- ("none", 0, 0,
    -1): the sequence start; ("local", a, b, -1): local rows a..b (the previous chunk is this rank's);
    ("peer", 0, h, r): h rows from rank r -- and the local row ranges it sends to the rank holding the
    next chunk (a, b, r)."""

    sources: tuple[tuple[str, int, int, int], ...]
    sends: tuple[tuple[int, int, int], ...]


@functools.cache
def halo_plan(seq_len: int, size: int, balance: str, width: int, rank: int) -> HaloPlan | None:
    """None when some chunk is shorter than `width` (a halo would span several chunks)."""
    ranges = chunk_ranges(seq_len, size, balance)
    chunks = sorted((a, b, r, k) for r, cs in enumerate(ranges) for k, (a, b) in enumerate(cs))
    if any(b - a < width for a, b, _, _ in chunks):
        return None
    offsets = {}
    for r, cs in enumerate(ranges):
        o = 0
        for k, (a, b) in enumerate(cs):
            offsets[r, k] = o
            o += b - a
    sources, sends = [], []
    for i, (a, b, r, k) in enumerate(chunks):
        if r == rank:
            if i == 0:
                sources.append((a, ("none", 0, 0, -1)))
            else:
                pa, pb, pr, pk = chunks[i - 1]
                if pr == rank:
                    end = offsets[pr, pk] + pb - pa
                    sources.append((a, ("local", end - width, end, -1)))
                else:
                    sources.append((a, ("peer", 0, width, pr)))
        if i + 1 < len(chunks) and r == rank and chunks[i + 1][2] != rank:
            end = offsets[r, k] + b - a
            sends.append((end - width, end, chunks[i + 1][2]))
    return HaloPlan(tuple(src for _, src in sorted(sources)), tuple(sends))


@functools.cache
def _halo_rows(seq_len: int, size: int, balance: str, width: int, rank: int) -> list[list[int]]:
    """Rows of the gathered tail table ([size x chunks x width], rank-major) holding positions
    [g0 - min(width, g0), g0) for each of `rank`'s chunks."""
    ranges = chunk_ranges(seq_len, size, balance)
    row_of: dict[int, int] = {}
    for r, chunks in enumerate(ranges):
        for k, (a, b) in enumerate(chunks):
            base = (r * len(chunks) + k) * width
            for p in range(max(a, b - width), b):
                row_of[p] = base + width - (b - p)
    return [[row_of[p] for p in range(a - min(width, a), a)] for a, _ in ranges[rank]]


@functools.cache
def _entry_rows(seq_len: int, size: int, balance: str, ratio: int) -> tuple[int, list[int]]:
    """(entries per padded part, row of the gathered [size x chunks x width] table for every entry)."""
    ranges = chunk_ranges(seq_len, size, balance)
    owned = [[(a // ratio, b // ratio) for a, b in chunks] for chunks in ranges]
    width = max(max(j1 - j0 for j0, j1 in chunks) for chunks in owned)
    index = [0] * (seq_len // ratio)
    for r, chunks in enumerate(owned):
        for k, (j0, j1) in enumerate(chunks):
            for j in range(j0, j1):
                index[j] = (r * len(chunks) + k) * width + j - j0
    return width, index
