"""The one way a launch tool ends on a user error (flashtrain.config.errors): `exit_on_user_error(main, ...)`
prints `error: <message>` on one stderr line and exits with status 2, no traceback (`FLASHTRAIN_DEBUG=1` or
`HYDRA_FULL_ERROR=1`: raise it, with the traceback). Every `launch/*.py` main goes through it.

Under torchrun (`RANK` set) only global rank 0 prints the line; every other rank waits up to
`OTHER_RANKS_WAIT_S` for the launcher to stop it (rank 0's exit makes torchrun stop the workers), then
prints its own line -- so the message appears once, and is never lost when rank 0 did not fail -- and
exits 2 too; normally torchrun has stopped it by then (SIGTERM, which torchrun's report shows for those
ranks). torchrun itself then exits 1 with its `ChildFailedError` report (whose root cause is rank 0,
`exitcode: 2`): torchrun turns every failed worker into exit status 1, and nothing a worker does changes
that (README). An error that names the rank to print it (`printed_by`: a lost peer, whose message the
lowest rank still there prints, train/runtime/collectives.py) is printed by that rank alone, and every other rank
exits at once. `exit_with_help` / `overrides_help`: the --help of the tools (each says what it takes and
what every default means)."""

from __future__ import annotations

import os
import sys
import time

from flashtrain.config import CONF_DIR
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
        # a lost peer: the lowest rank still there (train/runtime/collectives.py)
        printed_by = getattr(e, "printed_by", None)
        if printed_by is not None:
            if printed_by < 0 or rank == str(printed_by):
                print(one_line(e), file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USER_ERROR) from None
        if rank != "0":
            time.sleep(OTHER_RANKS_WAIT_S)  # torchrun stops this process once rank 0 has exited
        sys.stdout.flush()
        print(one_line(e) if rank == "0" else f"{one_line(e)} (rank {rank})", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


# --- --help (issue 32 item 2): every launch tool says what it takes and what each default means ----------
HELP_FLAGS = ("-h", "--help")


def overrides_help(more: str = "") -> str:
    """The paragraph every tool that composes the configuration shows under --help: +exp=NAME, Hydra
    overrides, where each default is written (and `more`), wrapped."""
    import textwrap

    exps = ", ".join(sorted(p.stem for p in (CONF_DIR / "exp").glob("*.yaml")))
    groups = ", ".join(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "exp"
                              and any(p.glob("*.yaml"))))
    text = (f"Configuration: +exp=NAME selects an experiment ({exps}; conf/exp/NAME.yaml), and Hydra overrides "
            f"key=value set single values on top of it (data.seq_len=1024 parallel.pp=2 train.recompute=full). "
            f"Every key has its default, with a comment saying what it means, in conf/GROUP/*.yaml (groups: "
            f"{groups}); a misspelt key or exp is an error naming the nearest valid one.")
    return textwrap.fill(text + (f" {more}" if more else ""), 108)


def exit_with_help(doc: str, argv: list[str], overrides: bool = True) -> None:
    """`-h` / `--help` in `argv`: print `doc` (the tool's docstring: what it takes and what each default
    means), with `overrides_help()` when the tool composes the configuration, and exit 0. Launch tools
    that parse their own arguments call it before their slow imports:
    `if __name__ == "__main__": exit_with_help(__doc__, sys.argv[1:])`."""
    if not any(a in HELP_FLAGS for a in argv):
        return
    print(doc.strip() + ("\n\n" + overrides_help() if overrides else ""))
    raise SystemExit(0)

