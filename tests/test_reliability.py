"""Reliability (issue 18 items 4, 5, 8): fault-injection specs (train/runtime/faults.py), the crash fuzz
(launch/fuzz_restarts.py: 20 SIGKILLs of workers, whole jobs, the launcher alone and checkpoint writes,
then bit-exact against an uninterrupted run), an elastic restart under `torchrun --max-restarts=1`, and a
hung collective that fails the job within the process-group timeout, naming the step and the operation.

Every end-to-end check reads facts (files and tensors on disk, exit statuses, which processes are alive)
rather than the trainer's own messages alone."""

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_launch
from test_trainer import corpus_args  # noqa: F401 - the shared corpus fixture

from flashtrain.config.errors import ConfigError
from flashtrain.train.runtime import faults

ROOT = Path(__file__).resolve().parent.parent


def _load_fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_restarts", ROOT / "launch" / "fuzz_restarts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_restarts", module)
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzz()


# --- the fuzzer's reported figures, by hand -------------------------------------------------------------
def test_kinds_choose_what_each_round_visits(tmp_path, capsys):
    """`--kinds`: each round of the plan visits exactly the named kinds, once each (7 kills over 3 kinds: two
    whole rounds and one kill of a third); a kind named twice, an unknown one or none at all is refused, naming
    the valid ones."""
    args = fuzz.parse_args(["--kills", "7", "--kinds", "job, ckpt_in_flight,launcher", "--keep-dir", str(tmp_path)])
    assert args.kinds == ("job", "ckpt_in_flight", "launcher") and args.steps == 2 * 7 + 10
    plan = fuzz.Fuzzer(args).plan()
    assert len(plan) == 7 and sorted(plan[:3]) == sorted(plan[3:6]) == ["ckpt_in_flight", "job", "launcher"]
    assert plan[6] in args.kinds
    assert fuzz.parse_args(["--keep-dir", str(tmp_path)]).kinds == fuzz.KINDS  # the default: all six
    for bad, named in (("job,jobs", "(jobs is not one)"), ("job,job", "name each kind once"), (",", "name each")):
        with pytest.raises(SystemExit) as e:
            fuzz.parse_args(["--kinds", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert named in err and ",".join(fuzz.KINDS) in err, err


def test_a_kill_line_numbers_kills_from_one_and_times_the_kill():
    """`kill N/K`: N from 1; `at T s`: when the kill landed since the fuzzer started, then the time since its start's
    launch."""
    killed = fuzz.Start(index=2, kind="worker", async_save=False, expected_resume=4, t_launch=110.0, t_kill=112.5,
                        kill_note="rank 1 (pid 77)")
    restart = fuzz.Start(index=3, kind="job", async_save=True, expected_resume=6, resumed_note="step_00000006")
    assert fuzz.kill_line(killed, restart, 6, t0=100.0) == (
        "kill  3/6 worker           at   12.5s (2.5s after launch): rank 1 (pid 77); restart: step_00000006")


def records(*step_loss):
    return [{"step": s, "loss": v} for s, v in step_loss]


def test_the_metrics_verdict_names_each_wrong_missing_or_twice_logged_step():
    """metrics.jsonl against the uninterrupted run's, 4 steps: each step once with its loss passes (with the
    count); a loss that differs is named (step, fuzzed, uninterrupted); a missing step, the last one included, is
    named; a step logged twice fails on the count."""
    ref = records((1, 5.0), (2, 4.5), (3, 4.25), (4, 4.0))
    assert fuzz.metrics_verdict(ref, ref, 4) == ([], [
        "metrics.jsonl: 4 step records (each step once, the re-runs' after kills), every loss equal to the "
        "uninterrupted run's at its step"])
    got = records((1, 5.0), (2, 4.5), (3, 4.3), (4, 4.0))
    assert fuzz.metrics_verdict(ref, got, 4) == ([
        "metrics.jsonl losses differ from the uninterrupted run at (step, fuzzed, uninterrupted) [(3, 4.3, 4.25)]; "
        "steps never logged []"], [])
    assert fuzz.metrics_verdict(ref, ref[:3], 4)[0] == [
        "metrics.jsonl losses differ from the uninterrupted run at (step, fuzzed, uninterrupted) []; steps never "
        "logged [4]"]
    twice = records((1, 5.0), (2, 4.5), (2, 4.5), (3, 4.25), (4, 4.0))
    assert fuzz.metrics_verdict(ref, twice, 4) == ([
        "metrics.jsonl holds 5 step records for 4 steps: a step is logged twice (a resume must remove the records "
        "of the steps it re-runs)"], [])
    assert fuzz.metrics_verdict(ref[:3], ref[:3], 3)[0] == []
    assert fuzz.metrics_verdict(ref[:3], ref[:3], 4)[0][0] == "the uninterrupted run logged steps [1, 2, 3]"


def test_the_final_meta_comparison_reads_step_and_tokens_seen():
    """The checkpoint meta's `step` and `tokens_seen` (train/trainer.py's keys) are compared; the config is not."""
    a = {"step": 8, "tokens_seen": 2048, "config": {"async_save": True}}
    assert fuzz.meta_differences(a, {**a, "config": {"async_save": False}}) == []
    assert fuzz.meta_differences(a, {**a, "tokens_seen": 1792}) == ["meta.tokens_seen (2048 vs 1792)"]
    assert fuzz.meta_differences(a, {**a, "step": 7}) == ["meta.step (8 vs 7)"]


# --- FLASHTRAIN_FAULT specs -------------------------------------------------------------------------
@pytest.mark.parametrize("spec, problem", [
    ("kill:rank=1", "step= is missing"),
    ("boom:step=1", "unknown action 'boom'"),
    ("kill:step=1:point=somewhere", "unknown point 'somewhere'"),
    ("kill:step=1:color=red", "unknown field 'color'"),
    ("kill:rank1:step=2", "field 'rank1' is not key=value"),
    ("kill:step=2:step=3", "field 'step' is given twice"),
    ("kill:rank=one:step=2", "rank='one' is not a whole number"),
    ("kill:step=0", "step=0 must be at least 1"),
    ("kill:rank=-1:step=2", "rank=-1 must be at least 0"),
    ("stall:step=2:seconds=soon", "seconds='soon' is not a number"),
    ("stall:step=2:seconds=-5", "seconds=-5 must be a finite non-negative number"),
    ("stall:step=2:seconds=inf", "must be a finite non-negative number"),
    ("kill:step=2:seconds=5", "seconds= applies to stall only"),
    ("kill:step=2:once=", "once= needs a file path"),
    ("kill:rank=1:step=3;stall:step=x", "'stall:step=x': step='x' is not a whole number"),  # the bad item is named
])
def test_a_malformed_fault_spec_names_the_problem(spec, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)) as e:
        faults.parse(spec)
    assert "FLASHTRAIN_FAULT" in str(e.value)


def test_fault_specs_parse():
    assert faults.parse("") == [] and faults.parse(" ; ") == []
    assert faults.parse("kill:rank=1:step=3:point=after_step; stall:step=2:seconds=0.5:once=/tmp/x") == [
        faults.Fault("kill", 1, 3, "after_step"), faults.Fault("stall", 0, 2, "step_start", 0.5, "/tmp/x")]


def test_validate_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(faults.FAULT_ENV, f"kill:step=2:once={tmp_path / 'missing' / 'fired'}")
    with pytest.raises(ConfigError, match="does not exist"):
        faults.validate_environment()
    monkeypatch.setenv(faults.FAULT_ENV, "kill:step=two")
    with pytest.raises(ConfigError, match="step='two'"):
        faults.validate_environment()
    monkeypatch.setenv(faults.FAULT_ENV, f"kill:step=2:once={tmp_path / 'fired'}")
    faults.validate_environment()
    monkeypatch.delenv(faults.FAULT_ENV)
    faults.validate_environment()


def test_inject_fires_only_where_aimed_and_once(monkeypatch, tmp_path):
    fired = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: fired.append((pid, sig)))
    monkeypatch.setattr(faults.time, "sleep", lambda s: fired.append(("sleep", s)))
    once = tmp_path / "fired"
    monkeypatch.setenv(faults.FAULT_ENV, f"kill:rank=1:step=3:point=after_step:once={once};"
                                         f"stall:rank=0:step=2:seconds=7")
    for point, step, rank in [("step_start", 3, 1), ("after_step", 2, 1), ("after_step", 3, 0),
                              ("checkpoint_write", 3, 1), ("after_step", 4, 1)]:
        faults.inject(point, step, rank)
    assert fired == [] and not once.exists()
    faults.inject("after_step", 3, 1)
    assert fired == [(os.getpid(), signal.SIGKILL)] and once.exists()
    faults.inject("after_step", 3, 1)  # once: the file exists, no second kill
    assert fired == [(os.getpid(), signal.SIGKILL)]
    faults.inject("step_start", 2, 0)  # the stall (default point step_start) fires every time
    faults.inject("step_start", 2, 0)
    assert fired[1:] == [("sleep", 7.0), ("sleep", 7.0)]
    monkeypatch.delenv(faults.FAULT_ENV)
    faults.inject("after_step", 3, 1)
    assert len(fired) == 3


