"""Many nodes on one machine (issue 49; docs/parallelism.md "Many nodes"): two real torchrun launchers with
`--nnodes=2` and a c10d rendezvous on 127.0.0.1 are two nodes to torch.distributed. They train like one
`--standalone` launcher of two processes (the reference, forked warm: tests/warm_launch.py); a node killed
mid-step ends the other within the bound, naming it, and both started again resume bit-exactly; the Slurm
script (launch/slurm/pretrain.sbatch, run as it is) starts them through stand-ins for srun / scontrol
(tests/slurm/), stops on SIGTERM with a checkpoint, requeues, and the requeued job resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_launch
from layer_plans import FOUR_LAYERS

from flashtrain.train.runtime import faults

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multinode")]

ROOT = Path(__file__).resolve().parent.parent
STANDINS = Path(__file__).resolve().parent / "slurm"
STEPS = 6
RUN = ["+exp=flash_tiny", "logging.wandb.mode=disabled", "logging.progress=false", "logging.heatmap_interval=0",
       "data.corpus_text_bytes=300000", "data.corpus_mm_docs=100", "data.corpus_shards=2",
       "train.global_batch_tokens=256", "data.batch_size=1", "train.checkpoint.interval=2", f"train.max_steps={STEPS}",
       "parallel.peer_timeout_s=3", *FOUR_LAYERS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != faults.FAULT_ENV}
    return {**env, "WANDB_MODE": "disabled", **extra}


def losses(run) -> dict[int, float]:
    out = {}
    for line in (Path(run) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and "step" in r and r.get("event") is None:
            out[r["step"]] = r["loss"]
    return out


def node(run, port, corpus, *overrides, env=None, log=None):
    """One node's launcher: `torchrun --nnodes=2 --nproc_per_node=1` with the c10d rendezvous on 127.0.0.1:port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job{port}", str(ROOT / "launch" / "pretrain.py"), *RUN,
           f"data.corpus_dir={corpus}", f"hydra.run.dir={run}", *overrides]
    # torchrun gives each worker OMP_NUM_THREADS=1 only where a node runs more than one: one per node would
    # use every core, with other matmul blockings than the standalone reference's (losses 1 ulp apart)
    env = {"OMP_NUM_THREADS": "1", **(env or clean_env())}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def two_nodes(run, corpus, *overrides, env=None, stagger_s=1.0):
    """Both nodes, the second started `stagger_s` after the first; returns (Popen, log path) of each."""
    port, started = free_port(), []
    for n in (0, 1):
        log = Path(f"{run}.node{n}.log")
        started.append((node(run, port, corpus, *overrides, env=env, log=log), log))
        time.sleep(stagger_s)
    return started


