"""Held-out evaluation (DESIGN.md "Evaluation"; `train.eval.*`): the mean loss and bits per byte of a fixed
held-out set (data/heldout.py), per source and per modality, through the run's own step runner.

Every `train.eval.interval` steps, and at the schedule's last step, the loop calls `Evaluator.run(step)`:
- this rank's share of the set: the micro-batches padded with PAD micro-batches (nothing scored) to a
  multiple of dp x the runner's `eval_group` (a pipeline round), dp rank r taking every dp-th one, so
  every rank of a pipeline, context-parallel group or expert group runs the same micro-batches;
- the step runner's forward without gradients (train/step_runner.py `evaluate`): per micro-batch each
  score's sum (train/loss.py `HELDOUT_SCORES`, one entry per held-out metric: the CE over its scored
  positions, and over those whose target stands for at least one byte; `heldout_sums`: a context-parallel
  rank its own positions, a pipeline its last stage);
- one all-reduce of the [sources, scores] sums; the counts (scored positions, bytes) come from the set
  itself, so they are the same in every layout.

    loss = CE sum / scored positions                           (nats per token)
    bpb  = CE sum over targets with bytes / (ln 2 x their UTF-8 bytes)

Special tokens (BOS, EOS, image, reserved) stand for no bytes: their CE counts in `loss` and not in
`bpb`. The set, the weights and the forward do not depend on the layout, so every layout gives the
same numbers up to summation order; nothing of the training state changes (no gradients, the step's
statistics untouched, the RNG state restored), so a resumed run logs the uninterrupted run's records.

The record (an event line in metrics.jsonl, `eval/*` in wandb):
`{"event": "eval", "step": N, "loss", "bpb", "tokens", "per_source": {NAME: {"loss", "bpb", "tokens"}},
"per_modality": {...}}` (tokens: the scored positions).

train/evaluation/checkpoint.py is the same evaluation of any checkpoint in any layout (launch/evaluate.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from flashtrain.config.errors import ConfigError
from flashtrain.data.heldout import MODALITIES, HeldOutSet
from flashtrain.train.loss import HELDOUT_SCORES
from flashtrain.train.stability.spike import rng_state, set_rng_state

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    """The `train.eval` group (conf/train/default.yaml)."""
    interval: int = 500  # steps between evaluations; 0: off
    tokens: int = 1_048_576  # positions in the held-out set (rounded to whole micro-batches)

    def validate(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"train.eval.interval={self.interval}: must be >= 0 (0 turns evaluation off)")
        if self.tokens <= 0:
            raise ConfigError(f"train.eval.tokens={self.tokens}: must be a positive number of positions")


def _scores(sums: np.ndarray, targets: int, n_bytes: int) -> dict:
    """Each held-out score (train/loss.py `HELDOUT_SCORES`) of its summed values (null where nothing divides
    them), and `tokens`, the scored positions."""
    over = {"token": targets, "bits_per_byte": math.log(2) * n_bytes}
    return {**{score.name: sums[i] / over[score.per] if over[score.per] else None
               for i, score in enumerate(HELDOUT_SCORES)}, "tokens": int(targets)}


def eval_record(step: int, sums: np.ndarray, heldout: HeldOutSet) -> dict:
    """The eval event of `step` from the all-reduced [sources, scores] sums (module docstring)."""
    present = [s for s in range(len(heldout.sources)) if heldout.targets[s]]
    per_source = {heldout.sources[s]: _scores(sums[s], heldout.targets[s], heldout.bytes[s]) for s in present}
    per_modality = {}
    for modality in dict.fromkeys(MODALITIES[heldout.sources[s]] for s in present):
        mine = [s for s in present if MODALITIES[heldout.sources[s]] == modality]
        per_modality[modality] = _scores(sums[mine].sum(0), heldout.targets[mine].sum(), heldout.bytes[mine].sum())
    return {"event": "eval", "step": step,
            **_scores(sums[present].sum(0), heldout.targets.sum(), heldout.bytes.sum()),
            "per_source": per_source, "per_modality": per_modality}


class Evaluator:
    """The held-out set of this run and its share for this rank (module docstring)."""

    def __init__(self, cfg: EvalConfig, heldout: HeldOutSet, token_bytes: np.ndarray, runner, dims, micro_batch: int,
                 device: torch.device, is_main: bool):
        self.cfg, self.heldout, self.runner, self.device, self.is_main = cfg, heldout, runner, device, is_main
        self.micro_batch = micro_batch
        self.token_bytes = torch.as_tensor(token_bytes, dtype=torch.float64, device=device)
        n, unit = len(heldout.batches), dims.dp * runner.eval_group  # dims: parallel/dims.py `ParallelDims`
        self.mine = list(range(dims.dp_rank, math.ceil(n / unit) * unit, dims.dp))  # >= n: a PAD micro-batch

    def due(self, step: int, final_step: int | None = None) -> bool:
        """Every `interval` steps, and at `final_step` (the schedule's last step: a run that completes
        its schedule ends with an evaluation)."""
        return self.cfg.interval > 0 and (step % self.cfg.interval == 0 or step == final_step)

    def sums(self) -> torch.Tensor:
        """This rank's [sources, scores] float64 sums over its share (not yet reduced); the RNG state is kept."""
        n, group = len(self.heldout.batches), self.runner.eval_group
        sums = torch.zeros(len(self.heldout.sources), len(HELDOUT_SCORES), dtype=torch.float64, device=self.device)
        saved = rng_state()
        try:
            for g in range(0, len(self.mine), group):
                ids = self.mine[g:g + group]
                batches = [self.heldout.batch(i) if i < n else self.heldout.pad_batch(self.micro_batch) for i in ids]
                for i, scores in zip(ids, self.runner.evaluate(batches, self.token_bytes)):
                    if i < n:
                        sums[self.heldout.batches[i][0]] += scores
        finally:
            set_rng_state(saved)
        return sums

    def run(self, step: int, label: str | None = None) -> dict:
        """The eval record of `step` (every rank takes part; every rank returns it); logged as `label`
        (default "eval at step N")."""
        t0 = time.perf_counter()
        sums = self.sums()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        record = eval_record(step, sums.cpu().numpy(), self.heldout)
        if self.is_main:
            log.info(f"{label or f'eval at step {step}'}: loss {record['loss']:.4f}, bpb {_fmt(record['bpb'])} over "
                     f"{record['tokens']} tokens ({time.perf_counter() - t0:.1f} s)")
        return record


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


# the process layout of a run: a checkpoint is scored in the layout of the scoring launch (one process by default,
# `parallel.pp=2` ... given as overrides), not in the one it was trained in (conf/parallel/default.yaml)