def test_a_kill_fault_sigkills_the_process_once(tmp_path):
    """A real process: SIGKILLed the first time, left alone the second (the `once` file exists)."""
    once = tmp_path / "fired"
    code = "from flashtrain.train.runtime import faults; faults.inject('checkpoint_write', 4, 1); print('survived')"
    env = {**os.environ, faults.FAULT_ENV: f"kill:rank=1:step=4:point=checkpoint_write:once={once}"}
    first = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL and "survived" not in first.stdout, first.stderr[-2000:]
    assert once.exists()
    second = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert second.returncode == 0 and "survived" in second.stdout, second.stderr[-2000:]


def test_a_malformed_fault_spec_stops_the_run_at_start_up(tmp_path):
    out = warm_launch.run([sys.executable, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny",
                           f"hydra.run.dir={tmp_path / 'run'}", "logging.wandb.mode=disabled"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, faults.FAULT_ENV: "kill:rank=1:step=3:point=checkpoint_wirte"})
    assert out.returncode == 2, out.stderr[-3000:]
    assert "error: FLASHTRAIN_FAULT: 'kill:rank=1:step=3:point=checkpoint_wirte': unknown point" in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- end to end: 2 processes under torchrun ---------------------------------------------------------------
SMALL = [*fuzz.FOUR_LAYERS, *fuzz.SMALL]


