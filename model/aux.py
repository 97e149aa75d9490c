"""Auxiliary losses that work across pipeline stages, and the side channel for their values.

`attach_aux_loss(x, loss)` returns x unchanged in the forward pass; in the backward pass it injects
d(loss)/d(loss) = `ForwardContext.aux_grad_scale` into `loss`, so the aux gradient reaches the
parameters that produced it even when the final loss lives on another pipeline stage (the pattern of
Megatron-LM's `MoEAuxLossAutoScaler`, DESIGN.md "The model"). The trainer sets `aux_grad_scale` to the
factor it applies to the main loss (e.g. 1/micro-batches).

`StepStats` is the side channel: per-layer values (balance loss, indexer KL) and per-layer,
per-modality expert loads. Entries are *set* per layer and per forward, never accumulated, so an
activation-checkpoint recomputation of the same micro-batch cannot count twice; the trainer reads
and sums them once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(loss, ctx.scale), None


def attach_aux_loss(x: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Make `loss` (a scalar already multiplied by its weight) part of the backward pass of `x`."""
    if not loss.requires_grad or not torch.is_grad_enabled():
        return x
    return _AttachAuxLoss.apply(x, loss, scale)


@dataclass
class StepStats:
    """Side channel filled by one forward pass (one micro-batch, one pipeline stage)."""

    balance_loss: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> weighted loss (detached)
    indexer_loss: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> weighted loss (detached)
    # layer -> [2, n_routed_experts] int64 counts of (token, expert) selections; row 0 text, row 1 image
    expert_load: dict[int, torch.Tensor] = field(default_factory=dict)

    def total(self, kind: str) -> torch.Tensor | float:
        """The sum of one kind of value ('balance_loss' / 'indexer_loss') over layers, on the device
        (no host sync), in float64 (0.0 when there is none)."""
        vals = list(getattr(self, kind).values())
        return torch.stack(vals).sum().detach().double() if vals else 0.0
