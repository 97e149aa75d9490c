"""The stages of a recipe (issue 48 item 3; V41_SPEC §8: 64K-token sequences from the start, 1M tokens from
34T, the same fixed batch and LR schedule in tokens). An exp declares them in `train.recipe`:

    train:
      recipe:
        first: 64k             # the name of the stage a run starts in
        stages:
          - name: 1m
            from_tokens: 34.0e12
            overrides: [data.seq_len=1048576, model.attn_chunk_size=32, parallel.cp=256]

Stage 0 is the configuration as composed (named `train.recipe.first`); stage k (k >= 1) is it with the
overrides of stages 1..k applied in order, from `from_tokens` tokens seen on. A start runs the stage of
its resume point's tokens (`stage_config`), so the same command continues into the stage its
checkpoint's token count is in; the loop saves and ends its run of a stage when the next one's tokens are
reached, and the launcher starts the next stage in the same processes (launch/pretrain.py): its layout
built, the checkpoint resumed (the data position re-split: data/loader.py `relayout`), the schedule, the
metrics, the wandb run and the step count continued.

What a stage may change: how the run is laid out and fed (`parallel.*`, `data.*` such as `seq_len`,
`data.batch_size`, `train.*` such as `recompute`), and the model fields that change how the step is
computed, not what (train/resume.py `EXECUTION_ONLY`, e.g. `model.attn_chunk_size`). Not the model
itself, the LR schedule, the global batch or the stages: refused when the config is read. The fixed
batch holds across a boundary -- every stage's tokens per step, `train.global_batch_tokens` rounded to
whole sequences of its `data.seq_len`, is the first stage's -- or the config is refused, naming both.
"""

from __future__ import annotations

import datetime
import math
import os

from omegaconf import DictConfig, OmegaConf

from flashtrain.config.errors import CheckpointError, ConfigError
from flashtrain.train.build import read_configs, run_plan
from flashtrain.train.checkpoint import complete_checkpoints, read_meta, weights_only
from flashtrain.train.config import StageConfig, compose, global_sequences
from flashtrain.train.resume import EXECUTION_ONLY

# what a stage's overrides must leave alone (the model: but its execution-only fields, train/resume.py)
FIXED_PREFIXES = ("schedule.", "train.recipe", "train.global_batch_tokens", "train.seed", "train.stage")


def stage_list(cfg: DictConfig) -> list[StageConfig]:
    """`train.recipe.stages` of a composed config, checked: names, increasing positive token counts,
    overrides of existing keys that a stage may change (module docstring)."""
    recipe = cfg.train.get("recipe")
    stages_cfg = recipe.get("stages") if recipe is not None else None
    raw = OmegaConf.to_container(stages_cfg, resolve=True) if stages_cfg else []
    stages: list[StageConfig] = []
    for i, entry in enumerate(raw):
        where = f"train.recipe.stages[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"name", "from_tokens", "overrides"}:
            raise ConfigError(f"{where}={entry!r}: a stage is {{name, from_tokens, overrides: [key=value, ...]}}")
        stage = StageConfig(str(entry.get("name") or f"stage{i + 1}"), float(entry.get("from_tokens", 0)),
                            [str(o) for o in entry.get("overrides") or []])
        where = f"{where} ({stage.name})"
        after = stages[-1].from_tokens if stages else 0
        if stage.from_tokens <= after:
            raise ConfigError(f"{where}: from_tokens={stage.from_tokens:g} must be above {after:g} (the stages "
                              f"start in order, after 0)")
        for o in stage.overrides:
            key = o.split("=", 1)[0]
            if "=" not in o or key.startswith(("+", "~")):
                raise ConfigError(f"{where}: {o!r} is not key=value of an existing key")
            model_field = key.split(".", 2)[1] if key.startswith("model.") else None
            if key.startswith(FIXED_PREFIXES) or (model_field is not None and model_field not in EXECUTION_ONLY):
                raise ConfigError(f"{where}: {key} cannot change at a stage (the model, the schedule, the global "
                                  f"batch and the stages hold for the whole run; the model fields a stage may "
                                  f"change: {', '.join(f'model.{f}' for f in sorted(EXECUTION_ONLY))})")
        stages.append(stage)
    return stages


