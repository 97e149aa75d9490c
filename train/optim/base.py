"""Shared step structure of the matrix optimizers: `step(closure)` evaluates the closure with grad
enabled, then hands every param group to the subclass's `_step_group`; and the checkpoint interface
(train/checkpoint.py): `owned_state()` lists the state of the parameter pieces this rank owns (flat
over the pieces, parallel/zero.py), `install_state` puts a loaded one back."""

from __future__ import annotations

import torch

from flashtrain.parallel.zero import Piece


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

    zero_of = None

    def state_pieces(self, p: torch.Tensor) -> list[Piece]:
        """The pieces of `p` whose state this rank keeps (all of it without ZeRO)."""
        return [Piece(0, p.numel(), 0)] if self.zero_of is None else self.zero_of(p).mine()

    def owned_state(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    pieces = self.state_pieces(p)
                    for k, v in self.state[p].items():
                        yield p, k, v, pieces

    def install_state(self, p: torch.Tensor, k: str, value: torch.Tensor) -> None:
        self.state[p][k] = value.to(p.device).view(self._state_shape(p)) if value.dim() else value

    def _state_shape(self, p: torch.Tensor) -> tuple:
        return tuple(p.shape) if self.zero_of is None else (-1,)

    def clear_state(self) -> None:
        self.state.clear()