def torchrun_cmd(run_dir, corpus, *overrides, launcher_args=()):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *launcher_args,
            str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", f"hydra.run.dir={run_dir}", *SMALL, *corpus,
            *overrides]


def torchrun(run_dir, corpus, *overrides, env=None, launcher_args=()):
    """Start `torchrun --nproc_per_node=2 launch/pretrain.py` (its own session); returns the Popen, output
    in <run_dir>.log."""
    cmd = torchrun_cmd(run_dir, corpus, *overrides, launcher_args=launcher_args)
    log = open(f"{run_dir}.log", "w")
    try:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**{k: v for k, v in os.environ.items() if k != faults.FAULT_ENV}, **(env or {})})
    finally:
        log.close()


def wait_watching(proc, timeout, started=None):
    """Wait for `proc`, collecting every process it starts; returns (exit status, seconds, those processes).
    The seconds count from the launch, or with `started` (a file) from when that file first has content."""
    t0, seen = time.monotonic(), set()
    t_started = None
    while proc.poll() is None:
        seen.update(fuzz.descendants(proc.pid))
        if started is not None and t_started is None and Path(started).exists() and Path(started).read_text():
            t_started = time.monotonic()
        if time.monotonic() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            for p in seen:
                if p.alive():
                    os.kill(p.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"still running after {timeout} s")
        time.sleep(fuzz.SCAN_INTERVAL_S)  # a /proc scan takes CPU from the job it watches
    return proc.returncode, time.monotonic() - (t_started or t0), seen


