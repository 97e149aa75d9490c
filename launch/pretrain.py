"""Pre-training entry point (Hydra main); works under torchrun (any --nproc_per_node) and plain python.

    torchrun --nproc_per_node=2 launch/pretrain.py +exp=flash_small train.max_steps=30
    python launch/pretrain.py +exp=flash_tiny

The run directory (`hydra.run.dir`, default runs/<model>) holds the resolved config, metrics.jsonl,
checkpoints/, the wandb run and Hydra's job log (`pretrain.log`, the trainer's log lines); starting again
in a directory with checkpoints resumes from the newest.

torchrun conventions: the run is wrapped in torch.distributed.elastic's `record`, so a rank that fails
with an unexpected error writes its error file for the launcher; `parallel.timeout_s` is the process
group's timeout. A configuration or input error (the project's own error types) prints one line naming
the value and the fix and exits with status 2; `HYDRA_FULL_ERROR=1` (or `FLASHTRAIN_DEBUG=1`) shows the
traceback instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _die_with_launcher_early() -> None:
    """Under torchrun: ask for SIGKILL when the launcher dies before the slow imports (train/run_guard.py
    repeats it in the trainer), and exit at once if the launcher -- a torch process -- is already gone: a
    launcher killed during start-up must not leave workers behind holding the run directory."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    try:
        cmd = Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        cmd = b""
    if os.getppid() != parent or b"torch" not in cmd:
        os.kill(os.getpid(), signal.SIGKILL)


_die_with_launcher_early()

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from flashtrain.train.trainer import Trainer  # noqa: E402

EXIT_CONFIG_ERROR = 2


def user_errors() -> tuple[type[BaseException], ...]:
    """The project's own error types: each message already says what was wrong and what to do."""
    from flashtrain.config.errors import CheckpointError, ConfigError
    from flashtrain.data.config import DataConfigError
    from flashtrain.train.official.convert import OfficialCheckpointError
    from flashtrain.train.optim.routing import RoutingError

    return ConfigError, DataConfigError, RoutingError, OfficialCheckpointError, CheckpointError, FileNotFoundError


@record
def run(cfg: DictConfig) -> None:
    try:
        Trainer(cfg, HydraConfig.get().runtime.output_dir).fit()
    except user_errors() as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("FLASHTRAIN_DEBUG") == "1":
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
