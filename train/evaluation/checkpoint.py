"""A checkpoint scored on held-out data (launch/evaluate.py, the lm-evaluation-harness model of harness.py): its
configuration (`checkpoint_config`: a flashtrain checkpoint's own, in this launch's layout; an import's from
`+exp=NAME`), the run brought up and its train module with the checkpoint's weights (`build_for_scoring`), then the
run's own held-out evaluation (heldout.py `Evaluator`) once (`evaluate_checkpoint`)."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flashtrain.config import CONF_DIR
from flashtrain.config.errors import ConfigError
from flashtrain.parallel.construct import model_template
from flashtrain.train.build import bring_up, build_evaluator, build_module, read_configs
from flashtrain.train.checkpoint import check_readable, load_weights, read_meta, weights_only
from flashtrain.train.config import compose, global_sequences
from flashtrain.train.resume import check_model_config
from flashtrain.train.runtime.collectives import Operation

log = logging.getLogger(__name__)

LAYOUT_KEYS = ("world", "pp", "ep", "cp", "pipeline_schedule", "microbatches", "stage_layers")


def checkpoint_config(path: str, overrides: list[str], allow_damaged: bool = False):
    """The configuration to evaluate checkpoint `path` with: a flashtrain checkpoint's own (its saved,
    resolved config) in the default layout (`LAYOUT_KEYS` as conf/parallel/default.yaml has them: one
    process, or data parallelism over the launch's processes) with `overrides` (key=value of existing keys:
    the layout, data.val_shards, ...); a weights-only import (launch/import_official.py) needs `+exp=NAME`
    and overrides, composed as for training, and its model config must be the import's. A damaged
    checkpoint is refused (train/checkpoint.py `check_readable`: here its quick form, before the meta is
    read; `build_for_scoring` hashes every file) unless `allow_damaged`."""
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
