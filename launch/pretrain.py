"""Pre-training entry point (Hydra main); works under torchrun (any --nproc_per_node) and plain python.

    torchrun --standalone --nproc_per_node=2 launch/pretrain.py +exp=flash_small train.max_steps=30
    python launch/pretrain.py +exp=flash_tiny
    python launch/pretrain.py +exp=flash_small --cfg job     # print the composed config and exit (Hydra)

Takes `+exp=NAME` and Hydra overrides, nothing else of its own. With none, the defaults of
conf/config.yaml (model flash_small, the V4.1 optimizer and schedule, the embedded default corpus);
`train.max_steps` (default null: the schedule's length) stops early. Hydra's own flags work as usual
(`--cfg job`, `--hydra-help`, `-m` for a sweep); `--help` prints this.

The run directory (`hydra.run.dir`, default runs/<model>) holds the resolved config (`.hydra/`),
metrics.jsonl, checkpoints/, the wandb run and the job log (`pretrain.log`, the trainer's log lines);
starting again in a directory with checkpoints resumes from the newest. A start writes there only once
it is admitted (its config, data, the directory's job lock and its resume point checked:
train/runtime/run_record.py): a refused start leaves the directory as it found it.

torchrun conventions: the run is wrapped in torch.distributed.elastic's `record`, so a rank that fails
with an unexpected error writes its error file for the launcher; `parallel.timeout_s` is the process
group's timeout. A configuration or input error (the project's own error types, flashtrain.config.errors)
prints one line naming the value and the fix and exits with status 2, before any process group or model
exists: the overrides are composed first (an unknown key, exp or group option is named with the nearest
valid one, train/config.py `compose`), then the trainer checks the typed config, the data and the resume
point. Under torchrun only rank 0 prints the line; torchrun itself then exits 1 with its ChildFailedError
report (root cause: rank 0, exitcode 2) -- it gives every failed worker exit status 1.
`HYDRA_FULL_ERROR=1` (or `FLASHTRAIN_DEBUG=1`) shows the traceback instead.
"""

from __future__ import annotations

import gc
import logging
import sys

from flashtrain.config.cli import exit_with_help  # noqa: E402 - imports nothing heavy

if __name__ == "__main__":
    exit_with_help(__doc__, sys.argv[1:])  # --help: this docstring, before the slow imports

# Under torchrun: die with the launcher from before the slow imports on (a launcher killed during start-up
# must not leave workers behind holding the run directory); train/runtime/run_guard.py imports nothing heavy.
from flashtrain.train.runtime.run_guard import die_with_launcher  # noqa: E402

die_with_launcher()

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from flashtrain.config.cli import exit_on_user_error  # noqa: E402
from flashtrain.config.errors import USER_ERRORS  # noqa: E402
from flashtrain.train.config import compose_with_run_dir  # noqa: E402
from flashtrain.train.recipe import other_world_stage  # noqa: E402
from flashtrain.train.runtime.run_record import StartRecord, new_directories  # noqa: E402

NEW_DIRECTORIES: list = []  # what Hydra will create for the run directory: a refused start removes it again


@record
def run(cfg: DictConfig) -> None:
    from flashtrain.train.trainer import Trainer  # after the overrides are checked: a mistake there is reported fast

    start = StartRecord(HydraConfig.get(), cfg, NEW_DIRECTORIES)  # nothing written into the run directory yet

    def admitted_then_fit() -> None:
        try:
            trainer = Trainer(cfg, start.run_dir)  # every check of the start: config, data, job lock, resume point
        except USER_ERRORS:
            start.refuse()
            raise
        start.admit(trainer.is_main, trainer.nodes.places[trainer.rank].node)  # .hydra/ and the job log
        trainer.fit()
        while trainer.crossed:  # a boundary of the recipe's stages (train/recipe.py): the next stage, same processes
            if (relaunch := other_world_stage(cfg, start.run_dir)) is not None:
                logging.getLogger("flashtrain.launch").info(relaunch)  # (every rank: the job ends here)
                break
            trainer.close()
            del trainer
            gc.collect()
            trainer = Trainer(cfg, start.run_dir)  # its stage from the checkpoint just saved: its layout, resumed
            trainer.fit()

    exit_on_user_error(admitted_then_fit)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    run(cfg)


def main() -> None:
    overrides = sys.argv[1:]
    if not any(a.startswith("-") for a in overrides):  # Hydra's own flags (--help, --cfg, -m, ...): Hydra's
        # a mistake in the overrides: one line, before Hydra's many (and before Hydra makes the run directory)
        _, run_dir = exit_on_user_error(compose_with_run_dir, overrides)
        NEW_DIRECTORIES[:] = new_directories(run_dir)
        if not any(a.lstrip("+~").startswith("hydra.mode") for a in overrides):
            skip_the_mode_probe()
    hydra_main()


def skip_the_mode_probe() -> None:
    """A plain run (no -m, no hydra.mode override) is a single run: Hydra composes the whole config once more
    only to read `hydra.mode` (`Hydra.get_mode`), which is then unset (None: conf/ sets none), and runs it as
    one (RUN). Answered here, that composition (~0.25 s of CPU per rank and start) is not made; the run
    composes as before."""
    from hydra._internal.hydra import Hydra

    Hydra.get_mode = lambda self, config_name, overrides: None


if __name__ == "__main__":
    main()
