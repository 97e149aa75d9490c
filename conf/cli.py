"""The one way a launch tool ends on a user error (flashtrain.config.errors): `exit_on_user_error(main, ...)`
prints `error: <message>` on one stderr line and exits with status 2, no traceback (`FLASHTRAIN_DEBUG=1` or
`HYDRA_FULL_ERROR=1`: raise it, with the traceback). Every `launch/*.py` main goes through it.

Under torchrun (`RANK` set) only global rank 0 prints the line; every other rank waits up to
`OTHER_RANKS_WAIT_S` for the launcher to stop it (rank 0's exit makes torchrun stop the workers), then
prints its own line -- so the message appears once, and is never lost when rank 0 did not fail -- and
exits 2 too. torchrun itself then exits 1 with its `ChildFailedError` report (whose root cause is rank 0,
`exitcode: 2`): torchrun turns every failed worker into exit status 1, and nothing a worker does changes
that (README)."""

from __future__ import annotations

import os
import sys
import time

from flashtrain.config.errors import EXIT_USER_ERROR, USER_ERRORS

DEBUG_ENV = ("FLASHTRAIN_DEBUG", "HYDRA_FULL_ERROR")  # =1: raise, with the traceback, instead of one line
OTHER_RANKS_WAIT_S = 30.0  # torchrun: how long a rank other than 0 leaves rank 0 to report (and end) the run


def one_line(error: BaseException) -> str:
    """`error: <message>` on one line (a message never spans lines on the terminal)."""
    return "error: " + " ".join(str(error).split())


def exit_on_user_error(main, *args, **kwargs):
    """`main(*args, **kwargs)`; a user error (`USER_ERRORS`) instead ends the process: `error: <message>` on
    one stderr line (once under torchrun: module docstring) and exit status 2, no traceback."""
    try:
        return main(*args, **kwargs)
    except USER_ERRORS as e:
        if any(os.environ.get(name) == "1" for name in DEBUG_ENV):
            raise
        rank = os.environ.get("RANK", "0")
        if rank != "0":
            time.sleep(OTHER_RANKS_WAIT_S)  # torchrun stops this process once rank 0 has exited
        sys.stdout.flush()
        print(one_line(e) if rank == "0" else f"{one_line(e)} (rank {rank})", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
