"""One job per run directory, and workers that die with their launcher (issue 18 item 7).

- `acquire_run_lock`: rank 0 holds an exclusive `flock` on `<run dir>/.job.lock` for the life of the job
  (the kernel drops it when the process ends, however it ends). A second job started in the same run
  directory while the first still runs -- including workers orphaned by a killed launcher -- stops at
  once with a message naming the holder, instead of writing into the same checkpoints.
- `die_with_launcher`: torchrun starts each worker in its own session, so a SIGKILL of the launcher does
  not reach them; on Linux each worker asks the kernel for SIGKILL when its parent (the launcher) dies
  (`prctl(PR_SET_PDEATHSIG)`), and exits at once if the launcher is already gone.
- `die_with_parent`: the same for the data-loader workers a training process forks, which inherit its
  job lock: they die with it.
"""

from __future__ import annotations

import ctypes
import fcntl
import getpass
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from flashtrain.config.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = ".job.lock"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class RunDirectoryBusy(ConfigError):
    """Another job holds the run directory."""


def acquire_run_lock(run_dir: str | Path):
    """Take the run directory's job lock (rank 0); returns the open file, which must stay open."""
    path = Path(run_dir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunDirectoryBusy(f"run directory {Path(run_dir)} is in use by another job ({holder}); stop that job "
                               f"(and its workers) first, or use another hydra.run.dir") from None
    f.seek(0)
    f.truncate()
    try:
        owner = getpass.getuser()
    except (KeyError, OSError):
        owner = f"uid {os.getuid()}"
    f.write(f"{owner}, pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def _sigkill_when_parent_dies(who: str) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`).
    Where that is not possible: False, after a warning that ends with `who` (what may now outlive what)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): %s", ctypes.get_errno(), who)
            return False
    except (OSError, AttributeError) as e:
        log.warning("prctl unavailable (%s): %s", e, who)
        return False
    return True


def die_with_launcher() -> None:
    """Under torchrun (Linux): SIGKILL this worker when its launcher dies."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    if not _sigkill_when_parent_dies("workers may outlive a killed launcher"):
        return
    try:  # the launcher is a torch process: a different parent means it died before the request took effect
        cmd = Path(f"/proc/{launcher}/cmdline").read_bytes()
    except OSError:
        cmd = b""
    if os.getppid() != launcher or b"torch" not in cmd:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent: int, worker_id: int | None = None) -> None:
    """A data-loader worker's first act (the DataLoader's `worker_init_fn`, bound to the training
    process's pid): SIGKILL it when that process dies. A worker is forked, so it shares the run
    directory's job lock and the process's output pipes; one that outlived a SIGKILLed trainer would keep
    the restart out of the run directory (and a caller waiting for the output would wait for ever)."""
    if not sys.platform.startswith("linux"):
        return
    if _sigkill_when_parent_dies("data-loader workers may outlive a killed training process") \
            and os.getppid() != parent:  # the trainer died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
