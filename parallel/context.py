"""Context parallelism, the collectives (DESIGN.md "Context parallel"; the model's side, which positions a
rank holds and what it exchanges, is model/sequence_split.py).

`ContextComm` is what the model's `SequenceSplit` calls over the `cp` group:
- `gather(x)`: every rank's `x` (equal shapes) stacked along dim 0 in rank order, with autograd: the
  backward reduce-scatters, so each rank receives the sum of every rank's gradient for its own rows --
  the window halo's and the compressed KV's gradients go back to the rank that computed them;
- `sum(t)`: all-reduce without gradient (whole-sequence statistics: balance-loss selection counts, the
  number of label positions and of indexer queries).
Both are eager c10d collectives: an activation-checkpoint recomputation (model/recompute.py) runs them
again, on every rank of the group in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 names (the older ones warn there); the device machines may run an older torch
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _Gather(torch.autograd.Function):
    """All-gather along dim 0 (eager c10d, so an activation-checkpoint recomputation simply runs it again on
    every rank); backward: reduce-scatter sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // ctx.size,) + tuple(grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None, None


class ContextComm:
    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(x, self.group, self.size)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = t.detach().clone()
            dist.all_reduce(out, group=self.group)
            return out
