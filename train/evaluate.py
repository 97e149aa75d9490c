"""Held-out evaluation (DESIGN.md "Evaluation"; `train.eval.*`): the mean loss and bits per byte of a fixed
held-out set (data/heldout.py), per source and per modality, through the run's own step runner.

Every `train.eval.interval` steps, and at the schedule's last step, the loop calls `Evaluator.run(step)`:
- this rank's share of the set: the micro-batches padded with PAD micro-batches (nothing scored) to a
  multiple of dp x the runner's `eval_group` (a pipeline round), dp rank r taking every dp-th one, so
  every rank of a pipeline, context-parallel group or expert group runs the same micro-batches;
- the step runner's forward without gradients (train/step_runner.py `evaluate`): per micro-batch the
  CE sum over its scored positions and over those whose target stands for at least one byte
  (train/loss.py `heldout_sums`; a context-parallel rank its own positions, a pipeline its last stage);
- one all-reduce of the [sources, 2] sums; the counts (scored positions, bytes) come from the set
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

`evaluate_checkpoint` is the same evaluation of any checkpoint in any layout (launch/evaluate.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from flashtrain.config import CONF_DIR
from flashtrain.config.errors import ConfigError
from flashtrain.data.heldout import MODALITIES, HeldOutSet
from flashtrain.train.spike import rng_state, set_rng_state

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


def _scores(ce: float, ce_bytes: float, targets: int, n_bytes: int) -> dict:
    return {"loss": ce / targets if targets else None,
            "bpb": ce_bytes / (math.log(2) * n_bytes) if n_bytes else None, "tokens": int(targets)}


def eval_record(step: int, sums: np.ndarray, heldout: HeldOutSet) -> dict:
    """The eval event of `step` from the all-reduced [sources, 2] sums (module docstring)."""
    present = [s for s in range(len(heldout.sources)) if heldout.targets[s]]
    per_source = {heldout.sources[s]: _scores(sums[s, 0], sums[s, 1], heldout.targets[s], heldout.bytes[s])
                  for s in present}
    per_modality = {}
    for modality in dict.fromkeys(MODALITIES[heldout.sources[s]] for s in present):
        mine = [s for s in present if MODALITIES[heldout.sources[s]] == modality]
        per_modality[modality] = _scores(sums[mine, 0].sum(), sums[mine, 1].sum(), heldout.targets[mine].sum(),
                                         heldout.bytes[mine].sum())
    return {"event": "eval", "step": step,
            **_scores(sums[present, 0].sum(), sums[present, 1].sum(), heldout.targets.sum(), heldout.bytes.sum()),
            "per_source": per_source, "per_modality": per_modality}


class Evaluator:
    """The held-out set of this run and its share for this rank (module docstring)."""

    def __init__(self, cfg: EvalConfig, heldout: HeldOutSet, token_bytes: np.ndarray, runner, dp: int, dp_rank: int,
                 micro_batch: int, device: torch.device, is_main: bool):
        self.cfg, self.heldout, self.runner, self.device, self.is_main = cfg, heldout, runner, device, is_main
        self.micro_batch = micro_batch
        self.token_bytes = torch.as_tensor(token_bytes, dtype=torch.float64, device=device)
        n, unit = len(heldout.batches), dp * runner.eval_group
        self.mine = list(range(dp_rank, math.ceil(n / unit) * unit, dp))  # >= n: a PAD micro-batch

    def due(self, step: int, final_step: int | None = None) -> bool:
        """Every `interval` steps, and at `final_step` (the schedule's last step: a run that completes
        its schedule ends with an evaluation)."""
        return self.cfg.interval > 0 and (step % self.cfg.interval == 0 or step == final_step)

    def sums(self) -> torch.Tensor:
        """This rank's [sources, 2] float64 sums over its share (not yet reduced); the RNG state is kept."""
        n, group = len(self.heldout.batches), self.runner.eval_group
        sums = torch.zeros(len(self.heldout.sources), 2, dtype=torch.float64, device=self.device)
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
LAYOUT_KEYS = ("world", "pp", "ep", "cp", "pipeline_schedule", "microbatches", "stage_layers")


