"""`run(cmd, ...)`: `subprocess.run` for the suite's launches, forking them from a warm interpreter.

A launch of `python -m torch.distributed.run --standalone --nproc_per_node=N script.py ...` or of
`python script.py ...` spends ~5 s of CPU per process importing torch, torch.distributed.checkpoint, dynamo,
Hydra and the project before its first line of work, and torchrun's agent ~2 s more; the suite makes a few
hundred of them on 2 cores. Here one server process per pytest worker (the "zygote") imports all of that
once; each launch forks its ranks from it (a fork costs milliseconds), with the environment torchrun gives
its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR / MASTER_PORT with rank 0 hosting
the store, TORCHELASTIC_RUN_ID, ...), and reports what subprocess.run would: the return code (torchrun's
rule: 1 when any rank failed, after the others are stopped), stdout and stderr (the ranks' lines
interleaved, as torchrun leaves them), TimeoutExpired after killing every rank.

What a forked rank shares with a fresh process: the imports' module state, and nothing else (the zygote
only imports, and holds one thread: checked before each fork), except the interpreter's string
hash seed (PYTHONHASHSEED): every launch forked from one zygote has the same, where fresh processes each
draw their own; the crash fuzz and the elastic restart (real processes) keep covering that. What it cannot
share is an environment read at import time (TORCH*, TRITON*, OMP_*, MKL_*, PYTHON*, CUDA*, LD_*): a
launch whose environment differs there is forked from a zygote started with that environment (at most
MAX_ZYGOTES per pytest worker; e.g. TRITON_INTERPRET=1's, tests/test_triton_kernels.py). Any other command
runs through subprocess.run unchanged. torchrun's own behaviour (its ChildFailedError report, elastic
restarts, a killed launcher, workers' process trees) is tested with the real torchrun: tests/test_launch.py,
test_reliability.py, test_run_guard.py; tests/test_warm_launch.py holds the stand-in to the real thing.
`FLASHTRAIN_COLD_LAUNCH=1` sends every launch through subprocess.run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# the modules a launch of the project's scripts imports before its first line of work (the zygote's)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.elastic.multiprocessing.errors", "torch.distributed.pipelining", "torch._dynamo",
           "hydra", "omegaconf", "flashtrain.train.trainer", "flashtrain.train.evaluation.heldout")
# environment variables read at import time (by torch, dynamo / inductor, Triton, OpenMP, the interpreter);
# except PYTHONPATH (a forked launch puts its entries on sys.path as the interpreter would) and torchrun's
# TORCHELASTIC_* (read when used: the error file of `record`)
IMPORT_TIME_ENV = ("TORCH", "TRITON", "OMP_", "MKL_", "PYTHON", "CUDA", "LD_", "KMP_", "GOMP_")
RUNTIME_ENV = ("PYTHONPATH", "TORCHELASTIC_")
STOP_GRACE_S = 10  # a failed rank's peers get SIGTERM, then SIGKILL after this (torchrun: SIGTERM, 30 s)
POLL_S = 0.02

_TORCHRUN = ("-m", "torch.distributed.run")


def _parse(cmd) -> tuple[str, list[str], int, bool] | None:
    """(script, args, ranks, under_torchrun) for the launches the zygote runs; None for anything else.
    `script` is a path, "-c" with the code as args[0] (torchrun's `--no-python python -c CODE`), or "-m" with
    the module's name as args[0] (`python -m pytest ...`)."""
    cmd = [str(c) for c in cmd]
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if tuple(cmd[1:3]) == _TORCHRUN:
        rest, nproc, standalone, no_python = cmd[3:], 1, False, False
        while rest and rest[0].startswith("--"):
            opt = rest.pop(0)
            if opt == "--standalone":
                standalone = True
            elif opt == "--no-python":
                no_python = True
            elif opt.startswith(("--nproc_per_node=", "--nproc-per-node=")):
                nproc = int(opt.split("=", 1)[1])
            else:
                return None  # any other torchrun option (restarts, rdzv, redirects): the real torchrun
        if not standalone:
            return None
        if no_python:
            return ("-c", rest[2:], nproc, True) if rest[:2] == [sys.executable, "-c"] and len(rest) > 2 else None
        return (rest[0], rest[1:], nproc, True) if rest and rest[0].endswith(".py") else None
    if cmd[1].endswith(".py"):
        return cmd[1], cmd[2:], 1, False
    if cmd[1] == "-m" and len(cmd) > 2:
        return "-m", cmd[2:], 1, False
    return None


def _import_time(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and not k.startswith(RUNTIME_ENV)}


class _Zygote:
    """One server process, started with `env` (its import-time variables are those of every launch it forks)."""

    def __init__(self, env: dict):
        here = str(Path(__file__).resolve().parent)
        # "torch" in its command line: a worker under torchrun checks that its parent is a torch process
        # (train/runtime/run_guard.py die_with_launcher)
        code = f"import sys, torch; sys.path.insert(0, {here!r}); import warm_launch; warm_launch.serve({here!r})"
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env)
        ready = self.proc.stdout.readline().strip()
        self.usable = ready == b"ready"
        if not self.usable and not ready.startswith(b"threads"):
            raise RuntimeError(f"warm_launch: the zygote did not start ({ready!r}, exit {self.proc.wait()})")

    def launch(self, request: dict) -> dict:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"warm_launch: the zygote died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


