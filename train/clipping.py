"""Global gradient-norm clipping over every parallel dimension (DESIGN.md "Training": clip).

The norm is that of the whole model's gradient, as one process would see it:
- gradients replicated over data-parallel ranks (already averaged) count once;
- gradients sharded over a group (routed experts under expert parallelism: each EP rank holds other
  experts) add their squared norms over that `shard_group`;
- every pipeline stage holds other parameters: the squared norms add over the `stage_group`.
Gradients are then scaled by min(1, max_norm / (norm + 1e-6)): clipped when above `max_norm`, left
exactly as they are when below (never scaled up).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist

CLIP_EPS = 1e-6


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack([g.detach().float().norm() for g in grads]).square().sum().to(device)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t


def global_grad_norm(named_grads: Iterable[tuple[str, torch.Tensor]], device: torch.device,
                     is_sharded: Callable[[str], bool] = lambda name: False, shard_group=None,
                     stage_group=None) -> torch.Tensor:
    """sqrt(sum over stages of (replicated squares + sum over the shard group of sharded squares))."""
    named = list(named_grads)
    sq = _sum_of_squares([g for n, g in named if not is_sharded(n)], device)
    sharded = _sum_of_squares([g for n, g in named if is_sharded(n)], device)
    sq = sq + _all_reduce(sharded.reshape(1), shard_group).reshape(())
    return _all_reduce(sq.reshape(1), stage_group).reshape(()).sqrt()


def clip_grad_norm_(named_grads: Iterable[tuple[str, torch.Tensor]], max_norm: float, device: torch.device,
                    is_sharded: Callable[[str], bool] = lambda name: False, shard_group=None,
                    stage_group=None) -> torch.Tensor:
    """Scale the gradients in place so that the global norm is at most `max_norm`; returns the norm
    before clipping as a 0-dim tensor (no host sync here). Every rank must call it (the norm is
    all-reduced)."""
    named = list(named_grads)
    norm = global_grad_norm(named, device, is_sharded, shard_group, stage_group)
    coef = (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)
    grads = [g for _, g in named]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