def stage_at(stages: list[StageConfig], tokens: float) -> int:
    """The stage the run is in after `tokens` tokens: the last one whose `from_tokens` it has reached."""
    return sum(1 for s in stages if tokens >= s.from_tokens)


def stage_name(cfg: DictConfig, k: int) -> str:
    stages = stage_list(cfg)
    return stages[k - 1].name if k else str((cfg.train.get("recipe") or {}).get("first", "first"))


def stage_config(cfg: DictConfig, k: int) -> DictConfig:
    """The configuration of stage `k`: `cfg` with the overrides of stages 1..k applied (key=value of keys
    that exist: a misspelt key is an error naming the stage)."""
    stages = stage_list(cfg)
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.set_struct(out, True)
    for stage in stages[:k]:
        for o in stage.overrides:
            try:
                out = OmegaConf.merge(out, OmegaConf.from_dotlist([o]))
            except Exception as e:  # noqa: BLE001 - OmegaConf's errors: a key that does not exist, a bad value
                raise ConfigError(f"train.recipe.stages ({stage.name}): {o}: {' '.join(str(e).split()[:14])} "
                                  f"(a stage sets keys of the configuration)") from None
    return out


def tokens_per_step(c: DictConfig) -> int:
    """A configuration's fixed batch: `train.global_batch_tokens` in whole sequences of `data.seq_len`."""
    return global_sequences(float(c.train.global_batch_tokens), int(c.data.seq_len)) * int(c.data.seq_len)


def check_fixed_batch(cfg: DictConfig) -> None:
    """Every stage's tokens per step are the first stage's (the fixed batch of the recipe), or a ConfigError
    naming the stage, both token counts and the fix."""
    first = tokens_per_step(cfg)
    for k, stage in enumerate(stage_list(cfg), 1):
        c = stage_config(cfg, k)
        if tokens_per_step(c) != first:
            lcm = math.lcm(int(cfg.data.seq_len), int(c.data.seq_len))
            raise ConfigError(f"train.recipe.stages ({stage.name}): train.global_batch_tokens="
                              f"{float(cfg.train.global_batch_tokens):g} is {tokens_per_step(c)} tokens per step in "
                              f"sequences of data.seq_len={c.data.seq_len}, {first} in the first stage's of "
                              f"{cfg.data.seq_len}: the fixed batch would change at the boundary; use a global batch "
                              f"that both lengths divide (a multiple of {lcm} tokens)")


def resume_tokens(cfg: DictConfig, run_dir) -> float:
    """The tokens seen at the point a start in `run_dir` resumes from (0: a fresh start), read from the
    checkpoint's meta before anything is built: the newest complete checkpoint of the run directory whose
    meta reads, or `train.resume_from` (train/resume.py `resume_path`: imported weights start a run, the run
    directory's own checkpoints continue it). The resume itself verifies the checkpoint; a fall-back past a
    damaged one into another stage is caught there (`check_stage`)."""
    resume_from = cfg.train.get("resume_from")
    own = list(reversed(complete_checkpoints(run_dir)))
    if resume_from and not (own and weights_only(resume_from)):
        own = [resume_from]
    for path in own:
        try:
            return float(read_meta(path).get("tokens_seen", 0))
        except (CheckpointError, OSError):  # a damaged newest checkpoint: the resume skips it, so does this
            continue
    return 0.0


def start_stage(cfg: DictConfig, run_dir, world: int) -> tuple[int, DictConfig]:
    """(k, the configuration of stage k) for a start in `run_dir`: the stage of its resume point's tokens.
    The stages still ahead are checked first, so that a mistake in a later stage stops this start rather
    than the run at its boundary: their overrides, the fixed batch, and their layouts against `world`
    processes (unless one is for another number of processes, `parallel.world`: then the run ends at its
    boundary, asking for them). The stages already behind are not (a run that lost a node goes on in
    fewer processes than they were laid out for)."""
    stages = stage_list(cfg)
    check_fixed_batch(cfg)
    k = stage_at(stages, resume_tokens(cfg, run_dir))
    for later in range(k + 1, len(stages) + 1):
        c = read_configs(stage_config(cfg, later))
        if c.parallel.world in (None, world):
            run_plan(c, world)
    return k, stage_config(cfg, k) if k else cfg


