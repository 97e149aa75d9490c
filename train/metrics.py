"""Per-step metrics: one JSON object per optimizer step in `<run dir>/metrics.jsonl`, the same values in
wandb (offline unless configured online; a wandb failure is logged once and never stops training), an
expert-load heatmap image every `heatmap_interval` steps, and a progress bar on rank 0.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

log = logging.getLogger(__name__)


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "flashtrain"
    name: str | None = None


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    heatmap_interval: int = 50
    progress: bool = True

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "LoggingConfig":
        values = dict(values)
        wb = WandbConfig(**values.pop("wandb", {}))
        if wb.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logging.wandb.mode={wb.mode!r}: use offline, online or disabled")
        return cls(wandb=wb, **values)


def load_statistics(loads: dict[int, torch.Tensor]) -> dict:
    """Per layer and modality: max/mean and coefficient of variation of the expert loads
    (NaN where the modality had no token)."""
    out = {"text": {"max_over_mean": [], "cv": []}, "image": {"max_over_mean": [], "cv": []}}
    for layer in sorted(loads):
        for m, name in enumerate(("text", "image")):
            x = loads[layer][m].double()
            mean = x.mean().item()
            ok = mean > 0
            out[name]["max_over_mean"].append(x.max().item() / mean if ok else math.nan)
            out[name]["cv"].append(x.std(unbiased=False).item() / mean if ok else math.nan)
    return out


def load_heatmap(loads: dict[int, torch.Tensor], scale: int = 6) -> np.ndarray:
    """RGB image: layers x experts, text loads left, image loads right (each normalised per layer)."""
    layers = sorted(loads)
    rows = []
    for l in layers:
        parts = []
        for m in range(2):
            x = loads[l][m].double().numpy()
            parts.append(x / x.max() if x.max() > 0 else x)
        rows.append(np.concatenate([parts[0], [np.nan], parts[1]]))
    a = np.array(rows)
    img = np.zeros((*a.shape, 3), dtype=np.uint8)
    v = np.nan_to_num(a, nan=0.0)
    img[..., 0] = (255 * v).astype(np.uint8)
    img[..., 2] = (255 * (1 - v)).astype(np.uint8)
    img[np.isnan(a)] = 255
    return img.repeat(scale, 0).repeat(scale, 1)


def _flatten(prefix: str, value, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}" if prefix else k, v, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out[f"{prefix}/layer_{i:02d}"] = v
    else:
        out[prefix] = value


class MetricsLogger:
    """Rank 0 writes; other ranks hold a no-op logger."""

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, config: dict, enabled: bool, total_steps: int,
                 start_step: int):
        self.enabled, self.cfg = enabled, cfg
        self._wandb = None
        self._bar = None
        if not enabled:
            return
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        if cfg.wandb.mode != "disabled":
            try:
                import wandb

                self._wandb = wandb.init(mode=cfg.wandb.mode, project=cfg.wandb.project, name=cfg.wandb.name,
                                         dir=str(run_dir), config=config, resume="allow",
                                         settings=wandb.Settings(silent=True, console="off"))
            except Exception as e:  # noqa: BLE001 - wandb must never stop training
                log.warning("wandb unavailable (%s); metrics go to %s only", e, self.path)
        if cfg.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, step: int, record: dict, loads: dict[int, torch.Tensor] | None = None) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            try:
                flat: dict = {}
                _flatten("", {k: v for k, v in record.items() if k != "step"}, flat)
                if loads and self.cfg.heatmap_interval > 0 and step % self.cfg.heatmap_interval == 0:
                    import wandb

                    flat["expert_load/heatmap"] = wandb.Image(load_heatmap(loads), caption="layers x experts: text | image")
                self._wandb.log(flat, step=step)
            except Exception as e:  # noqa: BLE001
                log.warning("wandb.log failed (%s); disabling wandb for this run", e)
                self._wandb = None
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("wandb.finish failed: %s", e)