def checkpoint_config(path: str, overrides: list[str], allow_damaged: bool = False):
    """The configuration to evaluate checkpoint `path` with: a flashtrain checkpoint's own (its saved,
    resolved config) in the default layout (`LAYOUT_KEYS` as conf/parallel/default.yaml has them: one
    process, or data parallelism over the launch's processes) with `overrides` (key=value of existing keys:
    the layout, data.val_shards, ...); a weights-only import (launch/import_official.py) needs `+exp=NAME`
    and overrides, composed as for training, and its model config must be the import's. A damaged
    checkpoint is refused (train/checkpoint.py `check_readable`: here its quick form, before the meta is
    read; `build_for_scoring` hashes every file) unless `allow_damaged`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from flashtrain.train.checkpoint import check_readable, read_meta, weights_only
    from flashtrain.train.config import compose
    from flashtrain.train.resume import check_model_config

    if not allow_damaged:
        check_readable(path, quick=True)
    meta = read_meta(path)
    if weights_only(path):
        if not any(o.lstrip("+").startswith("exp=") for o in overrides):
            raise ConfigError(f"{path} holds weights alone (an import): give the experiment it was imported for, "
                              f"+exp=NAME, and the same model overrides")
        cfg = compose(overrides)
        check_model_config(meta["config"]["model"], OmegaConf.to_container(cfg.model, resolve=True), path)
        return cfg, meta
    if bad := [o for o in overrides if o.startswith(("+", "~")) or "=" not in o]:
        raise ConfigError(f"{bad[0]}: a flashtrain checkpoint carries its whole config; give key=value overrides of "
                          f"its keys (e.g. parallel.pp=2, data.val_shards=[...])")
    cfg = OmegaConf.create(meta["config"])
    defaults = OmegaConf.load(CONF_DIR / "parallel" / "default.yaml")
    for key in LAYOUT_KEYS:  # the run's layout was for its processes; scoring takes this launch's
        cfg.parallel[key] = defaults[key]
    OmegaConf.set_struct(cfg, True)
    for o in overrides:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o]))
        except OmegaConfBaseException as e:
            raise ConfigError(f"{o}: {' '.join(str(e).split()[:12])} (the checkpoint's config has no such key, or "
                              f"the value does not fit it)") from None
    return cfg, meta


def build_for_scoring(cfg, path: str, allow_damaged: bool = False):
    """The run brought up for `cfg` in this launch's layout (train/build.py `bring_up`, `Run.read_data`) and its
    train module with the weights of checkpoint `path` (the optimizer state is not loaded), once its files match
    their checksums (refused otherwise; `allow_damaged`: a warning): (run, module, the checkpoint's meta)."""
    import os

    from flashtrain.parallel.construct import model_template
    from flashtrain.train.build import bring_up, build_module, read_configs
    from flashtrain.train.checkpoint import check_readable, load_weights
    from flashtrain.train.collectives import Operation
    from flashtrain.train.resume import check_model_config

    c = read_configs(cfg)
    if not c.train.eval.interval:
        c.train.eval.interval = 1  # the evaluator is built whatever the run's interval was
    world = int(os.environ.get("WORLD_SIZE", "1"))
    c.train.global_batch_tokens = scoring_batch_tokens(c, world)
    run = bring_up(c, world)
    check_readable(path, allow_damaged, report=log.warning if run.is_main else lambda _: None)  # every file hashed
    dims = run.dims
    if run.is_main:
        log.info(f"evaluating {path}: {dims.world} process(es) on {run.device.type}, pp={dims.pp} dp={dims.dp} "
                 f"ep={dims.ep} cp={dims.cp}")
    run.read_data(heldout=True)  # the seed; rank 0 first: the corpus, the Engram map
    module = build_module(run, model_template(c.model, run.token_map), Operation())
    meta = load_weights(path, module.model, dims.global_layout(module.model))
    check_model_config(meta["config"]["model"], c.cfg_dict["model"], path)
    return run, module, meta


def scoring_batch_tokens(c, world: int) -> float:
    """`train.global_batch_tokens` for scoring on `world` processes: the run's when this layout's
    data-parallel ranks x `data.batch_size` divide it, else the next multiple of them. The held-out set,
    not the training batch, decides what is scored; the batch only has to fit the layout."""
    from flashtrain.train.config import global_sequences  # (train/config.py imports this module)

    seq, dp = c.data.seq_len, max(1, world // (c.parallel.pp * c.parallel.cp))
    unit = dp * c.data.batch_size
    sequences = global_sequences(c.train.global_batch_tokens, seq)
    return float(-(-sequences // unit) * unit * seq) if sequences % unit else c.train.global_batch_tokens


def checkpoint_label(meta: dict) -> str:
    """What a checkpoint is, for the tools' lines: "step N" of a run, or "imported weights, from SRC" (an
    import of the release starts at step 0 but is not a run's step 0)."""
    if meta.get("weights_only"):
        return f"imported weights, from {meta.get('imported_from', 'a release')}"
    return f"step {meta.get('step', 0)}"


def evaluate_checkpoint(cfg, path: str, allow_damaged: bool = False) -> dict:
    """The eval record of checkpoint `path` under `cfg` (its `train.eval.tokens`, `data.val_shards`,
    layout): `build_for_scoring`, then one `Evaluator.run`. Every rank returns it."""
    from flashtrain.train.build import build_evaluator

    run, module, meta = build_for_scoring(cfg, path, allow_damaged)
    if not run.heldout:
        raise ConfigError("no held-out data: give --shards (or data.val_shards=[...]) with held-out shards written by "
                          "launch/prepare_data.py")
    evaluator = build_evaluator(run, module.runner, periodic=False)
    record = evaluator.run(int(meta.get("step", 0)), f"eval of {path} ({checkpoint_label(meta)})")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return record
