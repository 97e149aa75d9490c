"""The job's nodes and the liveness of its ranks, piece by piece (issue 49; parallel/nodes.py,
parallel/liveness.py, train/runtime/collectives.py). The end-to-end runs on two launchers are
tests/test_multinode.py."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtrain.config.cli import exit_on_user_error
from flashtrain.config.errors import ConfigError
from flashtrain.parallel import liveness as lv
from flashtrain.parallel.nodes import NodeTable, RankPlace, check_shared_run_dir, cuda_device_index, startup_turn
from flashtrain.train.runtime import faults
from flashtrain.train.runtime.collectives import CollectiveError, Operation, any_rank, collective_error
from flashtrain.train.runtime.run_record import job_log_name

ROOT = Path(__file__).resolve().parent.parent


def table(*nodes_of_ranks):
    """A NodeTable from each rank's node number (hosts h<node>)."""
    return NodeTable([RankPlace(n, f"h{n}", i, 1000 + r) for r, (n, i) in enumerate(nodes_of_ranks)])


def test_start_up_turns_are_rank_0_then_each_nodes_first_rank_then_the_rest():
    assert [startup_turn(r, local) for r, local in [(0, 0), (1, 1), (8, 0), (9, 1), (16, 0)]] == [0, 2, 1, 2, 1]


def test_ranks_are_named_with_their_nodes():
    t = table((0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0))
    assert t.nodes() == {0: [0, 1], 1: [2, 3, 4], 2: [5]}
    assert t.describe([3, 2, 4]) == "node 1 on h1 (ranks 2-4)"
    assert t.describe([5, 0, 3]) == "node 0 on h0 (rank 0); node 1 on h1 (rank 3); node 2 on h2 (rank 5)"
    assert t.describe([2, 4]) == "node 1 on h1 (ranks 2,4)"
    assert t.summary() == "3 node(s): node 0 on h0 (ranks 0-1); node 1 on h1 (ranks 2-4); node 2 on h2 (rank 5)"


def test_a_local_rank_past_the_nodes_gpus_is_refused():
    assert cuda_device_index(7, 8) == 7
    with pytest.raises(ConfigError, match=r"^LOCAL_RANK=8 but this node \(.*\) has 8 GPU\(s\): start one process "
                                          r"per GPU \(torchrun --nproc_per_node=8, or fewer\)"):
        cuda_device_index(8, 8)


def test_each_node_keeps_its_own_job_log():
    assert [job_log_name("pretrain", n) for n in (0, 1, 12)] == ["pretrain.log", "pretrain.node1.log",
                                                                   "pretrain.node12.log"]


def test_kill_node_is_a_fault():
    [f] = faults.parse("kill_node:rank=1:step=3")
    assert (f.action, f.rank, f.step, f.point) == ("kill_node", 1, 3, "step_start")


def _shared_worker(rank, store, dirs, results):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = NodeTable([RankPlace(0, "a", 0, 1), RankPlace(1, "b", 0, 2)])
    out = {}
    for case, run_dirs in dirs.items():
        Path(run_dirs[rank]).mkdir(parents=True, exist_ok=True)
        try:
            check_shared_run_dir(run_dirs[rank], t, rank)
            out[case] = None
        except ConfigError as e:
            out[case] = str(e)
    results[rank] = out
    dist.destroy_process_group()


def test_a_run_directory_the_nodes_do_not_share_is_refused_on_every_rank(tmp_path):
    """Rank 1 looks at another directory than rank 0 (as a node without the shared filesystem would): both
    ranks refuse, naming rank 1's node; with one directory both go on; no probe file stays behind."""
    shared = str(tmp_path / "shared")
    dirs = {"shared": [shared, shared], "apart": [str(tmp_path / "a"), str(tmp_path / "b")]}
    results = mp.Manager().dict()
    mp.spawn(_shared_worker, args=(str(tmp_path / "store"), dirs, results), nprocs=2)
    assert results[0]["shared"] is None and results[1]["shared"] is None
    for rank, name in ((0, "a"), (1, "b")):  # each rank names the directory it was given
        assert results[rank]["apart"] == (
            f"run directory {tmp_path / name} is not shared by every node: node 1 on b (rank 1) cannot see what rank "
            f"0 (node 0 on a (rank 0)) writes there; every rank writes checkpoints into it: give hydra.run.dir a path "
            f"on a filesystem every node mounts at the same place (NFS, Lustre, ...)")
    assert [p.name for p in tmp_path.rglob(".node-probe-*")] == []