def next_boundary(cfg: DictConfig, k: int) -> float | None:
    """The tokens at which stage k + 1 starts (None: k is the last stage)."""
    stages = stage_list(cfg)
    return stages[k].from_tokens if k < len(stages) else None


def check_stage(cfg: DictConfig, k: int, tokens: float, path) -> None:
    """The checkpoint the resume loaded (`tokens` seen) is in stage k, the one this start was built for."""
    found = stage_at(stage_list(cfg), tokens)
    if found != k:
        raise CheckpointError(f"checkpoint {path} ({tokens:g} tokens) is in recipe stage {stage_name(cfg, found)!r}, "
                              f"not {stage_name(cfg, k)!r} (the newer checkpoint this start was laid out for was "
                              f"damaged and set aside): start again, and it resumes in that stage")


def other_world_stage(cfg: DictConfig, run_dir) -> str | None:
    """After a boundary: None when the stage the run reached runs in this job's processes; else the line that
    ends the job, saying how many processes that stage is laid out for (`parallel.world`)."""
    k = stage_at(stage_list(cfg), resume_tokens(cfg, run_dir))
    world, want = int(os.environ.get("WORLD_SIZE", "1")), stage_config(cfg, k).parallel.world
    if want is None or want == world:
        return None
    return (f"recipe stage {stage_name(cfg, k)!r} is laid out for parallel.world={want} processes and this job has "
            f"{world}: launch the same command with {want} to go on from the checkpoint just saved")


def stage_overrides(cfg: DictConfig, k: int) -> list[str]:
    """The overrides that make stage k of `cfg` (its stages' 1..k, in order): for the tools that compose a
    configuration from overrides (launch/plan.py per stage, launch/estimate.py --tokens)."""
    return [o for stage in stage_list(cfg)[:k] for o in stage.overrides]


def overrides_at(overrides: list[str], tokens: float) -> tuple[str, list[str]]:
    """(the stage's name, `overrides` + its stage overrides) for the stage a run of `overrides` is in after
    `tokens` tokens (launch/estimate.py --tokens)."""
    conf = compose(overrides)
    k = stage_at(stage_list(conf), tokens)
    return stage_name(conf, k), overrides + stage_overrides(conf, k)


def stage_line(cfg: DictConfig, stage: int, next_tokens: float | None) -> str | None:
    """The start-up line naming the recipe's stage a start runs, what it sets and the next one (`next_tokens`:
    where it starts, None: `stage` is the last); None without a recipe."""
    stages = stage_list(cfg)
    if not stages:
        return None
    sets = " ".join(o for st in stages[:stage] for o in st.overrides) or "the exp as composed"
    nxt = "the last stage" if next_tokens is None else \
        f"next: {stage_name(cfg, stage + 1)!r} from {next_tokens:g} tokens"
    return f"recipe stage {stage_name(cfg, stage)!r} ({stage + 1} of {len(stages) + 1}): {sets}; {nxt}"


def closing_line(how: str, cfg: DictConfig, stage: int, step: int, max_steps: int, tokens_seen: int, wall: float,
                 newest) -> str:
    """A run's closing log line: how it ended (`how`: "finished", "stopped by SIGTERM", or "ended stage", which
    names the recipe's stage), where it stopped, what it read, how long this start took (`wall` seconds), and the
    checkpoint a restart resumes from (`newest`)."""
    if how == "ended stage":
        how = f"ended stage {stage_name(cfg, stage)!r}"
    return (f"{how} at step {step} of {max_steps}: {tokens_seen:,} tokens seen, {wall:.0f} s wall time in this start "
            f"({datetime.timedelta(seconds=round(wall))}); newest checkpoint "
            f"{newest if newest is not None else 'none'}")
