"""Loading the Hydra configuration tree into typed config objects.

`compose(overrides)` gives the resolved DictConfig for command-line style overrides
(`["+exp=flash_tiny", "model.dim=128"]`); `model_config(cfg)` turns its `model` group into a validated
`ModelConfig`, `optim_config(cfg)` its `optim` group into an `OptimConfig`; `TrainConfig` is the `train`
group. Code below `launch/` only ever sees the typed objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from flashtrain.config import CONF_DIR
from flashtrain.config.typed import typed_config
from flashtrain.data.config import DataConfig, TokenSpec
from flashtrain.data.images import ImageProcessorConfig
from flashtrain.model.config import ModelConfig
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
    sequences = max(1, round(float(cfg.train.global_batch_tokens) / seq_len))
    return Schedule(typed_config(ScheduleConfig, OmegaConf.to_container(cfg.schedule, resolve=True), "schedule"),
                    sequences * seq_len)
