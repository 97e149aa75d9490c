"""Loading the Hydra configuration tree into typed config objects.

`compose(overrides)` gives the resolved DictConfig for command-line style overrides
(`["+exp=flash_tiny", "model.dim=128"]`); `model_config(cfg)` turns its `model` group into a validated
`ModelConfig`, `optim_config(cfg)` its `optim` group into an `OptimConfig`; `TrainConfig` is the `train`
group. Code below `launch/` only ever sees the typed objects. `BatchPlan` is the run's batch arithmetic,
with the one rounding of the global batch (`global_sequences`, which the LR schedule's tokens per step
use too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from flashtrain.config import CONF_DIR
from flashtrain.config.errors import ConfigError
from flashtrain.config.typed import nearest, typed_config
from flashtrain.data.config import DataConfig, TokenSpec
from flashtrain.data.images import ImageProcessorConfig
from flashtrain.model.config import ModelConfig
from flashtrain.parallel.config import ParallelConfig
from flashtrain.parallel.dims import ParallelDims
from flashtrain.train.dspark.loss import DSparkLossConfig
from flashtrain.train.evaluation.heldout import EvalConfig
from flashtrain.train.flops import PeakTflops
from flashtrain.train.optim.config import OptimConfig
from flashtrain.train.profile import ProfileConfig
from flashtrain.train.schedule import Schedule, ScheduleConfig
from flashtrain.train.stability.anticipatory import AnticipatoryRoutingConfig
from flashtrain.train.stability.spike import SpikeConfig


@dataclass
class CheckpointConfig:
    interval: int = 50
    keep: int = 3
    async_save: bool = False


@dataclass
class RecipeConfig:
    """The `train.recipe` group: the first stage's name and the stages after it (train/recipe.py). Read
    by `stage_list` from the raw config, before the typed configs exist (a stage changes them)."""
    first: str = "first"
    stages: list = field(default_factory=list)


@dataclass
class StageConfig:
    """One entry of `train.recipe.stages`."""
    name: str = ""
    from_tokens: float = 0.0
    overrides: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    """The `train` group (conf/train/default.yaml documents every key)."""

    global_batch_tokens: float = 100.6e6
    max_steps: int | None = None  # stop after this many optimizer steps (the schedule is unchanged)
    seed: int = 0
    grad_clip: float = 1.0
    loss_tile_tokens: int = 2048  # head + cross-entropy over tiles of this many positions (train/loss.py)
    recompute: str = "none"  # activation recomputation per block: none | selective | full (model/recompute.py)
    compile: bool | None = None  # torch.compile per block (train/compile.py); None: compile_default[device type]
    compile_default: dict = field(default_factory=lambda: {"cpu": False, "cuda": False})
    compile_backend: str = "inductor"  # torch.compile's backend (aot_eager / eager: dynamo without inductor)
    balance_rate: float = 1e-3
    resume_from: str | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peak_tflops: PeakTflops = field(default_factory=PeakTflops)  # MFU peak per device type (train/flops.py)
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # traces / memory snapshots (train/profile.py)
    spike: SpikeConfig = field(default_factory=SpikeConfig)  # spike detection, rollback (train/stability/spike.py)
    anticipatory_routing: AnticipatoryRoutingConfig = field(default_factory=AnticipatoryRoutingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation (train/evaluation/heldout.py)
    stage: str = "pretrain"  # pretrain | dspark: the frozen backbone, the drafter trained (train/dspark/stage.py)
    backbone: str | None = None  # the DSpark stage's backbone checkpoint
    dspark: DSparkLossConfig = field(default_factory=DSparkLossConfig)  # its objective (train/dspark/loss.py)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)  # the recipe's stages (train/recipe.py)


def global_sequences(global_batch_tokens: float, seq_len: int) -> int:
    """The fixed global batch in sequences: `train.global_batch_tokens` / `data.seq_len`, rounded (>= 1)."""
    return max(1, round(global_batch_tokens / seq_len))


def rounded_batch_note(global_batch_tokens: float, seq_len: int) -> str | None:
    """The warning a run logs when its global batch is not a whole number of sequences (None when it is):
    the requested and the used tokens per step."""
    used = global_sequences(global_batch_tokens, seq_len) * seq_len
    if used == global_batch_tokens:
        return None
    return (f"train.global_batch_tokens={global_batch_tokens:g} is not a whole number of data.seq_len={seq_len} "
            f"sequences: each step uses {used // seq_len} sequences = {used} tokens instead (set "
            f"train.global_batch_tokens={used} to request exactly that)")


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of one optimizer step, computed once (`plan_batches`): the global batch of
    `global_sequences` is `dims.dp` x `micro_batch` x `accumulation`; a pipeline runs the `accumulation`
    micro-batches of a dp rank in `rounds` schedule steps of `round_microbatches`. `dims`: the run's
    `ParallelDims` (parallel/dims.py), the one source of the degrees."""

    dims: ParallelDims
    global_sequences: int
    micro_batch: int  # data.batch_size: sequences per micro-batch
    accumulation: int  # micro-batches per optimizer step on each dp rank
    round_microbatches: int = 1  # pipeline: micro-batches per schedule step
    # the micro-batches whose inputs a round holds on the device (None: round_microbatches; the estimator's
    # shortened step runs fewer and prices the whole round's)
    input_microbatches: int | None = None

    @property
    def round_inputs(self) -> int:
        """Micro-batches whose inputs (tokens, token types, labels) a pipeline round holds on the device."""
        return self.round_microbatches if self.input_microbatches is None else self.input_microbatches

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def rounds(self) -> int:
        return self.accumulation // self.round_microbatches

    @property
    def global_microbatches(self) -> int:
        """Micro-batches per optimizer step over every dp rank (the CE and aux means divide by it)."""
        return self.accumulation * self.dims.dp


