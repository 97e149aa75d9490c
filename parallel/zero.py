"""ZeRO-1 ownership (DESIGN.md "Parallelism": data parallel): which rank of a parameter's replica
group keeps the optimizer state of which part of it and computes its update.

Every parameter replicated over a group of `size` ranks (non-expert parameters over dp; routed experts
over the replicas of their shard, dp / ep ranks) is cut into `Piece`s -- contiguous ranges of its
flattened elements, each with one owner -- by the rule of its optimizer (V41_SPEC §7):
- Muon: whole matrices (a 2-D weight is one; a stacked [E, out, in] expert weight is E; a head-wise
  [H d, in] query weight is H), since the owner runs Newton-Schulz on them. Matrices are grouped into
  at most `size` contiguous pieces per parameter and the pieces of all Muon parameters of the group are
  given to owners largest-cost-first to the least-loaded rank (LPT), the cost being Newton-Schulz flops
  (k rows cols min(rows, cols)) -- balanced by work, not by count;
- Sinkhorn: contiguous row blocks of near-equal size (the row-sharded update, train/optim/sinkhorn.py);
- AdamW: equal flat element chunks (ceil(numel / size) each), so every rank holds 1/size of each state.
A parameter that is not replicated (already sharded: experts with one replica, a row-sharded Engram
table) is one piece owned here. The plan depends only on shapes and the group size, so every rank
computes the same plan without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    start: int  # flat element range [start, end) of the local parameter
    end: int
    owner: int  # rank within the replica group

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class Ownership:
    """The pieces of one parameter over its replica group (None: not replicated, all of it here)."""

    pieces: list[Piece]
    rank: int = 0  # this rank within the group
    group: object = None

    def mine(self) -> list[Piece]:
        return [p for p in self.pieces if p.owner == self.rank and p.numel]

    @property
    def owned_numel(self) -> int:
        return sum(p.numel for p in self.mine())


def whole(numel: int) -> Ownership:
    return Ownership([Piece(0, numel, 0)])


def flat_pieces(numel: int, size: int) -> list[Piece]:
    """AdamW: equal chunks of ceil(numel / size) elements (the last ones shorter or empty)."""
    per = -(-numel // size)
    return [Piece(min(numel, k * per), min(numel, (k + 1) * per), k) for k in range(size)]


def row_pieces(rows: int, row_numel: int, size: int) -> list[Piece]:
    """Sinkhorn: `size` contiguous row blocks, sizes differing by at most one row."""
    base, extra = divmod(rows, size)
    out, r = [], 0
    for k in range(size):
        n = base + (1 if k < extra else 0)
        out.append(Piece(r * row_numel, (r + n) * row_numel, k))
        r += n
    return out


def ns_cost(n_matrices: int, rows: int, cols: int) -> float:
    """Newton-Schulz flops of n matrices, up to the constant factor shared by all of them."""
    return float(n_matrices) * rows * cols * min(rows, cols)


def matrix_pieces(n_matrices: int, rows: int, cols: int, size: int) -> list[tuple[int, int]]:
    """Split n matrices into at most `size` contiguous runs [i0, i1) of near-equal length."""
    k = min(n_matrices, size)
    base, extra = divmod(n_matrices, k)
    runs, i = [], 0
    for j in range(k):
        n = base + (1 if j < extra else 0)
        runs.append((i, i + n))
        i += n
    return runs


def balance_matrices(params: list[tuple[str, int, int, int]], size: int) -> dict[str, list[Piece]]:
    """params: (name, n_matrices, rows, cols) of the parameters of one replica group split by whole matrices
    (Muon's), in a fixed order. Returns each parameter's pieces with owners, LPT-balanced by Newton-Schulz cost."""
    runs = []  # (cost, order, name, i0, i1, rows, cols)
    for order, (name, n, r, c) in enumerate(params):
        for i0, i1 in matrix_pieces(n, r, c, size):
            runs.append((ns_cost(i1 - i0, r, c), order, name, i0, i1, r, c))
    load = [0.0] * size
    owners: dict[tuple[str, int], int] = {}
    for cost, order, name, i0, i1, r, c in sorted(runs, key=lambda x: (-x[0], x[1], x[3])):
        k = min(range(size), key=lambda j: (load[j], j))
        load[k] += cost
        owners[(name, i0)] = k
    out: dict[str, list[Piece]] = {name: [] for name, *_ in params}
    for cost, order, name, i0, i1, r, c in sorted(runs, key=lambda x: (x[1], x[3])):
        out[name].append(Piece(i0 * r * c, i1 * r * c, owners[(name, i0)]))
    return out
