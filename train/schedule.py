"""The 45T-style learning-rate schedule, defined in tokens (V41_SPEC §8).

Linear warmup over `warmup_steps` optimizer steps to `peak_lr`, hold the peak until
`decay_start_tokens`, cosine down to `final_lr` at `decay_end_tokens`, hold `final_lr` to
`total_tokens`. The global batch is a fixed number of tokens, so step s has seen s * tokens_per_step
tokens. `exp=flash` gives the published absolute numbers (2000 steps; 28T, 40T, 45T; 100.6M tokens per
step); shorter runs give the phase boundaries as fractions of their total (`*_fraction` fields), so any
run length keeps the same shape. The ViT body is unfrozen at the first step of the decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashtrain.config.errors import ConfigError


@dataclass
class ScheduleConfig:
    total_tokens: float = 45e12
    peak_lr: float = 2.6e-4
    final_lr: float = 2.6e-5
    warmup_steps: int | None = 2000
    warmup_fraction: float | None = None  # of total tokens, when warmup_steps is null
    decay_start_tokens: float | None = 28e12
    decay_end_tokens: float | None = 40e12
    decay_start_fraction: float | None = None  # of total tokens, when decay_start_tokens is null
    decay_end_fraction: float | None = None


class Schedule:
    def __init__(self, cfg: ScheduleConfig, tokens_per_step: int):
        self.cfg = cfg
        if tokens_per_step <= 0:
            raise ConfigError(f"tokens per step={tokens_per_step}: must be positive")
        if cfg.total_tokens <= 0 or cfg.peak_lr <= 0 or cfg.final_lr < 0:
            raise ConfigError(f"schedule: total_tokens={cfg.total_tokens}, peak_lr={cfg.peak_lr} and "
                              f"final_lr={cfg.final_lr} must be positive")
        self.tokens_per_step = tokens_per_step
        self.total_steps = max(1, math.ceil(cfg.total_tokens / tokens_per_step))

        def absolute(tokens, fraction, name):
            if tokens is not None:
                return float(tokens)
            if fraction is None or not 0 <= fraction <= 1:
                raise ConfigError(f"schedule.{name}_tokens is null, so schedule.{name}_fraction must be in [0, 1]; "
                                  f"got {fraction}")
            return fraction * cfg.total_tokens

        self.decay_start = absolute(cfg.decay_start_tokens, cfg.decay_start_fraction, "decay_start")
        self.decay_end = absolute(cfg.decay_end_tokens, cfg.decay_end_fraction, "decay_end")
        if cfg.warmup_steps is not None:
            self.warmup_steps = int(cfg.warmup_steps)
        elif cfg.warmup_fraction is not None and 0 <= cfg.warmup_fraction <= 1:
            self.warmup_steps = max(1, round(cfg.warmup_fraction * cfg.total_tokens / tokens_per_step))
        else:
            raise ConfigError(f"schedule.warmup_steps is null, so schedule.warmup_fraction must be in [0, 1]; "
                              f"got {cfg.warmup_fraction}")
        warm_tokens = self.warmup_steps * tokens_per_step
        if not warm_tokens <= self.decay_start <= self.decay_end <= cfg.total_tokens:
            raise ConfigError(f"schedule phases out of order: warmup ends at {warm_tokens:.4g} tokens, decay "
                              f"{self.decay_start:.4g}..{self.decay_end:.4g}, total {cfg.total_tokens:.4g}; they must "
                              f"be non-decreasing")

    def tokens(self, step: int) -> float:
        """Tokens seen before optimizer step `step` (0-based)."""
        return step * self.tokens_per_step

    def lr(self, step: int) -> float:
        c = self.cfg
        if step < self.warmup_steps:
            return c.peak_lr * (step + 1) / self.warmup_steps
        t = self.tokens(step)
        if t < self.decay_start:
            return c.peak_lr
        if t >= self.decay_end:
            return c.final_lr
        frac = (t - self.decay_start) / (self.decay_end - self.decay_start)
        return c.final_lr + (c.peak_lr - c.final_lr) * 0.5 * (1 + math.cos(math.pi * frac))

    def first_step_at(self, tokens: float) -> int:
        return min(self.total_steps, math.ceil(tokens / self.tokens_per_step))

    @property
    def vit_unfreeze_step(self) -> int:
        """The ViT body trains from the first step whose tokens reach the decay start."""
        return self.first_step_at(self.decay_start)

    def vit_trainable(self, step: int) -> bool:
        return step >= self.vit_unfreeze_step

    def summary(self) -> dict:
        points = {"warmup_end": self.warmup_steps - 1, "decay_start": self.first_step_at(self.decay_start),
                  "decay_end": self.first_step_at(self.decay_end), "last": self.total_steps - 1}
        return {"total_steps": self.total_steps, "tokens_per_step": self.tokens_per_step,
                "total_tokens": self.cfg.total_tokens,
                **{f"{k}_step": v for k, v in points.items()},
                **{f"{k}_lr": self.lr(v) for k, v in points.items()},
                "vit_unfreeze_step": self.vit_unfreeze_step}