def metrics(run_dir):
    return fuzz.read_records(Path(run_dir) / "metrics.jsonl")[0]


def final_tensors(run_dir, step, scratch):
    state = fuzz.load_checkpoint_state(Path(run_dir) / "checkpoints" / f"step_{step:08d}", Path(scratch))
    return {f"{part}.{k}": v for part in ("model", "optim") for k, v in state[part].items()}


@pytest.mark.slow
def test_elastic_restart_resumes_and_matches_an_uninterrupted_run(tmp_path, corpus_args):  # noqa: F811
    """torchrun --max-restarts=1: rank 1 is SIGKILLed after step 3 (once); the launcher restarts both
    workers, which resume from step_2 (interval 2) -- the run directory's lock is free by then -- and the
    job exits 0 with the same final state as a run without the kill."""
    steps = ["train.max_steps=6", "train.checkpoint.interval=2", "train.checkpoint.keep=4"]
    straight = warm_launch.run(torchrun_cmd(tmp_path / "straight", corpus_args, *steps), cwd=ROOT,
                               capture_output=True, text=True, timeout=300,
                               env={k: v for k, v in os.environ.items() if k != faults.FAULT_ENV})
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    fired = tmp_path / "fired"
    run = tmp_path / "elastic"
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch 2.13's torchrun keeps one shared TCPStore across restarts,
    # and a restarted worker group can read the dead group's gloo addresses from it (connectFullMesh: connection
    # refused, or a hang until parallel.timeout_s) -- pytorch/pytorch#135712; each restart then gets a new store
    job = torchrun(run, corpus_args, *steps, "parallel.timeout_s=60", launcher_args=["--max-restarts=1"],
                   env={faults.FAULT_ENV: f"kill:rank=1:step=3:point=after_step:once={fired}",
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    rc, seconds, seen = wait_watching(job, 180)
    out = Path(f"{run}.log").read_text()
    assert rc == 0, out[-4000:]
    assert fired.exists()  # the kill happened
    assert len(seen) >= 4  # two generations of two workers
    assert fuzz.wait_dead(seen, 10) == []  # nothing left running
    # the restart resumed from the newest checkpoint: step 3 was logged, then killed before any save of it
    assert re.findall(r"resumed from (\S+) at step (\d+)", out) == [(str(run / "checkpoints" / "step_00000002"), "2")]
    # each step once (issue 30 item 12): the restart removed the lost step 3's record and logged its own
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    ref = {r["step"]: r["loss"] for r in metrics(tmp_path / "straight")}
    assert [r["loss"] for r in metrics(run)] == [ref[s] for s in (1, 2, 3, 4, 5, 6)]
    a, b = final_tensors(run, 6, tmp_path), final_tensors(tmp_path / "straight", 6, tmp_path)
    assert a.keys() == b.keys() and len(a) > 0
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    print(f"elastic restart: {seconds:.1f} s")


@pytest.mark.slow
def test_a_hung_collective_fails_the_job_naming_the_step_and_operation(tmp_path, corpus_args):  # noqa: F811
    """Rank 1 stalls at the start of step 2; rank 0's collective times out after parallel.timeout_s and the
    job fails well within a minute of step 1 with one line naming step 2 and the operation, and that no rank is
    gone (rank 1's heartbeat still moves: parallel/liveness.py); nothing is left running."""
    run = tmp_path / "hung"
    job = torchrun(run, corpus_args, "train.max_steps=4", "parallel.timeout_s=10", "parallel.peer_timeout_s=3",
                   env={faults.FAULT_ENV: "stall:rank=1:step=2:point=step_start:seconds=600"})
    # timed from step 1's record (the stall starts with step 2), not from the launch: start-up on a loaded
    # 2-core machine alone can take most of a minute
    rc, seconds, seen = wait_watching(job, 180, started=run / "metrics.jsonl")
    out = Path(f"{run}.log").read_text()
    assert rc != 0, out[-3000:]
    assert seconds < 60, f"the job took {seconds:.0f} s after step 1 to fail"
    m = re.search(r"^error: rank 0: step 2, (the [^:]+): a collective did not complete within parallel.timeout_s=10 s "
                  r"\(a rank stalled or is stuck; every rank's heartbeat still moves\); the last checkpoint is intact",
                  out, re.M)
    assert m, out[-4000:]
    assert [r["step"] for r in metrics(run)] == [1]  # step 2 never completed
    assert len(seen) >= 2 and fuzz.wait_dead(seen, 10) == []  # the stalled rank too
    print(f"hung collective: failed after {seconds:.1f} s in {m.group(1)}")


# --- the crash fuzz ------------------------------------------------------------------------------------
# The suite's round: the kinds of kill no other test makes. The other three each have their own test, which the
# suite's budget (20 minutes for CI) cannot pay twice: `worker` (one worker SIGKILLed, the restart ending bit for
# bit: test_elastic_restart_resumes_and_matches_an_uninterrupted_run), `launcher` (the workers die with it and the
# run restarts: tests/test_run_guard.py) and `ckpt_write_sync` (a kill in a synchronous write keeps the previous
# checkpoint: tests/test_trainer.py::test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one).
SUITE_KINDS = ("job", "ckpt_write_async", "ckpt_in_flight")
KILLS = len(SUITE_KINDS)  # one round: each of them once


@pytest.mark.slow
def test_crash_fuzz_every_kind_of_kill(tmp_path, corpus_args):  # noqa: F811
    """One round of the crash fuzzer over `SUITE_KINDS` (`--kinds`: whole jobs, a kill in a background checkpoint
    write, a kill with a write in flight), every restart from the newest complete checkpoint, the end
    bit-identical to an uninterrupted run, data-loader and RNG states included (--strict-state). The harness
    checks each kill; here the final state is compared once more, and the harness's own checks are shown to
    catch a difference and a damaged file. The 20-kill acceptance run over all six kinds is the fuzzer's
    default (`python launch/fuzz_restarts.py`, docs/reliability.md): the same checks over more random moments,
    too long for the suite's budget."""
    work = tmp_path / "fuzz"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "fuzz_restarts.py"), "--kills", str(KILLS),
                          "--kinds", ",".join(SUITE_KINDS), "--seed", "0", "--strict-state", "--keep-dir", str(work),
                          "--extra", *corpus_args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    kills = re.findall(rf"^kill +\d+/{KILLS} (\w+)", out.stdout, re.M)
    assert len(kills) == KILLS and set(kills) == set(SUITE_KINDS), out.stdout
    assert "VERDICT: PASS" in out.stdout
    assert len(list((work / "logs").glob("start_*.log"))) == KILLS + 1
    steps = 2 * KILLS + 10
    a = final_tensors(work / "fuzzed", steps, tmp_path)
    b = final_tensors(work / "uninterrupted", steps, tmp_path)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    # the checks are not vacuous: an earlier checkpoint differs, a flipped byte is found
    earlier = fuzz.checkpoint_steps(work / "uninterrupted")[-2]
    n, params, state = fuzz.compare_final(work / "uninterrupted" / "checkpoints" / f"step_{earlier:08d}",
                                          work / "uninterrupted" / "checkpoints" / f"step_{steps:08d}", tmp_path)
    assert len(params) > n // 2 and f"meta.step ({earlier} vs {steps})" in state
    damaged = tmp_path / "damaged"
    shutil.copytree(work / "fuzzed" / "checkpoints" / f"step_{steps:08d}", damaged)
    assert fuzz.checkpoint_damage(damaged) is None
    shard = next(p for p in sorted(damaged.iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert fuzz.checkpoint_damage(damaged) == f"{shard.name} does not match its checksum"
    print(f"crash fuzz: {seconds:.0f} s\n{out.stdout}")