def _any_rank_worker(rank, store, results):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    cases = [(False, False), (False, True), (True, True), (True, False)]  # (rank 0's flag, rank 1's)
    results[rank] = [any_rank(case[rank], torch.device("cpu")) for case in cases]
    dist.destroy_process_group()


def test_the_stop_flag_is_set_on_every_rank_when_any_rank_sets_it(tmp_path):
    """`any_rank` (the loop's stop flag, train/runtime/collectives.py): none, rank 1 alone, both, rank 0 alone."""
    results = mp.Manager().dict()
    mp.spawn(_any_rank_worker, args=(str(tmp_path / "store"), results), nprocs=2)
    assert results[0] == results[1] == [False, True, True, True]


class FakeStore:
    """The three store calls Liveness makes, on a dict (counters move only when told)."""

    def __init__(self):
        self.data: dict[str, int | str] = {}
        self.broken = False

    def add(self, key, n):
        if self.broken:
            raise RuntimeError("connection reset")
        self.data[key] = int(self.data.get(key, 0)) + n
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def set(self, key, value):
        self.data[key] = value


def test_the_post_mortem_names_the_ranks_whose_heartbeat_stood_still(monkeypatch):
    store = FakeStore()
    live = lv.Liveness(store, 0, 4, peer_timeout_s=1.2, describe=lambda ranks: f"R{sorted(ranks)}")
    assert live.beat_s == pytest.approx(0.2)

    def sleep(seconds):  # during the post-mortem ranks 0 (this one, its thread) and 2 beat; 1 and 3 do not
        assert seconds == pytest.approx(0.2 * (lv.POST_MORTEM_BEATS + 1))
        store.add(live.key(0), 1)
        store.add(live.key(2), 1)

    monkeypatch.setattr(lv.time, "sleep", sleep)
    assert live.lost_ranks() == [1, 3]
    store.broken = True
    assert live.lost_ranks() is None
    assert lv.Liveness(store, 0, 2, peer_timeout_s=600).beat_s == lv.MAX_BEAT_S


def test_rank_0s_watch_ends_the_job_when_a_heartbeat_stands_still(monkeypatch):
    store, now = FakeStore(), [100.0]
    monkeypatch.setattr(lv.time, "monotonic", lambda: now[0])
    died = []
    monkeypatch.setattr(lv, "_die", lambda line: died.append(line))
    live = lv.Liveness(store, 0, 3, peer_timeout_s=6.0, describe=lambda ranks: f"R{sorted(ranks)}")
    live._watch([1, 1, 1])
    now[0] = 105.9
    live._watch([2, 1, 2])  # rank 1 has not moved for 5.9 s: not yet
    assert died == []
    now[0] = 106.0
    live._watch([3, 1, 3])  # 6 s: gone
    line = ("rank 0: R[1] is gone (its heartbeat has not moved for parallel.peer_timeout_s=6 s: the process or its "
            "node died); the last checkpoint is intact -- start every node again to resume, or the remaining nodes "
            "alone (the data position re-splits over fewer readers)")
    assert died == [line] and store.data[live.verdict_key] == line
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    end = ": the node that hosts it (the rendezvous endpoint) is gone; the last checkpoint is intact -- start every " \
          "node again to resume"
    assert live.store_gone_line() == "rank 0: the job's store at node0:29500 has not answered for " \
                                     "parallel.peer_timeout_s=6 s" + end
    assert live.store_gone_line(waited=False, named=False) == "the job's store at node0:29500 does not answer" + end


class FakeLiveness:
    world = 4

    def __init__(self, lost):
        self.lost = lost

    def lost_ranks(self):
        return self.lost

    def lost_line(self, lost, how, named=True):
        return f"{lost} gone ({how}, named={named})"

    def store_gone_line(self, waited=True, named=True):
        return f"store gone (waited={waited}, named={named})"


