"""Global gradient-norm clipping over every parallel dimension (DESIGN.md "Training": clip).

The norm is that of the whole model's gradient, as one process would see it:
- gradients replicated over data-parallel ranks (already averaged) count once;
- gradients sharded over a group (routed experts under expert parallelism: each EP rank holds other
  experts; row-sharded Engram tables: each dp rank holds other rows) add their squared norms over that
  group, `shard_group_of(name)`;
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


def global_grad_norm(named_grads: Iterable[tuple[str, torch.Tensor | None]], device: torch.device,
                     shard_group_of: Callable[[str], object] = lambda name: None, stage_group=None) -> torch.Tensor:
    """sqrt(sum over stages of (replicated squares + per shard group, its squares summed over the group)).
    A None gradient counts as zero but still names its group, so every rank of a group joins its
    all-reduce whichever gradients it has."""
    groups: dict[int, tuple[object, list[torch.Tensor]]] = {}
    for name, g in named_grads:
        grp = shard_group_of(name)
        entry = groups.setdefault(id(grp), (grp, []))
        if g is not None:
            entry[1].append(g)
    sq = torch.zeros((), device=device)
    for grp, grads in groups.values():
        part = _sum_of_squares(grads, device)
        sq = sq + (part if grp is None else _all_reduce(part.reshape(1), grp).reshape(()))
    return _all_reduce(sq.reshape(1), stage_group).reshape(()).sqrt()


def clip_grad_norm_(named_grads: Iterable[tuple[str, torch.Tensor | None]], max_norm: float, device: torch.device,
                    shard_group_of: Callable[[str], object] = lambda name: None, stage_group=None) -> torch.Tensor:
    """Scale the gradients in place so that the global norm is at most `max_norm`; returns the norm
    before clipping as a 0-dim tensor (no host sync here). Every rank must call it (the norm is
    all-reduced)."""
    named = list(named_grads)
    norm = global_grad_norm(named, device, shard_group_of, stage_group)
    coef = (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)
    grads = [g for _, g in named if g is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
