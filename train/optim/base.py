"""Shared step structure of the matrix optimizers: `step(closure)` evaluates the closure with grad
enabled, then hands every param group to the subclass's `_step_group`."""

from __future__ import annotations

import torch


class GroupwiseOptimizer(torch.optim.Optimizer):
    def _step_group(self, group: dict) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss
