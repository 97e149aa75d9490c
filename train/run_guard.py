"""One job per run directory, and workers that die with their launcher (issue 18 item 7).

- `acquire_run_lock`: rank 0 holds an exclusive `flock` on `<run dir>/.job.lock` for the life of the job
  (the kernel drops it when the process ends, however it ends). A second job started in the same run
  directory while the first still runs -- including workers orphaned by a killed launcher -- stops at
  once with a message naming the holder, instead of writing into the same checkpoints.
- `die_with_launcher`: torchrun starts each worker in its own session, so a SIGKILL of the launcher does
  not reach them; on Linux each worker asks the kernel for SIGKILL when its parent (the launcher) dies
  (`prctl(PR_SET_PDEATHSIG)`), and exits at once if the launcher is already gone.
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


def die_with_launcher() -> None:
    """Under torchrun (Linux): SIGKILL this worker when its launcher dies."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): workers may outlive a killed launcher",
                        ctypes.get_errno())
            return
    except (OSError, AttributeError) as e:
        log.warning("prctl unavailable (%s): workers may outlive a killed launcher", e)
        return
    try:  # the launcher is a torch process: a different parent means it died before the request took effect
        cmd = Path(f"/proc/{launcher}/cmdline").read_bytes()
    except OSError:
        cmd = b""
    if os.getppid() != launcher or b"torch" not in cmd:
        os.kill(os.getpid(), signal.SIGKILL)
