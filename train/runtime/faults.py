"""Fault injection for the reliability tests and `launch/fuzz_restarts.py` (issue 18 items 4, 5, 8).

Off unless the environment variable `FLASHTRAIN_FAULT` is set; then it holds one or more faults
separated by `;`, each `action:key=value:...`:

    kill:rank=1:step=3:point=step_start            SIGKILL rank 1 when it reaches that point of step 3
    kill_node:rank=1:step=3                        SIGKILL rank 1's launcher (its node's torchrun), then rank 1:
                                                   the node is gone (its other workers die with their launcher)
    kill:rank=0:step=4:point=checkpoint_write:once=/tmp/x   ... only if /tmp/x does not exist (created first)
    stall:rank=1:step=2:point=step_start:seconds=600       rank 1 sleeps there (a hung collective for the others)
    spike:rank=0:step=7:scale=100:once=/tmp/y      rank 0's head input x 100 in step 7: a loss spike
                                                   (train/stability/spike.py)

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

import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from flashtrain.config.errors import ConfigError

FAULT_ENV = "FLASHTRAIN_FAULT"
POINTS = ("step_start", "checkpoint_write", "checkpoint_in_flight", "after_step")
ACTIONS = ("kill", "kill_node", "stall", "spike")


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    step: int
    point: str
    seconds: float = 3600.0
    once: str | None = None
    scale: float = 1.0  # spike: the factor on the head's input for the step (outlier activations)


FIELDS = ("rank", "step", "point", "seconds", "once", "scale")
EXAMPLE = "kill:rank=1:step=3:point=step_start"


def _int(item: str, key: str, value: str, least: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{FAULT_ENV}: {item!r}: {key}={value!r} is not a whole number") from None
    if n < least:
        raise ConfigError(f"{FAULT_ENV}: {item!r}: {key}={n} must be at least {least}")
    return n


def parse_one(item: str) -> Fault:
    """One `action:key=value:...` (see the module docstring); a ConfigError names what is wrong."""
    action, *fields = item.split(":")
    if action not in ACTIONS:
        raise ConfigError(f"{FAULT_ENV}: {item!r}: unknown action {action!r} (actions: {', '.join(ACTIONS)}; "
                          f"e.g. {EXAMPLE})")
    kv: dict[str, str] = {}
    for f in fields:
        key, eq, value = f.partition("=")
        if not eq:
            raise ConfigError(f"{FAULT_ENV}: {item!r}: field {f!r} is not key=value (e.g. {EXAMPLE})")
        if key not in FIELDS:
            raise ConfigError(f"{FAULT_ENV}: {item!r}: unknown field {key!r} (fields: {', '.join(FIELDS)})")
        if key in kv:
            raise ConfigError(f"{FAULT_ENV}: {item!r}: field {key!r} is given twice")
        kv[key] = value
    if "step" not in kv:
        raise ConfigError(f"{FAULT_ENV}: {item!r}: step= is missing (the 1-based optimizer step; e.g. {EXAMPLE})")
    point = kv.get("point", "step_start")
    if point not in POINTS:
        raise ConfigError(f"{FAULT_ENV}: {item!r}: unknown point {point!r} (points: {', '.join(POINTS)})")
    seconds = 3600.0
    if "seconds" in kv:
        if action != "stall":
            raise ConfigError(f"{FAULT_ENV}: {item!r}: seconds= applies to stall only")
        try:
            seconds = float(kv["seconds"])
        except ValueError:
            raise ConfigError(f"{FAULT_ENV}: {item!r}: seconds={kv['seconds']!r} is not a number") from None
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ConfigError(f"{FAULT_ENV}: {item!r}: seconds={kv['seconds']} must be a finite non-negative number")
    if "once" in kv and not kv["once"]:
        raise ConfigError(f"{FAULT_ENV}: {item!r}: once= needs a file path")
    if (action == "spike") != ("scale" in kv):
        raise ConfigError(f"{FAULT_ENV}: {item!r}: scale= goes with spike, and spike needs it (e.g. "
                          f"spike:rank=0:step=7:scale=100)")
    scale = 1.0
    if "scale" in kv:
        try:
            scale = float(kv["scale"])
        except ValueError:
            raise ConfigError(f"{FAULT_ENV}: {item!r}: scale={kv['scale']!r} is not a number") from None
        if point != "step_start":
            raise ConfigError(f"{FAULT_ENV}: {item!r}: a spike applies to the whole step; leave point= out")
    return Fault(action, _int(item, "rank", kv.get("rank", "0"), 0), _int(item, "step", kv["step"], 1), point,
                 seconds, kv.get("once"), scale)


def parse(spec: str) -> list[Fault]:
    """The faults of a `FLASHTRAIN_FAULT` value (`;`-separated; empty items are ignored)."""
    return [parse_one(item) for item in (s.strip() for s in spec.split(";")) if item]


def _faults() -> list[Fault]:
    spec = os.environ.get(FAULT_ENV)
    return parse(spec) if spec else []


def _first_time(f: Fault) -> bool:
    if f.once is None:
        return True
    try:
        fd = os.open(f.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # atomic: the first one to get here
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _launcher_is_parent() -> bool:
    """Whether this worker's parent is a torchrun launcher (not a test's stand-in for one)."""
    try:
        cmd = open(f"/proc/{os.getppid()}/cmdline", "rb").read()
    except OSError:
        return False
    return b"torch.distributed.run" in cmd or b"torchrun" in cmd


def inject(point: str, step: int, rank: int) -> None:
    """Fire the kill / stall faults set for this point, step and rank (nothing when FLASHTRAIN_FAULT is unset)."""
    for f in _faults():
        if f.action == "spike" or (f.point, f.step, f.rank) != (point, step, rank) or not _first_time(f):
            continue
        if f.action == "kill_node" and _launcher_is_parent():
            os.kill(os.getppid(), signal.SIGKILL)
        if f.action in ("kill", "kill_node"):
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            time.sleep(f.seconds)


def on_checkpoint_write(step: int, rank: int, tmp=None) -> None:
    """The checkpoint writer's hook (train/checkpoint.py `fault_hook`): the `checkpoint_write` point of `step`."""
    inject("checkpoint_write", step, rank)


def spike_scale(step: int, rank: int) -> float | None:
    """The factor a `spike` fault puts on this rank's head input in `step` (None: no spike)."""
    for f in _faults():
        if f.action == "spike" and (f.step, f.rank) == (step, rank) and _first_time(f):
            return f.scale
    return None


def validate_environment() -> None:
    """A malformed FLASHTRAIN_FAULT fails at start-up, not at the step it names."""
    for f in _faults():
        if f.once is not None and not Path(f.once).parent.is_dir():
            raise ConfigError(f"{FAULT_ENV}: once={f.once} is in a directory that does not exist")