def plan_batches(train: TrainConfig, seq_len: int, micro_batch: int, dims: ParallelDims,
                 parallel: ParallelConfig) -> BatchPlan:
    """The fixed batch split over `dims.dp` ranks in micro-batches of `micro_batch` sequences, or a
    ConfigError naming the nearest global batch that divides."""
    g = global_sequences(train.global_batch_tokens, seq_len)
    unit = dims.dp * micro_batch
    if g % unit:
        nearest = sorted({max(unit, g // unit * unit), (g // unit + 1) * unit}, key=lambda n: (abs(n - g), n))
        raise ConfigError(
            f"train.global_batch_tokens={train.global_batch_tokens:g} is {g} sequences of data.seq_len={seq_len}, "
            f"which {dims.dp} data-parallel rank(s) x data.batch_size={micro_batch} do not divide; use a global batch "
            f"of a multiple of {unit * seq_len} tokens -- the nearest is train.global_batch_tokens="
            f"{nearest[0] * seq_len} ({nearest[0]} sequences)" + (f" or {nearest[1] * seq_len}" if len(nearest) > 1
                                                                  else "") +
            " -- or change data.batch_size / the number of processes")
    accumulation = g // unit
    return BatchPlan(dims, g, micro_batch, accumulation, parallel.round_microbatches(accumulation))


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The configuration for command-line style overrides. A mistake Hydra reports in many lines (a key
    that does not exist, an unknown exp or group option, an override it cannot parse) is a one-line
    ConfigError naming the nearest valid key or option; so is a top-level key that is neither a config
    group nor a key of conf/config.yaml (`+foo=bar`, `+trian.max_steps=3`), which Hydra accepts silently."""
    return compose_with_run_dir(overrides)[0]


def compose_with_run_dir(overrides: list[str] | tuple[str, ...] = ()) -> tuple[DictConfig, str | None]:
    """`compose`, and the run directory a Hydra app would use for these overrides (`hydra.run.dir`
    resolved; None when it interpolates what only a running app knows)."""
    overrides = list(overrides)
    try:
        cfg, run_dir = _hydra_compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise hydra_error(overrides, e) from e
    check_top_level(cfg, overrides)
    return cfg, run_dir


def _hydra_compose(overrides: list[str]) -> tuple[DictConfig, str | None]:
    """Hydra's compose, outside a Hydra app, and the resolved `hydra.run.dir` (or None): `run_name`, which
    interpolates the Hydra runtime by default (`${hydra:runtime.choices.model}`), is resolved here to the
    chosen model, so the config resolves whole (train/build.py `read_configs`)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    model = cfg.hydra.runtime.choices.get("model")
    if "run_name" in cfg and str(OmegaConf.to_container(cfg, resolve=False).get("run_name")).startswith("${hydra:"):
        cfg.run_name = model
    try:
        run_dir = str(cfg.hydra.run.dir)
    except OmegaConfBaseException:  # e.g. ${hydra:...}: known to the running app only
        run_dir = None
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, run_dir


# ------------------------------------------------------------------------- Hydra's errors as one line
def config_groups() -> list[str]:
    """The config groups: conf/ folders of yaml files (exp included)."""
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and any(p.glob("*.yaml")))


def top_level_keys() -> set[str]:
    """What may appear at the top of the composed config: the groups (but exp, an overlay) and the keys of
    conf/config.yaml itself."""
    own = OmegaConf.load(CONF_DIR / "config.yaml")
    return (set(config_groups()) - {"exp"}) | {k for k in own if k not in ("defaults", "hydra")}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _override_for(key: str, overrides: list[str]) -> str:
    """The override (as typed) that sets `key`, or `key` itself."""
    return next((o for o in overrides if _key(o) == key), key)


def check_top_level(cfg: DictConfig, overrides: list[str]) -> None:
    known = top_level_keys()
    for key in cfg:
        if key in known:
            continue
        near = nearest(key, known)
        offending = [o for o in overrides if _key(o).split(".")[0] == key]
        hint = f" (did you mean {near!r}?)" if near else ""
        where = f"{offending[0]}: " if offending else ""
        raise ConfigError(f"{where}{key!r} is not a config group or key{hint}; the top-level keys are "
                          f"{', '.join(sorted(known))} (conf/config.yaml and its groups; an exp is +exp=NAME)")


def _missing_key(path: str, overrides: list[str]) -> str:
    """Where `path` (a dotted key) leaves the configuration the other overrides compose, and the nearest
    valid key there."""
    others = [o for o in overrides if _key(o) != path]
    try:
        node = _hydra_compose(others)[0]
    except Exception:  # noqa: BLE001 - another override is wrong too: name this one without a hint
        return f"{path} is not a key of the configuration"
    parts, done = path.split("."), []
    for part in parts:
        if isinstance(node, DictConfig) and part in node:
            node, done = node[part], done + [part]
            continue
        where = ".".join(done)
        keys = list(node.keys()) if isinstance(node, DictConfig) else []
        near = nearest(part, keys)
        hint = f" (did you mean {'.'.join(done + [near])}?)" if near else ""
        source = f"; its keys are in conf/{done[0]}/" if done and done[0] in config_groups() else ""
        return (f"{where} has no key {part!r}{hint}{source}" if where else
                f"{part!r} is not a config group or key{hint}; the top-level keys are {', '.join(sorted(keys))}")
    return f"{path} is not a key of the configuration"


def _unparsable(overrides: list[str]) -> str:
    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_override(o)
        except Exception:  # noqa: BLE001 - the one Hydra could not parse
            return o
    return " ".join(overrides)


def hydra_error(overrides: list[str], e: Exception) -> ConfigError:
    """One line for what Hydra (or OmegaConf, while composing) raised."""
    text = str(e)
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and "/" in e.missing_cfg_file:
        group, name = e.missing_cfg_file.rsplit("/", 1)
        override = next((o for o in overrides if _key(o) == group and o.split("=", 1)[-1] == name),
                        _override_for(group, overrides))
        near = nearest(name, e.options or [])
        hint = f" (did you mean {override.split('=', 1)[0]}={near}?)" if near else ""
        return ConfigError(f"{override}: there is no {group} {name!r}{hint}; the {group} options are "
                           f"{', '.join(e.options or [])} (conf/{group}/*.yaml)")
    if isinstance(e, OverrideParseException):
        named = re.search(r"override '([^']*)'", text)
        detail = " ".join(line for line in text.splitlines()[1 if named else 0:] if not line.startswith("See "))
        bad = named.group(1) if named else _unparsable(overrides)
        return ConfigError(f"cannot parse the override {bad!r} ({detail.strip()}); write key=value, +key=value to "
                           f"add a key, ~key to delete one")
    if m := re.match(r"Could not override '([^']+)'\. No match in the defaults list", text):
        group = m.group(1)
        override = _override_for(group, overrides)
        return ConfigError(f"{override}: {group} is not selected by default, so it is added with a +: "
                           f"+{override.lstrip('+')}")
    if m := re.match(r"Could not (?:override|append to) '([^']+)'", text) or re.match(
            r"Could not delete from config\. '([^']+)' does not exist", text):
        path = m.group(1)
        return ConfigError(f"{_override_for(path, overrides)}: {_missing_key(path, overrides)}")
    return ConfigError(" ".join(text.split()))


def model_config(cfg: DictConfig) -> ModelConfig:
    return typed_config(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), "model")


def optim_config(cfg: DictConfig) -> OptimConfig:
    return typed_config(OptimConfig, OmegaConf.to_container(cfg.optim, resolve=True), "optim")


def data_config(cfg: DataConfig | DictConfig) -> DataConfig:
    return typed_config(DataConfig, OmegaConf.to_container(cfg.data, resolve=True), "data")


def token_spec(model: ModelConfig) -> TokenSpec:
    """The token facts the data pipeline takes from the model config."""
    image = ImageProcessorConfig(model.vision_patch_size, model.vision_downsample_ratio, model.vision_max_n_token,
                                 model.vision_min_pixels, model.vision_max_wh_ratio)
    return TokenSpec(model.vocab_size, model.bos_id, model.eos_id, model.pad_id, model.image_token_id, image)


def schedule(cfg: DictConfig):
    """The LR schedule of a run: ScheduleConfig + the fixed global batch in tokens."""
    seq_len = int(cfg.data.seq_len)
    return Schedule(typed_config(ScheduleConfig, OmegaConf.to_container(cfg.schedule, resolve=True), "schedule"),
                    global_sequences(float(cfg.train.global_batch_tokens), seq_len) * seq_len)
