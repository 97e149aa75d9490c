"""Anticipatory Routing (DeepSeek-V4 §4.2.3, V41_SPEC §9; issue 18 item 3; `train.anticipatory_routing.*`).

While active (steps `start + 1 .. active_until`, switched on by a spike rollback, train/stability/guard.py), the
MoE routing indices of step t are those the model picked with the parameters of step t - Δt
(Δt = `delta_steps`): the data of step t is read Δt steps early into a look-ahead buffer, and at the
start of step t - Δt one extra forward pass without gradients (the local model, or the pipeline's
forward-only schedule, `Pipeline.record_round`) runs that data and caches every MoE layer's indices,
per micro-batch, on the rank that holds the layer (its pipeline stage; with expert parallelism the
indices of this rank's own tokens, with context parallelism of its own positions). At step t every MoE
layer routes by the cached indices (`ForwardContext.routes`) while the gate weights, experts and
everything else use the current parameters; expert loads, the balance loss and the bias update count
the indices actually used.

The first Δt steps after activation have no parameters of Δt steps earlier (the run was just rolled
back): their indices come from the parameters at activation. Δt = 0 computes each step's indices with
its own parameters (the same routing as normal training: the unit test of the machinery). After
`active_steps` steps the buffer drains (its batches are trained next, with normal routing) and training
is back to normal.

Checkpoints hold the buffer's batches (with the data-loader state, which is already past them) and,
per rank, the cached indices; a resume with another layout drops the cached indices and recomputes them
with the resumed parameters (logged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flashtrain.config.errors import ConfigError


@dataclass
class AnticipatoryRoutingConfig:
    delta_steps: int = 1
    active_steps: int = 100

    def validate(self) -> None:
        if self.delta_steps < 0 or self.active_steps < 0:
            raise ConfigError(f"train.anticipatory_routing: delta_steps={self.delta_steps} and active_steps="
                              f"{self.active_steps} must be >= 0 (active_steps=0: never switched on)")


class AnticipatoryRouting:
    """The look-ahead buffer and the routing cache. `ahead[i]` = [step batches, cached routes or None] of
    step t + i, where t is the next step to run; routes: per micro-batch, {layer id: indices}."""

    def __init__(self, cfg: AnticipatoryRoutingConfig):
        self.cfg = cfg
        self.active_until = 0
        self.ahead: list[list] = []
        self.last_routes: list[dict] | None = None  # what the last step routed by (tests, metrics)

    def active(self, step: int) -> bool:
        return step <= self.active_until

    def activate(self, last_step: int) -> None:
        """Steps last_step + 1 .. last_step + active_steps route by anticipated indices; indices cached
        with other parameters (before a rollback) are dropped."""
        self.active_until = last_step + self.cfg.active_steps
        for entry in self.ahead:
            entry[1] = None

    def next_step(self, step: int, fetch: Callable[[], list],
                  record: Callable[[list], list]) -> tuple[list, list | None]:
        """(batches, routes or None) of `step`: while active, first read ahead and record the indices of
        the steps up to step + Δt that have none yet (with the current parameters)."""
        if self.active(step):
            for i in range(min(self.cfg.delta_steps, self.active_until - step) + 1):
                while len(self.ahead) <= i:
                    self.ahead.append([fetch(), None])
                if self.ahead[i][1] is None:
                    self.ahead[i][1] = record(self.ahead[i][0])
        batches, routes = self.ahead.pop(0) if self.ahead else (fetch(), None)
        self.last_routes = routes if self.active(step) else None
        return batches, self.last_routes

    # --- checkpoint: batches and state with the data (identical on the ranks of a dp group), routes per rank
    def state_dict(self) -> dict:
        return {"active_until": self.active_until, "batches": [b for b, _ in self.ahead]}

    def routes_state(self) -> list | None:
        return [r for _, r in self.ahead] if any(r is not None for _, r in self.ahead) else None

    def load_state_dict(self, state: dict, routes: list | None) -> bool:
        """False when cached indices were saved but not for this rank (another layout): they are then
        recomputed at the next step."""
        self.active_until = state["active_until"]
        self.ahead = [[b, None] for b in state["batches"]]
        if routes is not None and len(routes) == len(self.ahead):
            for entry, r in zip(self.ahead, routes):
                entry[1] = r
            return True
        return not self.ahead
