"""Loading the Hydra configuration tree into typed config objects.

`compose(overrides)` gives the resolved DictConfig for command-line style overrides
(`["+exp=flash_tiny", "model.dim=128"]`); `model_config(cfg)` turns its `model` group into a validated
`ModelConfig`, `optim_config(cfg)` its `optim` group into an `OptimConfig`; `TrainConfig` is the `train`
group. Code below `launch/` only ever sees the typed objects. `BatchPlan` is the run's batch arithmetic,
with the one rounding of the global batch (`global_sequences`, which the LR schedule's tokens per step
use too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from flashtrain.config import CONF_DIR
from flashtrain.config.errors import ConfigError
from flashtrain.config.typed import typed_config
from flashtrain.data.config import DataConfig, TokenSpec
from flashtrain.data.images import ImageProcessorConfig
from flashtrain.model.config import ModelConfig
from flashtrain.parallel.config import ParallelConfig
from flashtrain.parallel.dims import ParallelDims
from flashtrain.train.anticipatory import AnticipatoryRoutingConfig
from flashtrain.train.flops import PeakTflops
from flashtrain.train.optim.config import OptimConfig
from flashtrain.train.profile import ProfileConfig
from flashtrain.train.spike import SpikeConfig


@dataclass
class CheckpointConfig:
    interval: int = 50
    keep: int = 3
    async_save: bool = False


@dataclass
class TrainConfig:
    """The `train` group (conf/train/default.yaml documents every key)."""

    global_batch_tokens: float = 100.6e6
    max_steps: int | None = None  # stop after this many optimizer steps (the schedule is unchanged)
    seed: int = 0
    grad_clip: float = 1.0
    loss_tile_tokens: int = 2048  # head + cross-entropy over tiles of this many positions (train/loss.py)
    recompute: str = "none"  # activation recomputation per block: none | selective | full (model/recompute.py)
    balance_rate: float = 1e-3
    resume_from: str | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peak_tflops: PeakTflops = field(default_factory=PeakTflops)  # MFU peak per device type (train/flops.py)
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # traces / memory snapshots (train/profile.py)
    spike: SpikeConfig = field(default_factory=SpikeConfig)  # loss-spike detection and rollback (train/spike.py)
    anticipatory_routing: AnticipatoryRoutingConfig = field(default_factory=AnticipatoryRoutingConfig)


def global_sequences(global_batch_tokens: float, seq_len: int) -> int:
    """The fixed global batch in sequences: `train.global_batch_tokens` / `data.seq_len`, rounded (>= 1)."""
    return max(1, round(global_batch_tokens / seq_len))


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
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


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
    from flashtrain.train.schedule import Schedule, ScheduleConfig

    seq_len = int(cfg.data.seq_len)
    return Schedule(typed_config(ScheduleConfig, OmegaConf.to_container(cfg.schedule, resolve=True), "schedule"),
                    global_sequences(float(cfg.train.global_batch_tokens), seq_len) * seq_len)