MAX_ZYGOTES = 2  # per pytest worker: the plain environment's, and one other (TRITON_INTERPRET=1's)
_zygotes: dict[str, _Zygote] = {}  # by import-time environment, the most recently used last
_lock = threading.Lock()


def _get_zygote(env: dict) -> _Zygote:
    key = json.dumps(sorted(_import_time(env).items()))
    zygote = _zygotes.pop(key, None)
    if zygote is None or (zygote.usable and zygote.proc.poll() is not None):  # an unusable one is remembered
        while len(_zygotes) >= MAX_ZYGOTES:
            _zygotes.pop(next(iter(_zygotes))).close()
        zygote = _Zygote(env)
        import atexit

        atexit.register(zygote.close)
    _zygotes[key] = zygote
    return zygote


def run(cmd, *, cwd=None, env=None, timeout=None, capture_output=False, text=False, check=False, **kwargs):
    """subprocess.run(cmd, ...) with the same result, forking the launches _parse recognises from the
    zygote (module docstring). Other keyword arguments (stdin, stdout, ...) go to subprocess.run."""
    parsed = None if kwargs or os.environ.get("FLASHTRAIN_COLD_LAUNCH") == "1" else _parse(cmd)
    full_env = dict(os.environ if env is None else env)
    zygote = None if parsed is None else _get_zygote(full_env)
    if zygote is None or not zygote.usable:
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, capture_output=capture_output, text=text,
                              check=check, **kwargs)
    script, args, nproc, torchrun = parsed
    with _lock, tempfile.TemporaryDirectory(prefix="warm_launch_") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        if script not in ("-c", "-m"):
            script = str(Path(cwd or ".", script).resolve())
        reply = zygote.launch({"script": script, "args": args, "nproc": nproc, "torchrun": torchrun,
                               "cwd": str(Path(cwd or ".").resolve()), "env": full_env, "timeout": timeout,
                               "stdout": str(out), "stderr": str(err)})
        stdout, stderr = out.read_bytes(), err.read_bytes()
    if text:
        stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    if not capture_output:
        (sys.stdout.write if text else sys.stdout.buffer.write)(stdout)
        (sys.stderr.write if text else sys.stderr.buffer.write)(stderr)
        stdout = stderr = None
    if reply.get("timeout"):
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    done = subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)
    if check:
        done.check_returncode()
    return done


