"""One job per run directory and workers that die with their launcher (issue 18 item 7,
train/runtime/run_guard.py)."""

import getpass
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from layer_plans import EIGHT_LAYERS

from flashtrain.train.runtime.run_guard import RunDirectoryBusy, acquire_run_lock

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.heatmap_interval=0",
         "data.corpus_text_bytes=300000",
         "data.corpus_mm_docs=100", "data.corpus_shards=2", "train.global_batch_tokens=128", "data.batch_size=1"]


def test_a_second_job_in_the_same_run_directory_is_refused(tmp_path):
    """... and writes nothing there (issue 47 item 2): the running job's config record and job log stay as
    they were."""
    held = acquire_run_lock(tmp_path)
    with pytest.raises(RunDirectoryBusy, match=rf"in use by another job \({getpass.getuser()}, pid {os.getpid()} on "):
        acquire_run_lock(tmp_path)
    (tmp_path / ".hydra").mkdir()
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (tmp_path / ".hydra" / name).write_text(f"the running job's {name}\n")
    (tmp_path / "pretrain.log").write_text("the running job's log\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny",
                          f"hydra.run.dir={tmp_path}", f"data.corpus_dir={tmp_path / 'corpus'}", *SMALL],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    holder = f"is in use by another job ({getpass.getuser()}, pid {os.getpid()}"
    assert out.returncode == 2 and holder in out.stderr, out.stderr[-2000:]
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert sorted(tmp_path.rglob("*")) == sorted([*before, tmp_path / ".hydra"])
    held.close()  # released: the next job may start
    acquire_run_lock(tmp_path).close()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    """Running, or exiting with its files still open: a process whose main thread is a zombie while other
    threads are still on their way out holds its files (and the job lock) until the last one has gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        zombie = Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return not zombie or threads > 1


# a training process: takes the run directory's lock, starts 2 loader workers the way train/build.py does,
# prints their pids once both have delivered a batch, then waits to be killed
LOADER_WORKERS = """
import functools, os, sys, time
import torch
from flashtrain.train.runtime.run_guard import acquire_run_lock, die_with_parent

class Pids(torch.utils.data.IterableDataset):
    def __iter__(self):
        while True:
            yield os.getpid()

lock = acquire_run_lock(sys.argv[1])
loader = iter(torch.utils.data.DataLoader(Pids(), batch_size=None, num_workers=2,
                                          worker_init_fn=functools.partial(die_with_parent, os.getpid())))
print(sorted({next(loader) for _ in range(4)}), flush=True)
time.sleep(600)
"""


def test_loader_workers_die_with_a_killed_training_process(tmp_path):
    """SIGKILL of a training process takes its data-loader workers with it at once (they would otherwise
    live on -- for minutes, torch's own watchdog notwithstanding -- holding the inherited job lock), so the
    run directory is free for the restart."""
    trainer = subprocess.Popen([sys.executable, "-c", LOADER_WORKERS, str(tmp_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = eval(trainer.stdout.readline())
        assert len(workers) == 2 and trainer.pid not in workers, (workers, trainer.stderr.read()[-2000:])
        assert all(_alive(w) for w in workers)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.time() + 2  # a kernel signal: well before torch's 5 s watchdog could act
    while time.time() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.05)
    left = [w for w in workers if _alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left, "loader workers outlived their training process"
    acquire_run_lock(tmp_path).close()  # the lock went with them


@pytest.mark.slow
def test_workers_die_with_a_killed_launcher_and_the_run_restarts(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", *EIGHT_LAYERS, f"hydra.run.dir={run}",
           f"data.corpus_dir={tmp_path / 'corpus'}", "train.max_steps=200", *SMALL,
           "train.global_batch_tokens=256"]  # one sequence per rank
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and launcher.poll() is None and not (
            (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):
        time.sleep(0.5)
    assert launcher.poll() is None, launcher.stderr.read()[-3000:]
    workers = _children(launcher.pid)
    assert len(workers) == 2, workers
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.2)
    assert not any(_alive(w) for w in workers), "workers outlived their launcher"
    again = subprocess.run([a if a != "train.max_steps=200" else "train.max_steps=1" for a in cmd], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
