"""The stability guard (DESIGN.md "Training", "Stability"; V41_SPEC §9): loss-spike detection, dropped
updates, in-memory snapshots, the short rollback and Anticipatory Routing behind one object that the
loop calls at fixed points:

- `start(step, tokens_seen)`: before the first step (a rollback point from the start);
- `reads_ahead(step)` / `next_batches(step, batches, record)`: while Anticipatory Routing is active (or
  its look-ahead buffer still holds batches) the step's batches and routing indices come from it
  (train/stability/anticipatory.py); otherwise the loop reads the step's batches itself;
- `verdict(sums, grad_norm, n_micro)`: after the gradients are clipped, before anything is updated:
  None (a normal step: update) or why the step is a spike (train/stability/spike.py: every rank judges the same
  global values and the verdict is max-reduced, so all ranks act alike);
- `after_step(step, tokens_seen, record)`: a skipped spike is counted (`train.spike.action=skip`); a
  spike with `action=rollback` returns the `Rollback` the loop continues from (the model, optimizer
  state, MoE biases and RNG are already restored from the snapshot; the data stream continues after
  the spike's batches; Anticipatory Routing switches on); a normal step may be snapshotted;
- `state_dict()` / `own_state()` / `load_state_dict(...)`: what a checkpoint holds of it (the detector's
  history, the counts, the look-ahead batches with the data state; the cached indices per rank).

With `train.spike.action=none` and Anticipatory Routing never switched on, none of this costs
anything: no snapshot, no verdict collective, and the loop reads its batches directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from flashtrain.train.runtime.collectives import Operation, all_reduce
from flashtrain.train.stability.anticipatory import AnticipatoryRouting, AnticipatoryRoutingConfig
from flashtrain.train.stability.spike import Snapshots, SpikeConfig, SpikeDetector
from flashtrain.train.step_values import StepValues

log = logging.getLogger(__name__)


@dataclass
class Rollback:
    """Where the loop continues after a rollback, and the event it logs."""
    step: int
    tokens_seen: int
    event: dict
    wandb_step: int  # the spike's own (unlogged) step on the wandb axis


class StabilityGuard:
    def __init__(self, spike: SpikeConfig, routing: AnticipatoryRoutingConfig, model: torch.nn.Module,
                 optimizers: dict, device: torch.device, op: Operation, is_main: bool):
        self.cfg, self.routing_cfg = spike, routing
        self.model, self.optimizers, self.device, self.op, self.is_main = model, optimizers, device, op, is_main
        self.detector = SpikeDetector(spike)
        self.snapshots = Snapshots(spike)
        self.routing = AnticipatoryRouting(routing)
        self.spike: str | None = None  # the current step's verdict
        self.counts = {"skipped": 0, "rolled_back": 0}
        self.rolled_back_steps = 0  # steps undone by rollbacks: the wandb step axis stays increasing
        self._in_a_row, self._last_spike_step = 0, 0

    @property
    def rolls_back(self) -> bool:
        return self.cfg.action == "rollback"

    def start(self, step: int, tokens_seen: int) -> None:
        if self.rolls_back:  # a rollback point from the start
            self.snapshots.take(step, tokens_seen, self.model, self.optimizers)

    # --- next batches ---------------------------------------------------------------------------
    def reads_ahead(self, step: int) -> bool:
        return self.routing.active(step) or bool(self.routing.ahead)

    def next_batches(self, step: int, batches: Iterator[list[dict]],
                     record: Callable[[list[dict]], list[dict]]) -> tuple[list[dict], list[dict] | None]:
        """(micro-batches, routes or None) of `step` from the look-ahead buffer; `record` computes a step's
        routing indices with the current parameters (the step runner's `record_routes`)."""
        return self.routing.next_step(step, lambda: next(batches), record)

    # --- verdict --------------------------------------------------------------------------------
    def verdict(self, sums: StepValues, grad_norm: torch.Tensor, n_micro: int) -> str | None:
        """The spike rule on the step's global loss and grad norm, before anything is updated."""
        self.spike = None
        if not self.detector.enabled:
            return None
        self.op.name = "the spike check's loss all-reduce"
        loss, norm = sums.global_value("loss") / n_micro, float(grad_norm.item())
        reason = self.detector.reason(loss, norm)
        flag = torch.tensor([0.0 if reason is None else 1.0])
        all_reduce(flag, self.device, dist.ReduceOp.MAX if dist.is_initialized() else None)
        if not flag.item():
            self.detector.accept(loss, norm)
            return None
        self.spike = reason or "another rank judged this step a spike"
        return self.spike

    # --- after step -----------------------------------------------------------------------------
    def after_step(self, step: int, tokens_seen: int, record: dict) -> Rollback | None:
        if self.spike is not None and self.rolls_back:
            return self._rollback(step, record)
        if self.spike is not None:
            self.counts["skipped"] += 1
            record["spikes_skipped"] = self.counts["skipped"]
            if self.is_main:
                log.warning(f"step {step}: spike ({self.spike}); update skipped ({self.counts['skipped']} so far)")
            return None
        if step > self._last_spike_step:  # past the spike that caused the last rollbacks
            self._in_a_row = 0
        if self.rolls_back and self.snapshots.due(step):
            self.snapshots.take(step, tokens_seen, self.model, self.optimizers)
        return None

    def _rollback(self, spike_step: int, record: dict) -> Rollback:
        """Back to the newest snapshot at least rollback_steps before the spike; the data stream continues
        after the spike's batches; Anticipatory Routing switches on."""
        self._in_a_row += 1
        self._last_spike_step = max(self._last_spike_step, spike_step)
        if self._in_a_row > self.cfg.max_rollbacks:
            limit = self.cfg.max_rollbacks
            raise FloatingPointError(f"step {spike_step}: spike ({self.spike}) after {limit} rollbacks in a row "
                                     f"(train.spike.max_rollbacks={limit}); stopping (the last checkpoint is intact)")
        snap = self.snapshots.target(spike_step)
        self.snapshots.restore(snap, self.model, self.optimizers)
        wandb_step = spike_step + self.rolled_back_steps
        self.rolled_back_steps += spike_step - snap.step
        self.counts["rolled_back"] += 1
        self.routing.activate(snap.step)
        event = {"event": "rollback", "spike_step": spike_step, "reason": self.spike, "loss": record["loss"],
                 "grad_norm": record["grad_norm"], "to_step": snap.step,
                 "anticipatory_routing_until": self.routing.active_until, "rollbacks": self.counts["rolled_back"]}
        if self.is_main:
            log.warning(f"step {spike_step}: spike ({self.spike}); rolled back to step {snap.step}, the data "
                        f"continues after the spike's batches, anticipatory routing (delta_steps="
                        f"{self.routing_cfg.delta_steps}) through step {self.routing.active_until}")
        return Rollback(snap.step, snap.tokens_seen, event, wandb_step)

    # --- state dict -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Identical on the ranks of a dp group (saved with the data-loader state)."""
        return {"spike": {"detector": self.detector.state_dict(), "counts": dict(self.counts),
                          "rolled_back_steps": self.rolled_back_steps},
                "anticipatory_routing": self.routing.state_dict()}

    def own_state(self) -> dict | None:
        """Per rank: the cached routing indices of this rank's layers (None: none cached)."""
        routes = self.routing.routes_state()
        return None if routes is None else {"routes": routes}

    def load_state_dict(self, state: dict, own: dict | None) -> None:
        if "spike" not in state:
            return
        self.detector.load_state_dict(state["spike"]["detector"])
        self.counts = dict(state["spike"]["counts"])
        self.rolled_back_steps = state["spike"]["rolled_back_steps"]
        if not self.routing.load_state_dict(state["anticipatory_routing"], (own or {}).get("routes")):
            if self.is_main:
                log.warning("the checkpoint's cached routing indices are for another layout: recomputing them "
                            "with the resumed parameters")