def finish(started, timeout=300):
    for p, log in started:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q, _ in started:
                os.killpg(q.pid, signal.SIGKILL)
            raise AssertionError(f"a node did not finish in {timeout} s: {log.read_text()[-3000:]}") from None
    return [(p.returncode, log.read_text()) for p, log in started]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One `torchrun --standalone --nproc_per_node=2` launcher: the losses every form must give."""
    d = tmp_path_factory.mktemp("multinode")
    corpus = d / "corpus"
    run = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "launch" / "pretrain.py"), *RUN, f"data.corpus_dir={corpus}",
                           f"hydra.run.dir={d / 'standalone'}"], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = losses(d / "standalone")
    assert sorted(ref) == list(range(1, STEPS + 1))
    return d, corpus, ref


def test_two_launchers_train_like_one_standalone_launcher(reference, tmp_path):
    """Two nodes of one process each, the second launcher 2 s after the first, on a cache nobody built yet:
    the default corpus is built once for the job (rank 0 first, then each node's first rank finds it), the
    losses are the standalone launcher's, each node logs to its own job log, and the checkpoint resumes
    under the other form (a standalone launcher of two processes)."""
    _, _, ref = reference
    run, corpus = tmp_path / "run", tmp_path / "fresh_cache"
    (rc0, out0), (rc1, out1) = finish(two_nodes(run, corpus, "train.max_steps=4", stagger_s=2.0))
    assert rc0 == rc1 == 0, out0[-3000:] + out1[-3000:]
    got = losses(run)
    assert sorted(got) == [1, 2, 3, 4]
    assert all(abs(got[s] - ref[s]) <= 1e-6 * abs(ref[s]) for s in got), (got, ref)
    both = out0 + out1
    assert both.count("building the default corpus in") == 1, both[-4000:]
    host = socket.gethostname()
    assert f"2 node(s): node 0 on {host} (rank 0); node 1 on {host} (rank 1); a rank whose heartbeat stands still " \
           f"for parallel.peer_timeout_s=3 s is gone and ends the job" in both
    assert sorted(p.name for p in run.iterdir() if p.suffix == ".log") == ["pretrain.log", "pretrain.node1.log"]
    assert not list(run.glob(".node-probe-*"))
    ckpt = run / "checkpoints" / "step_00000004"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in ckpt.iterdir()}
    # the other form resumes it: one standalone launcher of two processes, steps 5 and 6
    more = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            str(ROOT / "launch" / "pretrain.py"), *RUN, f"data.corpus_dir={corpus}",
                            f"hydra.run.dir={run}"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                           timeout=600)
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"resumed from {ckpt} at step 4" in more.stdout + more.stderr
    assert losses(run) == {s: got[s] if s <= 4 else ref[s] for s in range(1, STEPS + 1)}


def test_a_lost_node_ends_the_other_within_the_bound_and_a_relaunch_resumes_bit_exactly(reference, tmp_path):
    """Node 1's launcher and its worker are SIGKILLed at the start of step 3 (FLASHTRAIN_FAULT kill_node) while
    rank 0 waits for it in the step's collectives: rank 0 ends within BOUND_S with one line naming node 1
    (the heartbeat post-mortem, parallel/liveness.py), no traceback, nothing left running; both nodes started
    again resume from step 2 and log the uninterrupted run's losses, step for step."""
    d, corpus, ref = reference
    run, fired = tmp_path / "run", tmp_path / "fired"
    env = clean_env(**{faults.FAULT_ENV: f"kill_node:rank=1:step=3:once={fired}"})
    started = two_nodes(run, corpus, env=env)
    (p0, log0), (p1, _) = started
    try:
        p0.wait(timeout=300)
    finally:
        for p, _ in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    ended = time.time()
    bound_s = 3 * 0.5 * 3 + 10  # the post-mortem (3 beats of peer_timeout_s / 6) and the launcher's own exit
    assert fired.exists() and p1.wait(timeout=10) == -signal.SIGKILL  # node 1's launcher itself, not its report
    assert ended - fired.stat().st_mtime < bound_s, f"rank 0 took {ended - fired.stat().st_mtime:.1f} s to end"
    out = log0.read_text()
    assert p0.returncode != 0
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out[-4000:]
    host = socket.gethostname()
    assert re.fullmatch(rf"error: rank 0: step 3, [^:]+: a collective failed \([^)]*\); node 1 on {host} \(rank 1\) "
                        r"is gone \(its heartbeat stopped: the process or its node died\); the last checkpoint is "
                        r"intact -- start every node again to resume, or the remaining nodes alone \(the data "
                        r"position re-splits over fewer readers\)", lines[0]), lines[0]
    assert "Error executing job" not in out and "CollectiveError" not in out
    assert sorted(losses(run)) == [1, 2]
    (rc0, out0), (rc1, out1) = finish(two_nodes(run, corpus))
    assert rc0 == rc1 == 0, out0[-3000:] + out1[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in out0 + out1
    assert losses(run) == ref


def test_the_slurm_script_runs_the_job_requeues_on_sigterm_and_resumes(reference, tmp_path):
    """launch/slurm/pretrain.sbatch, run as it is, with srun / scontrol stood in (tests/slurm/): two torchrun
    launchers through srun, the rendezvous on the allocation's first node; SIGTERM to the batch script once
    step 2 is logged (rank 0 held 3 s at step 3 so it lands mid-run) stops the training with a checkpoint
    and requeues the job (`scontrol requeue`), exit 0; the requeued job (SLURM_RESTART_COUNT=1) resumes from
    that checkpoint and ends with the uninterrupted run's losses."""
    d, corpus, ref = reference
    run, record = tmp_path / "run", tmp_path / "slurm.log"
    env = clean_env(PATH=f"{STANDINS}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242",
                    SLURM_JOB_NODELIST="node[01-02]", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(ROOT),
                    FLASHTRAIN_NPROC_PER_NODE="1", FLASHTRAIN_RDZV_PORT=str(free_port()),
                    FLASHTRAIN_PYTHON=sys.executable, FAKE_SLURM_LOG=str(record))
    script = [str(ROOT / "launch" / "slurm" / "pretrain.sbatch"), *RUN, f"data.corpus_dir={corpus}",
              f"hydra.run.dir={run}"]
    held = {**env, faults.FAULT_ENV: f"stall:rank=0:step=3:point=step_start:seconds=3:once={tmp_path / 'held'}"}
    with open(tmp_path / "first.log", "w") as f:
        job = subprocess.Popen(["bash", *script], cwd=tmp_path, env=held, stdout=f, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or 2 not in losses(run):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    first = (tmp_path / "first.log").read_text()
    calls = record.read_text().splitlines()
    port = env["FLASHTRAIN_RDZV_PORT"]
    assert calls[0] == "scontrol show hostnames node[01-02]"
    assert calls[1] == (f"srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 {sys.executable} -m "
                        f"torch.distributed.run --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d "
                        f"--rdzv-endpoint=localhost:{port} --rdzv-id=4242-0 --max-restarts=0 launch/pretrain.py "
                        + " ".join(script[1:]))
    assert calls[2:] == ["scontrol requeue 4242"], calls
    assert "flashtrain: job 4242 got SIGTERM: stopping the training (it saves a checkpoint), then requeueing" in first
    stopped = sorted(losses(run))
    assert stopped[0] == 1 and 3 <= stopped[-1] < STEPS, first[-3000:]  # stopped mid-run, after the held step
    assert (run / "checkpoints" / f"step_{stopped[-1]:08d}").is_dir()  # the SIGTERM checkpoint

    again = subprocess.run(["bash", *script], cwd=tmp_path, env={**env, "SLURM_RESTART_COUNT": "1"},
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped[-1]:08d}'} at step {stopped[-1]}" in \
        again.stdout + again.stderr
    assert "--rdzv-id=4242-1" in record.read_text().splitlines()[-1]
    assert losses(run) == ref