def test_a_failed_collective_names_the_lost_ranks_and_who_prints_it(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    op = Operation("the gradient reduction", 3)
    closed = RuntimeError("[/x/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:27350. This is typically...")
    e = collective_error(closed, op, 2, 10, FakeLiveness([0, 1]))
    assert isinstance(e, CollectiveError) and e.printed_by == 2
    assert str(e) == ("rank 2: step 3, the gradient reduction: a collective failed (Connection closed by peer "
                      "[127.0.0.1]:27350); [0, 1] gone (its heartbeat stopped, named=False)")
    e = collective_error(closed, op, 2, 10, FakeLiveness(None))
    assert e.printed_by == CollectiveError.EVERY_RANK and str(e).endswith("; store gone (waited=False, named=False)")
    e = collective_error(RuntimeError("Timed out waiting 10000ms"), op, 0, 10, FakeLiveness([]))
    assert e.printed_by is None
    assert str(e) == ("rank 0: step 3, the gradient reduction: a collective did not complete within "
                      "parallel.timeout_s=10 s (a rank stalled or is stuck; every rank's heartbeat still moves); the "
                      "last checkpoint is intact -- restart in the run directory to resume (raise parallel.timeout_s "
                      "if the step legitimately takes longer)")
    other = ValueError("not a collective")
    assert collective_error(other, op, 0, 10, FakeLiveness([1])) is other


@pytest.mark.parametrize("rank,printed_by,printed", [("2", 2, True), ("3", 2, False), ("0", 2, False),
                                                     ("0", 0, True), ("1", 0, False),
                                                     ("3", CollectiveError.EVERY_RANK, True)])
def test_a_lost_peer_is_printed_by_the_rank_it_names_alone(monkeypatch, capsys, rank, printed_by, printed):
    monkeypatch.setenv("RANK", rank)
    for name in ("FLASHTRAIN_DEBUG", "HYDRA_FULL_ERROR"):
        monkeypatch.delenv(name, raising=False)

    def fail():
        raise CollectiveError("rank 2: step 3, x: node 1 is gone", printed_by=printed_by)

    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        exit_on_user_error(fail)
    assert exit_.value.code == 2 and time.monotonic() - t0 < 5  # no wait for the launcher: the others are silent
    assert capsys.readouterr().err == ("error: rank 2: step 3, x: node 1 is gone\n" if printed else "")


@pytest.mark.slow
def test_a_frozen_peer_ends_the_job_within_the_peer_timeout(tmp_path):
    """Rank 1 freezes (SIGSTOP: sockets open, so the barrier rank 0 waits in never fails, as NCCL waits for a
    dead peer): rank 0's watch ends it, naming rank 1, within parallel.peer_timeout_s and two beats --
    not after the process group's 600 s (tests/liveness_job.py)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "liveness_job.py"), str(r), port, "2.4"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out0, err0 = procs[0].communicate(timeout=120)
        ended = time.time()
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        if procs[0].poll() is None:
            procs[0].kill()
    assert procs[0].returncode == 2, err0[-3000:]
    beating = float(out0.split("rank 0 beating at ")[1].split()[0])
    assert 2.4 <= ended - beating < 2.4 + 2 * 0.4 + 2.0, ended - beating
    assert "passed the second barrier" not in out0
    assert err0.strip().splitlines()[-1] == (
        "error: rank 0: the ranks [1] is gone (its heartbeat has not moved for parallel.peer_timeout_s=2.4 s: the "
        "process or its node died); the last checkpoint is intact -- start every node again to resume, or the "
        "remaining nodes alone (the data position re-splits over fewer readers)")


def test_each_restart_of_a_job_beats_under_its_own_keys(monkeypatch):
    """A torchrun restart is a new attempt in the same store: its counters and verdict must not be the old
    attempt's (a stale verdict would end the new attempt at once)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    keys = []
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        live = lv.Liveness(FakeStore(), rank=0, world=2, peer_timeout_s=6)
        keys.append((live.key(1), live.verdict_key))
    assert keys == [("flashtrain/liveness/job7/0/beat/1", "flashtrain/liveness/job7/0/verdict"),
                    ("flashtrain/liveness/job7/1/beat/1", "flashtrain/liveness/job7/1/verdict")]
