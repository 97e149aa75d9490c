"""Context parallelism, the collectives (DESIGN.md "Context parallel"; the model's side, which positions a
rank holds and what it exchanges, is model/sequence_split.py).

`ContextComm` is what the model's `SequenceSplit` calls over the `cp` group:
- `gather(x)`: every rank's `x` (equal shapes) stacked along dim 0 in rank order, with autograd: the
  backward reduce-scatters, so each rank receives the sum of every rank's gradient for its own rows --
  the window halo's and the compressed KV's gradients go back to the rank that computed them;
- `neighbours(feats, plan)`: the window / compressor halo by point-to-point exchange with the ranks that
  own the neighbouring chunks (the rows go to their successor's owner, the gradients come back);
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


class _Neighbours(torch.autograd.Function):
    """The halo by point-to-point exchange with the ranks that own the neighbouring chunks
    (model/sequence_split.py `halo_plan`): forward receives each local chunk's halo (or copies it from a
    local predecessor), backward returns the halos' gradients to their owners. `feats` is the input
    whole, so every rank's graph holds this node and runs its backward exchange."""

    @staticmethod
    def forward(ctx, feats: torch.Tensor, group, plan) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.plan, ctx.shape, ctx.like = group, plan, feats.shape, feats.new_empty(0)
        recv = {}
        ops = []
        for k, (kind, a, b, peer) in enumerate(plan.sources):
            if kind == "peer":
                recv[k] = feats.new_empty((feats.shape[0], b - a) + tuple(feats.shape[2:]))
                ops.append(dist.P2POp(dist.irecv, recv[k], dist.get_global_rank(group, peer), group))
        for a, b, peer in plan.sends:
            ops.append(dist.P2POp(dist.isend, feats[:, a:b].contiguous(), dist.get_global_rank(group, peer), group))
        _run(ops)
        out = []
        for k, (kind, a, b, _) in enumerate(plan.sources):
            out.append(recv[k] if kind == "peer" else feats[:, a:b].clone())  # "local" or "none" (a == b)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        plan, group = ctx.plan, ctx.group
        ref = ctx.like
        grad = ref.new_zeros(ctx.shape)
        ops, back = [], []
        for k, (kind, a, b, peer) in enumerate(plan.sources):
            g = grads[k] if grads[k] is not None else ref.new_zeros((ctx.shape[0], b - a) + tuple(ctx.shape[2:]))
            if kind == "peer":
                ops.append(dist.P2POp(dist.isend, g.contiguous(), dist.get_global_rank(group, peer), group))
            elif kind == "local":
                grad[:, a:b] += g
        for a, b, peer in plan.sends:
            t = ref.new_empty((ctx.shape[0], b - a) + tuple(ctx.shape[2:]))
            back.append((a, b, t))
            ops.append(dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group))
        _run(ops)
        for a, b, t in back:
            grad[:, a:b] += t
        return grad, None, None


def _run(ops) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class ContextComm:
    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(x, self.group, self.size)

    def neighbours(self, feats: torch.Tensor, plan) -> tuple[torch.Tensor, ...]:
        return _Neighbours.apply(feats, self.group, plan)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = t.detach().clone()
            dist.all_reduce(out, group=self.group)
            return out