# ---------------------------------------------------------------------------------------------- the zygote

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(request: dict, rank: int, port: int, base_env: dict) -> None:
    """In the forked child: become `python script args` (under torchrun: its worker `rank`), then exit."""
    os.setpgid(0, 0)  # its own process group: stopping it stops what it started
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
    added = {k: v for k, v in os.environ.items() if k not in base_env}  # set by the preloaded imports
    os.environ.clear()
    os.environ.update({**added, **request["env"]})
    if request["torchrun"]:
        n = request["nproc"]
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                           "ROLE_NAME": "default", "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                           "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(n), "MASTER_ADDR": "localhost",
                           "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"warm-{port}",
                           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                           "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.chdir(request["cwd"])
    script, args = request["script"], request["args"]
    sys.argv = [script, *args] if script not in ("-c", "-m") else [script, *args[1:]]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = {"-c": "", "-m": os.getcwd()}.get(script, os.path.dirname(script))  # as the interpreter sets it
    sys.path[:1] = [first, *extra]
    code = 0
    try:
        import runpy

        if script == "-c":
            exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif script == "-m":
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:  # what the interpreter does at exit: join threads, run atexit, flush
        try:
            threading._shutdown()
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
    os._exit(code & 0xFF)


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def _stop(pids: set[int], sig) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def _left_in(groups: set[int]) -> list[int]:
    """The live (not zombie) processes of these process groups."""
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
            if int(fields[2]) in groups and fields[0] != "Z":
                left.append(int(entry))
    return left


def _serve_one(request: dict, base_env: dict) -> dict:
    if _threads() != 1:
        raise RuntimeError(f"warm_launch: the zygote holds {_threads()} threads; forking it is unsafe")
    port = _free_port() if request["torchrun"] else 0
    pids: dict[int, int] = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            try:
                _rank_main(request, rank, port, base_env)
            finally:
                os._exit(1)
        try:
            os.setpgid(pid, pid)  # also here: the child may not have got there before a stop
        except OSError:
            pass
        pids[pid] = rank
    deadline = None if request["timeout"] is None else time.monotonic() + request["timeout"]
    codes: dict[int, int] = {}
    stop_at = None
    running = set(pids)
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                _stop(running | set(pids), signal.SIGKILL)
                for p in list(running):
                    os.waitpid(p, 0)
                return {"timeout": True}
            if stop_at is not None and now > stop_at:
                _stop(running, signal.SIGKILL)
            time.sleep(POLL_S)
            continue
        if pid not in pids:
            continue
        running.discard(pid)
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and stop_at is None and running:
            _stop(running, signal.SIGTERM)  # torchrun stops the others when one fails
            stop_at = time.monotonic() + STOP_GRACE_S
    if request["torchrun"]:
        _stop(set(pids), signal.SIGTERM)  # torchrun's close: each worker's session, whatever is left in it
    # as subprocess.run reading pipes: done when nothing the launch started is left holding its output (a
    # rank's forked children, e.g. data-loader workers that outlive it); a timeout while they linger
    while _left_in(set(pids)):
        if deadline is not None and time.monotonic() > deadline:
            _stop(set(pids), signal.SIGKILL)
            return {"timeout": True}
        time.sleep(POLL_S)
    failed = {r: c for r, c in sorted(codes.items()) if c != 0}
    if not request["torchrun"]:
        return {"returncode": codes[0]}
    if failed:
        first = next(iter(failed.items()))
        with open(request["stderr"], "a") as f:
            f.write(f"warm_launch: rank {first[0]} failed with exit code {first[1]} (ranks failed: {failed}); "
                    "torchrun would report ChildFailedError and exit 1\n")
    return {"returncode": 1 if failed else 0}


def serve(tests_dir: str) -> None:
    """The zygote's loop: import PRELOAD, then fork one launch per request line on stdin."""
    base_env = dict(os.environ)
    sys.path.remove(tests_dir)
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    del sys.modules["warm_launch"]  # a forked script imports the tests' modules from its own sys.path
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = sys.stdout.buffer
    if _threads() != 1:  # e.g. OpenMP's pool, started by `import torch` without OMP_NUM_THREADS=1
        out.write(f"threads {_threads()}: launches with this environment run cold\n".encode())
        out.flush()
        return
    out.write(b"ready\n")
    out.flush()
    while True:
        line = sys.stdin.buffer.readline()
        if not line:
            return
        reply = _serve_one(json.loads(line), base_env)
        out.write((json.dumps(reply) + "\n").encode())
        out.flush()
