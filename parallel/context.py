"""Context-parallel sequence exchanges (DESIGN.md "Parallelism": context parallel; V41_SPEC §2 CSA2).

Under context parallelism each rank of a `cp` group holds one contiguous slice of every sequence
(rank c: positions [c x S/C, (c + 1) x S/C)) and the queries of its slice. CSA2 needs, across slice
boundaries, only two kinds of exchange, both with autograd so gradients return to the rank that owns
the values:
- `halo_from_previous`: the last `width` positions of the previous rank's slice (zeros on rank 0):
  the sliding window's keys/values (window - 1), the compressor's straddling group (m - 1 tokens),
  the Engram n-gram look-back (max_ngram - 1 tokens). Backward sends the halo's gradient to its owner.
- `gather_sequence`: every rank's slice concatenated along the sequence (the compressed KV and
  index-K, shared by all 64 heads and small); backward reduce-scatters, each owner receiving the sum
  of every rank's gradient for its entries.
Split along the sequence dimension `dim` (1 for [B, S, ...]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single_autograd


def _shift(t: torch.Tensor, group, forward: bool) -> torch.Tensor:
    """Rank c sends `t` to c + 1 (forward) or c - 1 (backward) and returns what it receives (zeros at
    the end of the chain)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    peer_to, peer_from = (rank + 1, rank - 1) if forward else (rank - 1, rank + 1)
    out = torch.zeros_like(t)
    ops = []
    if 0 <= peer_to < size:
        ops.append(dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, peer_to), group))
    if 0 <= peer_from < size:
        ops.append(dist.P2POp(dist.irecv, out, dist.get_global_rank(group, peer_from), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tail: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _shift(tail, group, forward=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad, ctx.group, forward=False), None


def halo_from_previous(x: torch.Tensor, width: int, group, dim: int = 1) -> torch.Tensor:
    """The previous rank's last `width` positions of `x` along `dim` (zeros on the group's first rank),
    shaped like `x` with `width` positions. `width` must not exceed the local slice."""
    if width > x.shape[dim]:
        raise ValueError(f"halo of {width} positions from a slice of {x.shape[dim]}: context parallelism needs "
                         f"slices at least as long as the look-back (lower parallel.cp or raise data.seq_len)")
    if width == 0:
        return x.narrow(dim, 0, 0)
    return _Halo.apply(x.narrow(dim, x.shape[dim] - width, width), group)


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Every rank's slice of `x`, concatenated along `dim` in rank order (equal slices)."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    out = all_gather_single_autograd(x.movedim(dim, 0).contiguous(), gather_dim=0, group=group)
    if hasattr(out, "wait"):
        out = out.wait()
    return out.movedim(0, dim)
