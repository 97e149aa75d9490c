"""Fault injection for the reliability tests and `launch/fuzz_restarts.py` (issue 18 items 4, 5, 8).

Off unless the environment variable `FLASHTRAIN_FAULT` is set; then it holds one or more faults
separated by `;`, each `action:key=value:...`:

    kill:rank=1:step=3:point=step_start            SIGKILL rank 1 when it reaches that point of step 3
    kill:rank=0:step=4:point=checkpoint_write:once=/tmp/x   ... only if /tmp/x does not exist (created first)
    stall:rank=1:step=2:point=step_start:seconds=600       rank 1 sleeps there (a hung collective for the others)

`step` is the optimizer step being run (1-based; for the checkpoint points the step being saved).
Points (where the trainer calls `inject`):
- `step_start`: before the step's forward passes;
- `checkpoint_write`: a checkpoint's files and manifest are written, not yet renamed complete
  (synchronous or background write);
- `checkpoint_in_flight`: right after a background (async) checkpoint write was started, while it runs;
- `after_step`: after the step's update and metrics, before any checkpoint of that step.
`once=PATH` makes a fault fire once per PATH (the elastic-restart test: a relaunched worker must not die again).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from model.config import ConfigError

FAULT_ENV = "FLASHTRAIN_FAULT"
POINTS = ("step_start", "checkpoint_write", "checkpoint_in_flight", "after_step")
ACTIONS = ("kill", "stall")


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    step: int
    point: str
    seconds: float = 3600.0
    once: str | None = None


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        action, *fields = item.split(":")
        try:
            kv = dict(f.split("=", 1) for f in fields)
            fault = Fault(action, int(kv.pop("rank", 0)), int(kv.pop("step")), kv.pop("point", "step_start"),
                          float(kv.pop("seconds", 3600.0)), kv.pop("once", None))
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{FAULT_ENV}={spec!r}: cannot read {item!r} ({e}); expected e.g. "
                              f"kill:rank=1:step=3:point=step_start") from None
        if action not in ACTIONS or fault.point not in POINTS or kv:
            raise ConfigError(f"{FAULT_ENV}={spec!r}: {item!r} has an unknown action, point or field (actions "
                              f"{ACTIONS}, points {POINTS}, fields rank/step/point/seconds/once)")
        faults.append(fault)
    return faults


def _faults() -> list[Fault]:
    spec = os.environ.get(FAULT_ENV)
    return parse(spec) if spec else []


def inject(point: str, step: int, rank: int) -> None:
    """Fire the faults set for this point, step and rank (nothing when FLASHTRAIN_FAULT is unset)."""
    for f in _faults():
        if (f.point, f.step, f.rank) != (point, step, rank):
            continue
        if f.once is not None:
            try:
                fd = os.open(f.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # atomic: the first one to get here
            except FileExistsError:
                continue
            os.close(fd)
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            time.sleep(f.seconds)


def validate_environment() -> None:
    """A malformed FLASHTRAIN_FAULT fails at start-up, not at the step it names."""
    for f in _faults():
        if f.once is not None and not Path(f.once).parent.is_dir():
            raise ConfigError(f"{FAULT_ENV}: once={f.once} is in a directory that does not exist")
