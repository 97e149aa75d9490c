"""Loss-spike detection, dropped updates and in-memory snapshots for the short rollback (V41_SPEC §9;
issue 18 items 1-2; settings `train.spike.*`, documented in conf/train/default.yaml).

Rule, evaluated on every rank on the step's global values (the all-reduced loss and the global
gradient norm, identical everywhere; the verdict is then max-reduced so the ranks cannot part ways):
a step is a spike when its loss or gradient norm is non-finite, or, once `min_history` accepted steps
are known, when

    loss > mean + max(loss_sigmas x std, min_relative x |mean|)          (over the last `window` steps)
    grad_norm > mean_g + max(grad_norm_sigmas x std_g, min_relative x mean_g)   (when grad_norm_sigmas set)

A spike's values never enter the history. Actions:
- `none`: no detection (a non-finite loss stops the run, as before);
- `skip`: the update is dropped -- no optimizer step, no MoE bias update, optimizer state untouched --
  and counted (`spikes_skipped` in the metrics); the step's data is consumed;
- `rollback`: the model, optimizer state, MoE biases and step return to the newest in-memory snapshot
  at least `rollback_steps` before the spike (snapshots are taken every `snapshot_interval` steps and
  at every start; an early spike uses the oldest one), the data stream continues *after* the spike's
  batches, and Anticipatory Routing (train/stability/anticipatory.py) runs for its `active_steps`. A spike that
  comes back `max_rollbacks` times in a row without the run getting past it stops the run.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from flashtrain.config.errors import ConfigError

ACTIONS = ("none", "skip", "rollback")


@dataclass
class SpikeConfig:
    action: str = "none"
    window: int = 100
    min_history: int = 20
    loss_sigmas: float = 5.0
    grad_norm_sigmas: float | None = None
    min_relative: float = 0.05
    rollback_steps: int = 10
    snapshot_interval: int = 10
    max_rollbacks: int = 3

    def validate(self) -> None:
        if self.action not in ACTIONS:
            raise ConfigError(f"train.spike.action={self.action!r}: use one of {ACTIONS}")
        for name in ("window", "min_history", "rollback_steps", "snapshot_interval", "max_rollbacks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.spike.{name}={getattr(self, name)}: must be >= 1")
        if self.min_history > self.window:
            raise ConfigError(f"train.spike.min_history={self.min_history} exceeds train.spike.window={self.window}: "
                              f"the history never gets that long")
        if self.loss_sigmas <= 0 or (self.grad_norm_sigmas is not None and self.grad_norm_sigmas <= 0):
            raise ConfigError("train.spike.loss_sigmas and train.spike.grad_norm_sigmas must be > 0 (grad_norm_sigmas "
                              "may be null: no grad-norm rule)")
        if self.min_relative < 0:
            raise ConfigError(f"train.spike.min_relative={self.min_relative}: must be >= 0")


def _outlier(value: float, history: list[float], sigmas: float, min_relative: float) -> bool:
    mean = sum(history) / len(history)
    std = math.sqrt(sum((v - mean) ** 2 for v in history) / len(history))
    return value > mean + max(sigmas * std, min_relative * abs(mean))


class SpikeDetector:
    """The rule above over the recent history of accepted steps; its state is part of the checkpoint."""

    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.grad_norms: deque[float] = deque(maxlen=cfg.window)

    @property
    def enabled(self) -> bool:
        return self.cfg.action != "none"

    def reason(self, loss: float, grad_norm: float) -> str | None:
        """Why (loss, grad_norm) is a spike, or None (the history is not changed: `accept` a normal step)."""
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"non-finite loss {loss} / grad norm {grad_norm}"
        if len(self.losses) < self.cfg.min_history:
            return None
        if _outlier(loss, list(self.losses), self.cfg.loss_sigmas, self.cfg.min_relative):
            return (f"loss {loss:.4g} above the mean {np.mean(self.losses):.4g} of the last {len(self.losses)} "
                    f"steps by more than {self.cfg.loss_sigmas:g} std (std {np.std(self.losses):.3g})")
        if self.cfg.grad_norm_sigmas is not None and _outlier(grad_norm, list(self.grad_norms),
                                                              self.cfg.grad_norm_sigmas, self.cfg.min_relative):
            return (f"grad norm {grad_norm:.4g} above the mean {np.mean(self.grad_norms):.4g} of the last "
                    f"{len(self.grad_norms)} steps by more than {self.cfg.grad_norm_sigmas:g} std")
        return None

    def accept(self, loss: float, grad_norm: float) -> None:
        """A normal step joins the history."""
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms)}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(state["losses"], maxlen=self.cfg.window)
        self.grad_norms = deque(state["grad_norms"], maxlen=self.cfg.window)


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


@dataclass
class Snapshot:
    step: int
    tokens_seen: int
    model: dict  # state_dict copies (parameters and buffers: the MoE biases), on the CPU
    optim: dict  # optimizer name -> [(parameter, state name, value copy)]
    rng: dict


def _copy(v):
    return v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v


class Snapshots:
    """In-memory copies of this rank's training state (its stages, expert / Engram shards, ZeRO-owned
    optimizer state) every `snapshot_interval` steps, enough of them to reach `rollback_steps` back."""

    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self.kept: list[Snapshot] = []

    def due(self, step: int) -> bool:
        return step % self.cfg.snapshot_interval == 0 or not self.kept or step < self.kept[-1].step

    def take(self, step: int, tokens_seen: int, model: torch.nn.Module, optimizers: dict) -> None:
        self.kept = [s for s in self.kept if s.step < step]
        optim = {name: [(p, k, _copy(v)) for p, k, v, _ in opt.owned_state()] for name, opt in optimizers.items()}
        self.kept.append(Snapshot(step, tokens_seen, {k: _copy(v) for k, v in model.state_dict().items()}, optim,
                                  rng_state()))
        keep = -(-self.cfg.rollback_steps // self.cfg.snapshot_interval) + 1  # reaches rollback_steps back
        self.kept = self.kept[-keep:]

    def target(self, spike_step: int) -> Snapshot:
        """The newest snapshot at least rollback_steps before `spike_step` (else the oldest)."""
        older = [s for s in self.kept if s.step <= spike_step - self.cfg.rollback_steps]
        return older[-1] if older else self.kept[0]

    @staticmethod
    def restore(snap: Snapshot, model: torch.nn.Module, optimizers: dict) -> None:
        """The snapshot's values into the live tensors (copies: the snapshot stays usable)."""
        with torch.no_grad():
            state = model.state_dict()
            for k, v in snap.model.items():
                state[k].copy_(v)
        for name, opt in optimizers.items():
            opt.clear_state()
            for p, k, v in snap.optim[name]:
                opt.install_state(p, k, v.clone() if torch.is_tensor(v) else v)
        set_rng_state(snap.rng)
