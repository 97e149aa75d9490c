"""What a start writes into its run directory, and when: only once it is admitted (issue 47 item 2).

A start is admitted when every check has passed -- the configuration, the data, the run directory's job
lock, the resume point (train/trainer.py `Trainer.__init__`). Until then it writes nothing there:

- Hydra is told to write nothing itself (conf/config.yaml: no `.hydra/` output, a console-only job log);
- the log lines of the start (shard checks, the layout, ...) go to the console and are held in memory;
- `admit`: rank 0 writes the run's record, `.hydra/config.yaml`, `hydra.yaml` and `overrides.yaml`
  (what Hydra would have written; a restart replaces them), and every rank appends its held and further
  log lines to the job log `<hydra.job.name>.log` (`pretrain.log`), as Hydra's own file handler did (the
  ranks of another node k: `pretrain.node<k>.log`);
- `refuse` (a user error before admission: a busy run directory, a config or input check): the held
  lines are dropped, and the directories this start created (Hydra makes `hydra.run.dir` before the
  task runs) are removed again, with the job lock a fresh one received. A refused second job thus leaves
  the running job's record as it was.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from flashtrain.train.runtime.run_guard import LOCK_NAME

RECORD_DIR = ".hydra"  # Hydra's default hydra.output_subdir: where the run's composed config is recorded


def new_directories(run_dir: str | Path | None) -> list[Path]:
    """The directories a start would create for `run_dir` (it and its missing parents, deepest first):
    listed before Hydra makes them, so that a refused start can remove them again."""
    if run_dir is None:
        return []
    missing, path = [], Path(run_dir).absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _console_format(hydra_cfg: DictConfig) -> str | None:
    """The format of the job logging's console handler (conf/hydra/job_logging/console.yaml): the job log's
    lines read as the console's."""
    job_logging = hydra_cfg.get("job_logging") or {}
    try:
        return job_logging["formatters"][job_logging["handlers"]["console"]["formatter"]]["format"]
    except (KeyError, TypeError):
        return None


def job_log_name(job: str, node: int) -> str:
    """The job log of the ranks of `node` (torchrun's GROUP_RANK): `<job>.log` for node 0, `<job>.node<k>.log`."""
    return f"{job}.log" if node == 0 else f"{job}.node{node}.log"


class _Held(logging.Handler):
    """Keeps the log records of a start that is not admitted yet."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class StartRecord:
    """The run directory's record of one start (module docstring): `admit` or `refuse`, once."""

    def __init__(self, hydra_cfg: DictConfig, task_cfg: DictConfig, created: list[Path]):
        self.hydra_cfg, self.task_cfg, self.created = hydra_cfg, task_cfg, created
        self.run_dir = Path(hydra_cfg.runtime.output_dir)
        self.held = _Held()
        logging.getLogger().addHandler(self.held)

    def admit(self, is_main: bool, node: int = 0) -> None:
        """Rank 0 records the config; every rank's log lines from now on (and those held) go to the job log: the
        ranks of node 0 (rank 0's) to `pretrain.log`, those of node k to `pretrain.node<k>.log` (appends from
        several machines to one file of a shared filesystem can interleave mid-line)."""
        if is_main:
            record = self.run_dir / RECORD_DIR
            record.mkdir(exist_ok=True)
            files = {"config.yaml": self.task_cfg, "hydra.yaml": OmegaConf.create({"hydra": self.hydra_cfg}),
                     "overrides.yaml": OmegaConf.create(list(self.hydra_cfg.overrides.task))}
            for name, cfg in files.items():
                tmp = record / f".{name}.{os.getpid()}.tmp"
                OmegaConf.save(cfg, tmp)
                os.replace(tmp, record / name)
        root = logging.getLogger()
        root.removeHandler(self.held)
        job_log = logging.FileHandler(self.run_dir / job_log_name(self.hydra_cfg.job.name, node))
        job_log.setFormatter(logging.Formatter(_console_format(self.hydra_cfg)))
        for held in self.held.records:
            job_log.handle(held)
        root.addHandler(job_log)

    def refuse(self) -> None:
        """Drop the held lines; remove what this start created (the job lock of a directory it made, and the
        directories themselves when nothing else is in them)."""
        logging.getLogger().removeHandler(self.held)
        self.held.records.clear()
        if self.created and self.created[0] == self.run_dir.absolute():
            (self.run_dir / LOCK_NAME).unlink(missing_ok=True)
        for path in self.created:
            try:
                path.rmdir()
            except OSError:  # not empty (another process wrote there meanwhile), or gone already
                return
