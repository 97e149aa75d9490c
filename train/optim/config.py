"""Typed optimizer configuration (V41_SPEC §7), filled from `conf/optim/*.yaml`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashtrain.config.errors import ConfigError


@dataclass
class MuonConfig:
    momentum: float = 0.95
    weight_decay: float = 0.1
    nesterov: bool = True
    rms_scale: float = 0.18
    # hybrid Newton-Schulz schedule: [steps, [a, b, c]] entries, run in order
    ns_schedule: list = field(default_factory=lambda: [[8, [3.4445, -4.7750, 2.0315]], [2, [2.0, -1.5, 0.5]]])
    ns_eps: float = 1e-7
    ns_dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU; or "float32" / "bfloat16"

    removed_fields = {"distributed": "removed, ZeRO-1 is the one path that splits the Newton-Schulz work over "
                                     "the data-parallel ranks: set optim.zero=true (the default) for it, "
                                     "optim.zero=false to run the whole step on every rank"}

    def torch_ns_dtype(self):
        return None if self.ns_dtype is None else {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.ns_dtype]

    def coefficients(self) -> tuple[tuple[float, float, float], ...]:
        out = []
        for steps, abc in self.ns_schedule:
            out += [tuple(float(v) for v in abc)] * int(steps)
        return tuple(out)


@dataclass
class SinkhornConfig:
    momentum: float = 0.95
    num_steps: int = 11
    tau: float = 1e-3
    eps: float = 1e-20
    gamma: float = 0.18
    engram_lr_mult: float = 5.0
    chunk_elems: int = 1 << 18  # reference path: rows per chunk = chunk_elems // n


@dataclass
class AdamWConfig:
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-20
    weight_decay: float = 0.1  # RMSNorm weights (and the matrices under matrices: adamw); other vectors none


@dataclass
class OptimConfig:
    vision_lr_mult: float = 0.1  # ViT body once unfrozen (the report: "a smaller learning rate")
    use_triton: bool | None = None  # None: Triton on CUDA, reference on CPU
    zero: bool = True  # ZeRO-1: optimizer state sharded over data-parallel replicas (no effect with dp = 1)
    # "adamw": the matrices Muon takes go to AdamW instead (the Muon ablation, docs/training.md); V4.1: "muon"
    matrices: str = "muon"
    muon: MuonConfig = field(default_factory=MuonConfig)
    sinkhorn: SinkhornConfig = field(default_factory=SinkhornConfig)
    adamw: AdamWConfig = field(default_factory=AdamWConfig)

    removed_fields = {"lr": "removed, the LR schedule is the only source of the learning rate; set "
                            "schedule.peak_lr (and schedule.final_lr) instead"}

    def validate(self) -> None:
        if self.matrices not in ("muon", "adamw"):
            raise ConfigError(f"optim.matrices={self.matrices!r}: must be muon (V4.1) or adamw (the Muon ablation)")
        if self.vision_lr_mult < 0:
            raise ConfigError(f"optim.vision_lr_mult={self.vision_lr_mult}: must be >= 0")
        if not 0 <= self.muon.momentum < 1:
            raise ConfigError(f"optim.muon.momentum={self.muon.momentum}: must be in [0, 1)")
        if not self.muon.ns_schedule or any(len(e) != 2 or len(e[1]) != 3 or int(e[0]) < 1
                                            for e in self.muon.ns_schedule):
            raise ConfigError(f"optim.muon.ns_schedule={self.muon.ns_schedule}: needs [steps, [a, b, c]] entries")
        if self.muon.ns_dtype not in (None, "float32", "bfloat16"):
            raise ConfigError(f"optim.muon.ns_dtype={self.muon.ns_dtype!r}: use null (bf16 on CUDA, fp32 on CPU), "
                              f"'float32' or 'bfloat16'")
        if self.sinkhorn.num_steps < 1 or self.sinkhorn.num_steps % 2 == 0:
            raise ConfigError(f"optim.sinkhorn.num_steps={self.sinkhorn.num_steps}: must be odd (start and end "
                              f"on rows); V4.1 uses 11")
        if len(self.adamw.betas) != 2 or not all(0 <= b < 1 for b in self.adamw.betas):
            raise ConfigError(f"optim.adamw.betas={self.adamw.betas}: needs two values in [0, 1)")
