"""Pre-training entry point (Hydra main); works under torchrun (any --nproc_per_node) and plain python.

    torchrun --nproc_per_node=2 launch/pretrain.py +exp=flash_small train.max_steps=30
    python launch/pretrain.py +exp=flash_tiny

The run directory (`hydra.run.dir`, default runs/<model>) holds the resolved config, metrics.jsonl,
checkpoints/ and the wandb run; starting again in a directory with checkpoints resumes from the newest.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from train.trainer import Trainer  # noqa: E402


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    Trainer(cfg, HydraConfig.get().runtime.output_dir).fit()


if __name__ == "__main__":
    main()
