"""Crash fuzzing (issue 18 item 4): SIGKILL a 2-process flash_tiny run (torchrun, gloo) at random moments,
restart the same command in the same run directory after each kill until the run completes, then check
that it ends bit for bit where an uninterrupted run of the same config ends.

    python launch/fuzz_restarts.py                                   # 20 kills, seed 0
    python launch/fuzz_restarts.py --kills 40 --seed 3 --keep-dir /tmp/fuzz --extra train.checkpoint.keep=2

The run: `+exp=flash_tiny` cut to 4 layers (as tests/test_metrics.py), one 128-token sequence per rank
and step, `--steps` steps (default 2 x kills + 10), a checkpoint every `--interval` steps (default 2), on
the small embedded corpus (built once under the work directory); `--extra` adds Hydra overrides (one for a
key the harness sets replaces it). About 6 s per kill on 2 CPU cores (start-up dominates): 20 kills take
2-3 minutes, the uninterrupted reference run included.

Kills (one kind per restart, in a seeded random order that visits every kind once per round of six;
`--kinds` names the ones a round visits, e.g. `--kinds ckpt_write_sync,ckpt_write_async,ckpt_in_flight`):
- `worker`: SIGKILL of one random worker (a child of the torchrun launcher); the launcher stops the rest;
- `job`: SIGKILL of the launcher and every worker at once;
- `launcher`: SIGKILL of the launcher alone; the workers must die by themselves (PR_SET_PDEATHSIG,
  train/runtime/run_guard.py) and the run directory's lock must be free afterwards -- both checked;
- `ckpt_write_sync` / `ckpt_write_async`: a random rank SIGKILLs itself (FLASHTRAIN_FAULT,
  train/runtime/faults.py, point=checkpoint_write) while the next checkpoint is on disk with its manifest but not
  yet renamed complete, written synchronously / in the background;
- `ckpt_in_flight`: the same at point=checkpoint_in_flight, right after a background write started.
- `node` (with `--nodes N`, N >= 2: every start is N torchrun launchers with `--nnodes=N` and a c10d
  rendezvous on 127.0.0.1, --procs / N processes each, as N machines would run it): SIGKILL of one
  random node's launcher and its workers at once; the other nodes must end by themselves within
  NODE_LOSS_S, their log naming the lost node (parallel/liveness.py), or -- when the killed node hosted
  the rendezvous store -- with torchrun's own "connection to the C10d store has failed" (their launchers
  end first, taking their workers); the restart starts every node again. With --nodes the other kinds
  act on the multi-node job too (`launcher`: one node's);
- `readers` (with `--reader-kills`): the `job` kill, and the restart runs on the other number of
  processes (`--procs` <-> 1: other data-parallel readers, the "lost a node" case; data/loader.py
  `relayout`). The run then cannot end bit for bit where the uninterrupted one does (other readers pack
  other rows), so the end checks become: every step logged once with the uninterrupted run's LR and tokens,
  and, from the data trace (`data.trace=true` in both runs) and the final checkpoint's documents in flight
  against the shards' contents, every document read once -- each read document's positions emitted
  exactly once, or still in flight at the end.
The random kinds land at a uniform random time within `--window` s after the start's first step appears in
metrics.jsonl (and no later than its share of the remaining steps, so that every kill lands before the
run ends), or, for a `--startup-kills` fraction of them, at a random time between the workers' launch and
the first step (importing, taking the lock, joining the process group, loading the checkpoint).
`train.checkpoint.async_save` alternates between restarts (the targeted kinds set what they need; the
completing start writes in the background, the uninterrupted reference synchronously, so the final
comparison also shows that both write the same state).

Checked, from files and processes rather than from what the trainer prints:
- after every kill: no process of the job is left, the run directory's lock (`.job.lock`) is free, every
  `step_*` checkpoint has its checksums.json and .metadata and its files match the checksums (size and
  sha256, hashed here); a targeted kill landed on the checkpoint it was aimed at;
- every restart resumed from the newest checkpoint present when it started: its log says
  `resumed from <that directory> at step N` (nothing on a fresh start) and its first new metrics.jsonl
  record is step N + 1;
- at the end: every tensor of the final checkpoint's model and optimizer state equals (torch.equal) that of
  the uninterrupted run (those that differ are named), metrics.jsonl holds each step once (a resume
  removes the lost start's records after the resumed step) and every loss in it equals the uninterrupted
  run's loss at that step; each rank's data-loader / RNG state is compared too (a difference is named in
  a note, or fails the run with --strict-state).
One line per kill (kind, when, what the restart resumed from), a verdict; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("worker", "job", "launcher", "ckpt_write_sync", "ckpt_write_async", "ckpt_in_flight")
READERS = "readers"  # --reader-kills: a job kill whose restart has another number of processes (data readers)
NODE = "node"  # --nodes N: one node's launcher and workers SIGKILLed; the others end by themselves
RANDOM_KINDS = (*KINDS[:3], READERS, NODE)
NODE_LOSS_S = 30.0  # the other nodes end by themselves within this (parallel.peer_timeout_s below, + start-up)
# torchrun's own error when the node that hosts the c10d rendezvous store (the first to bind its port) is lost
STORE_LOST = "The connection to the C10d store has failed"
LOST_PEER = re.compile(r"^error: rank \d+: .*(?:node (\d+) on \S+ \([^)]*\) is gone|the job's store at \S+ "
                       r"(?:does not answer|has not answered))", re.M)
# flash_tiny cut to its first 4 layers with consistent layer roles (tests/test_metrics.py FOUR_LAYERS)
FOUR_LAYERS = ["model.n_layers=4", "model.compress_ratios=[0,0,2,2]", "model.kv_source_layers=[2]",
               "model.index_source_layers=[2]", "model.candidate_source_layer=2", "model.engram_layer_ids=[1]"]
SMALL = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.heatmap_interval=0",
         "train.peak_tflops.cpu=1",  # no CPU peak measurement at every start
         "parallel.timeout_s=60",  # a hung collective fails in a minute, not half an hour
         "parallel.peer_timeout_s=6",  # a lost node is named within seconds (parallel/liveness.py)
         "train.global_batch_tokens=256", "data.batch_size=1"]  # one 128-token sequence per rank and step
SMALL_CORPUS = ["data.corpus_text_bytes=300000", "data.corpus_mm_docs=100", "data.corpus_shards=2"]
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
STEP_DIR = re.compile(r"^step_(\d{8})$")
START_TIMEOUT_S = 180.0  # launch -> first step of a start (a loaded machine)
EXIT_TIMEOUT_S = 90.0  # a killed job's remaining processes gone / a targeted fault fired
# how often a start's processes are collected while it runs: the job's processes live for seconds, and a
# scan of /proc costs milliseconds of the CPU the workers need (a kill collects them once more right before)
SCAN_INTERVAL_S = 0.25


class FuzzFailure(Exception):
    """A check failed; the message says which and what was found."""


# --------------------------------------------------------------------------------------- processes
def _stat_path(path: str) -> list[str] | None:
    try:
        data = Path(path).read_text()
    except OSError:
        return None
    return data[data.rindex(")") + 2:].split()


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name: [state, ppid, ..., starttime at index 19]."""
    return _stat_path(f"/proc/{pid}/stat")


@dataclass(frozen=True)
class Proc:
    pid: int
    start: str  # /proc starttime: tells a reused pid apart

    @classmethod
    def of(cls, pid: int) -> "Proc | None":
        s = _stat(pid)
        return None if s is None else cls(pid, s[19])

    def alive(self) -> bool:
        """Running, or exiting with threads left (a killed process's leader turns zombie before its last
        thread has closed the process's files, a flock included)."""
        s = _stat(self.pid)
        if s is None or s[19] != self.start:
            return False
        if s[0] not in ("Z", "X"):
            return True
        try:
            tasks = [t.name for t in Path(f"/proc/{self.pid}/task").iterdir()]
        except OSError:
            return False
        return any((st := _stat_path(f"/proc/{self.pid}/task/{t}/stat")) is not None and st[0] not in ("Z", "X")
                   for t in tasks)


def descendants(pid: int) -> list[Proc]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (s := _stat(int(d.name))) is not None:
            children.setdefault(int(s[1]), []).append(int(d.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if (proc := Proc.of(p)) is not None:
            out.append(proc)
        todo += children.get(p, [])
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_dead(procs, timeout: float) -> list[Proc]:
    """Those of `procs` still alive after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in procs if p.alive()]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def lock_free(run_dir: Path, wait: float = 2.0) -> bool:
    """Whether another process can take the run directory's job lock (train/runtime/run_guard.py), trying for up to
    `wait` seconds (the kernel drops a dead holder's lock as its last thread exits)."""
    path = run_dir / ".job.lock"
    if not path.exists():
        return True
    deadline = time.monotonic() + wait
    with open(path, "a") as f:
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
                continue
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            return True


# ------------------------------------------------------------------------------------- checkpoints
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def checkpoint_damage(d: Path) -> str | None:
    """None when `d` has .metadata and checksums.json and its files are exactly those listed, with their
    sizes and sha256; else what is wrong (hashed here, independently of train/checkpoint.py)."""
    manifest = d / "checksums.json"
    if not manifest.is_file():
        return "no checksums.json"
    if not (d / ".metadata").is_file():
        return "no .metadata"
    try:
        listed = json.loads(manifest.read_text())
    except ValueError as e:
        return f"unreadable checksums.json ({e})"
    present = {p.name for p in d.iterdir() if p.is_file() and p.name != "checksums.json"}
    if present != set(listed):
        return f"files {sorted(present ^ set(listed))} are listed xor present"
    for name, want in listed.items():
        f = d / name
        if f.stat().st_size != want["size"] or _sha256(f) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the `step_*` directories (complete or not), ascending."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))


def verify_checkpoints(run_dir: Path) -> int | None:
    """Every step_* directory verified (FuzzFailure otherwise); returns the newest step (None: none)."""
    steps = checkpoint_steps(run_dir)
    for s in steps:
        d = run_dir / "checkpoints" / f"step_{s:08d}"
        if (problem := checkpoint_damage(d)) is not None:
            raise FuzzFailure(f"checkpoint {d} is not complete: {problem}")
    return steps[-1] if steps else None


def _diff(a, b, path: str) -> list[str]:
    """Leaf paths where two nested states (dicts, lists, tensors, numpy, scalars) differ."""
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b), key=str)
        return [d for k in keys for d in (_diff(a[k], b[k], f"{path}.{k}") if k in a and k in b else [f"{path}.{k}"])]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [path]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if type(a).__module__ == "numpy" or type(b).__module__ == "numpy":
        import numpy as np

        return [] if np.array_equal(a, b) else [path]
    return [] if a == b else [path]


def _unblob(x):
    """An entry train/checkpoint.py stores as torch.save bytes (meta, dp<r>, ...), loaded."""
    import torch

    return torch.load(io.BytesIO(x), weights_only=False) if isinstance(x, (bytes, bytearray)) else x


def load_checkpoint_state(ckpt: Path, scratch: Path) -> dict:
    """The whole DCP checkpoint as one dict (model.*, optim.*, meta, dp<r>) via dcp_to_torch_save."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{ckpt.parent.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    try:
        return torch.load(out, weights_only=False)
    finally:
        out.unlink()


def compare_final(a: Path, b: Path, scratch: Path) -> tuple[int, list[str], list[str]]:
    """(tensors compared, model / optimizer tensors that differ, other state that differs) between two
    checkpoints: every model and optimizer tensor with torch.equal (dtype and shape included); each rank's
    data-loader / RNG state (dp<r>, ...) leaf by leaf, and meta's step and tokens seen (its config may
    differ: async_save)."""
    sa, sb = load_checkpoint_state(a, scratch), load_checkpoint_state(b, scratch)
    params, n = [], 0
    for part in ("model", "optim"):
        ta, tb = sa.get(part, {}), sb.get(part, {})
        for k in sorted(set(ta) | set(tb)):
            n += 1
            params += _diff(ta.get(k), tb.get(k), f"{part}.{k}") if k in ta and k in tb else [f"{part}.{k}"]
    state = []
    for k in sorted((set(sa) | set(sb)) - {"model", "optim", "meta"}):
        state += _diff(_unblob(sa[k]), _unblob(sb[k]), k) if k in sa and k in sb else [k]
    return n, params, state + meta_differences(_unblob(sa["meta"]), _unblob(sb["meta"]))


def meta_differences(ma: dict, mb: dict) -> list[str]:
    """`meta.KEY (A vs B)` for the step and tokens seen where two checkpoints' meta differ (train/trainer.py
    stores them as `step` and `tokens_seen`; the rest of meta, the config, may differ: async_save)."""
    return [f"meta.{k} ({ma.get(k)} vs {mb.get(k)})" for k in ("step", "tokens_seen") if ma.get(k) != mb.get(k)]


# -------------------------------------------------------------------------------- the data, per document
def documents_read_once(run_dir: Path, final: Path, scratch: Path) -> tuple[list[str], int, int]:
    """(problems, documents read, trace lines): every document the final checkpoint's cursors say was read
    (all of its shard's samples in epochs before the shard's cursor epoch, the first `skip` in it) has its
    positions [0, n) covered exactly once by the data trace's pieces (data/train's `data.trace`) and the
    pieces still in flight in the final state (packing buffers, pending); none read twice, none lost,
    nothing emitted of a document not read. n is counted here from the shard (BOS + text + image spans +
    EOS), not taken from the loader."""
    from flashtrain.data.images import image_token_types
    from flashtrain.data.loader import image_grid
    from flashtrain.data.shards import ReadStats, read_shard
    from flashtrain.train.config import compose, model_config, token_spec

    ranges: dict = {}
    lines = [json.loads(x) for f in sorted((run_dir / "data_trace").glob("*.jsonl"))
             for x in f.read_text().splitlines()]
    for r in lines:
        for row in r["rows"]:
            for source, shard, key, epoch, start, end in row:
                ranges.setdefault((shard, key, epoch), []).append((start, end))
    state = load_checkpoint_state(final, scratch)
    blobs = [_unblob(state[k]) for k in sorted(state) if re.fullmatch(r"dp\d+", k)]
    cursors: dict[str, tuple[int, int]] = {}
    corpus = next((run_dir.parent / "corpus").glob("*/manifest.json")).parent
    manifest = json.loads((corpus / "manifest.json").read_text())
    shards = {name: sorted(str(corpus / e["path"]) for e in manifest[name]) for name in ("text", "mm")}
    for blob in blobs:
        data = blob["data"]
        groups = data["world"] * data["num_workers"]
        for w, gs in data["worker_states"].items():
            g = data["rank"] * data["num_workers"] + int(w)
            for name, st in gs["sources"].items():
                for shard, e, k in zip(shards[name][g::groups], st["cursors"]["epoch"], st["cursors"]["skip"]):
                    cursors[shard] = (int(e), int(k))
                for piece in st["buffer"] + st["pending"]:
                    shard, key, epoch, start, end = piece["origin"]
                    ranges.setdefault((shard, key, epoch), []).append((start, end))
    spec = token_spec(model_config(compose(["+exp=flash_tiny"])))
    problems, read, seen = [], 0, set()
    for shard, (epoch_now, skip) in sorted(cursors.items()):
        docs = list(read_shard(shard, ReadStats()))
        for epoch in range(epoch_now + 1):
            for i, doc in enumerate(docs if epoch < epoch_now else docs[:skip]):
                if doc is None:
                    continue
                n = 2 + sum(len(seg[1]) if seg[0] == "text" else len(image_token_types(*image_grid(seg[1], spec.image)))
                            for seg in doc.segments)
                got = sorted(ranges.get((shard, doc.key, epoch), []))
                seen.add((shard, doc.key, epoch))
                read += 1
                if [a for a, _ in got] != [0] + [b for _, b in got[:-1]] or not got or got[-1][1] != n:
                    problems.append(f"{shard} document {doc.key} (epoch {epoch}, {n} positions): emitted or in flight "
                                    f"{got} instead of once over [0, {n})")
    problems += [f"{k[0]} document {k[1]} (epoch {k[2]}) was emitted but its shard's cursor says it was not read"
                 for k in sorted(set(ranges) - seen)]
    return problems, read, len(lines)


# ------------------------------------------------------------------------------------------ metrics
def metrics_lines(path: Path) -> list[bytes]:
    """metrics.jsonl's complete lines (a line cut short by a kill, without its newline, is not one)."""
    return path.read_bytes().split(b"\n")[:-1] if path.exists() else []


def read_records(path: Path, before: list[bytes] | None = None) -> tuple[list[dict], list[str]]:
    """(step records, unreadable lines) of metrics.jsonl; with `before` (its lines when a start launched),
    only the lines that start wrote: those after the part of `before` the file still begins with (a resume
    removes what a start that did not reach a checkpoint wrote after the resumed step, train/metrics.py).
    Event lines (no `step`/`loss`) are skipped."""
    lines = metrics_lines(path)
    if before is not None:
        same = 0
        while same < min(len(lines), len(before)) and lines[same] == before[same]:
            same += 1
        lines = lines[same:]
    records, bad = [], []
    for raw in lines:
        try:
            r = json.loads(raw)
        except ValueError:
            bad.append(raw[:120].decode(errors="replace"))
            continue
        if isinstance(r, dict) and "step" in r and "loss" in r and "event" not in r:
            records.append(r)
    return records, bad


def metrics_verdict(ref: list[dict], got: list[dict], steps: int) -> tuple[list[str], list[str]]:
    """(failures, notes) of the fuzzed run's metrics.jsonl step records `got` against the uninterrupted run's
    `ref`, for a run of `steps` steps: the reference logs steps 1..steps; every fuzzed record's loss equals the
    reference's at its step; no step is missing (named); and no step is logged twice (the records counted)."""
    failures, notes = [], []
    loss = {r["step"]: r["loss"] for r in ref}
    if sorted(loss) != list(range(1, steps + 1)):
        failures.append(f"the uninterrupted run logged steps {sorted(loss)}")
    wrong = [(r["step"], r["loss"], loss.get(r["step"])) for r in got if r["loss"] != loss.get(r["step"])]
    missing = sorted(set(range(1, steps + 1)) - {r["step"] for r in got})
    if wrong or missing:
        failures.append(f"metrics.jsonl losses differ from the uninterrupted run at (step, fuzzed, uninterrupted) "
                        f"{wrong[:10]}; steps never logged {missing}")
    elif len(got) != steps:
        failures.append(f"metrics.jsonl holds {len(got)} step records for {steps} steps: a step is logged twice (a "
                        f"resume must remove the records of the steps it re-runs)")
    else:
        notes.append(f"metrics.jsonl: {len(got)} step records (each step once, the re-runs' after kills), every loss "
                     f"equal to the uninterrupted run's at its step")
    return failures, notes


def kill_line(killed: "Start", restart: "Start", kills: int, t0: float) -> str:
    """A kill's line: its number (from 1) of `kills`, its kind, when it landed (seconds since the fuzzer
    started at `t0`, and since its start's launch), what it hit, and what the restart resumed from."""
    return (f"kill {killed.index + 1:2d}/{kills} {killed.kind:16s} at {killed.t_kill - t0:6.1f}s "
            f"({killed.t_kill - killed.t_launch:.1f}s after launch): {killed.kill_note}; restart: "
            f"{restart.resumed_note}")


class Launchers:
    """A start's torchrun launchers -- one, or one per node (--nodes) -- with Popen's poll / wait / kill: the
    start runs while any runs; its status is the first non-zero one."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def returncode(self) -> int | None:
        codes = [p.returncode for p in self.procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def poll(self) -> int | None:
        for p in self.procs:
            p.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            p.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.returncode

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def tree(self) -> list[Proc]:
        """Every process below the launchers."""
        return [q for pid in self.pids for q in descendants(pid)]


# ---------------------------------------------------------------------------------------------- run
@dataclass
class Start:
    index: int
    kind: str | None  # None: the completing start
    async_save: bool
    expected_resume: int | None  # the newest verified checkpoint when it started
    procs: int = 2  # its torchrun --nproc_per_node
    fault: str | None = None
    aim: int | None = None  # the checkpoint step a targeted kill is aimed at
    rank: int | None = None
    log: Path | None = None
    metrics_before: list = field(default_factory=list)  # metrics.jsonl's lines at the launch
    t_launch: float = 0.0
    t_kill: float = 0.0
    kill_note: str = ""
    resumed_note: str = ""
    seen: set = field(default_factory=set)
    t_scan: float = float("-inf")  # the last collection of its processes


class Fuzzer:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.work = Path(args.keep_dir) if args.keep_dir else Path(tempfile.mkdtemp(prefix="fuzz_restarts-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.run_dir, self.ref_dir = self.work / "fuzzed", self.work / "uninterrupted"
        self.logs = self.work / "logs"
        self.logs.mkdir(exist_ok=True)
        self.failures: list[str] = []
        self.t0 = time.monotonic()
        self.startup_s: float | None = None  # the quickest launch -> first step seen so far
        self.current: tuple[subprocess.Popen, Start] | None = None  # the start running now
        self.readers_changed = False  # a `readers` kill happened: the end is checked per document, not bit for bit

    def cleanup(self) -> None:
        """After a failure mid-start: SIGKILL whatever of the job still runs."""
        if self.current is None:
            return
        launcher, start = self.current
        if launcher.poll() is None:
            start.seen.update(launcher.tree())
            launcher.kill()
        for p in start.seen:
            if p.alive():
                os.kill(p.pid, signal.SIGKILL)

    def overrides(self, run_dir: Path, async_save: bool) -> list[str]:
        a = self.args
        base = ["+exp=flash_tiny", f"hydra.run.dir={run_dir}", *FOUR_LAYERS, *SMALL, *SMALL_CORPUS,
                f"data.corpus_dir={self.work / 'corpus'}", f"train.max_steps={a.steps}",
                f"train.checkpoint.interval={a.interval}", f"train.checkpoint.async_save={str(async_save).lower()}"]
        if a.reader_kills:
            base.append("data.trace=true")
        extra_keys = {e.split("=", 1)[0].lstrip("+~") for e in a.extra}
        return [o for o in base if o.split("=", 1)[0].lstrip("+~") not in extra_keys] + list(a.extra)

    def command(self, run_dir: Path, async_save: bool, procs: int | None = None, port: int | None = None) -> list[str]:
        """One launcher's command: a standalone one, or (`port`) one of --nodes launchers, procs / nodes each."""
        procs = procs or self.args.procs
        where = ["--standalone", f"--nproc_per_node={procs}"] if port is None else [
            f"--nnodes={self.args.nodes}", f"--nproc_per_node={procs // self.args.nodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=fuzz{port}"]
        return [sys.executable, "-m", "torch.distributed.run", *where, str(ROOT / "launch" / "pretrain.py"),
                *self.overrides(run_dir, async_save)]

    def say(self, line: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {line}", flush=True)

    # --- one start ---------------------------------------------------------------------------------
    def launch(self, start: Start, run_dir: Path) -> Launchers:
        env = {k: v for k, v in os.environ.items() if k not in ("FLASHTRAIN_FAULT",)}
        if start.fault:
            env["FLASHTRAIN_FAULT"] = start.fault
        start.log = self.logs / f"start_{start.index:02d}.log"
        metrics = run_dir / "metrics.jsonl"
        start.metrics_before = metrics_lines(metrics)
        start.t_launch = time.monotonic()
        nodes = self.args.nodes if start.procs == self.args.procs else 1  # a `readers` restart: one launcher
        port = free_port() if nodes > 1 else None
        if port is not None:  # torchrun sets 1 only for more than one process per node: the reference's threads
            env.setdefault("OMP_NUM_THREADS", "1")
        with open(start.log, "w") as out:
            return Launchers([subprocess.Popen(self.command(run_dir, start.async_save, start.procs, port), cwd=ROOT,
                                               env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                              for _ in range(nodes)])

    def watch(self, launcher: Launchers, start: Start) -> None:
        """Collect the start's processes, at most every SCAN_INTERVAL_S."""
        if time.monotonic() - start.t_scan >= SCAN_INTERVAL_S:
            start.seen.update(launcher.tree())
            start.t_scan = time.monotonic()

    def new_records(self, start: Start) -> list[dict]:
        return read_records(self.run_dir / "metrics.jsonl", start.metrics_before)[0]

    def wait_first_step(self, launcher: Launchers, start: Start) -> bool:
        """Until the start's first step is in metrics.jsonl (True) or the launcher exited (False)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self.watch(launcher, start)
            if self.new_records(start):
                t = time.monotonic() - start.t_launch
                self.startup_s = t if self.startup_s is None else min(self.startup_s, t)
                return True
            if launcher.poll() is not None:
                return False
            time.sleep(0.02)
        raise FuzzFailure(f"start {start.index}: no step within {START_TIMEOUT_S:.0f} s (log {start.log})")

    def check_resume(self, start: Start, partial: bool = False) -> None:
        """The start resumed from the newest checkpoint present when it began: its log line and its first
        new metrics record (independent of the log) both say so. `partial`: killed during start-up, so the
        line may not have been written yet."""
        text = start.log.read_text(errors="replace")
        found = RESUMED.findall(text)
        want = start.expected_resume
        if partial and not found and not self.new_records(start):
            start.resumed_note = "(killed before it logged a resume or a step)"
            return
        if want is None:
            if found:
                raise FuzzFailure(f"start {start.index}: no checkpoint existed, but it says it resumed from "
                                  f"{found[0][0]} at step {found[0][1]}")
            start.resumed_note = "fresh start (no checkpoint)"
        else:
            path = self.run_dir / "checkpoints" / f"step_{want:08d}"
            if [(Path(p), int(s)) for p, s in found] != [(path, want)]:
                raise FuzzFailure(f"start {start.index}: expected 'resumed from {path} at step {want}', its log has "
                                  f"{found or 'no resume line'} (log {start.log})")
            start.resumed_note = f"resumed from step_{want:08d} (the newest complete one)"
        first = self.new_records(start)
        if first and first[0]["step"] != (want or 0) + 1:
            raise FuzzFailure(f"start {start.index}: its first metrics record is step {first[0]['step']}, "
                              f"expected {(want or 0) + 1} after resuming from {want}")

    def finish_kill(self, launcher: Launchers, start: Start) -> None:
        """After a kill: the launcher gone, then no process of the job left, the lock free, every checkpoint
        complete and verified."""
        try:
            launcher.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
            raise FuzzFailure(f"start {start.index} ({start.kind}): the launcher did not exit within "
                              f"{EXIT_TIMEOUT_S:.0f} s of the kill") from None
        self.require_gone(start.seen, 30.0, f"start {start.index} ({start.kind}): processes {{pids}} survived the "
                          f"kill for 30 s", f"start {start.index} ({start.kind}): the run directory's lock is still "
                          f"held after every process of the job died")

    def require_gone(self, procs: list, seconds: float, survived: str, locked: str | None) -> None:
        """Every process in `procs` dies within `seconds` (survivors are killed, and named in `survived`'s
        {pids}) and (`locked` given) the run directory's lock is free afterwards."""
        left = wait_dead(procs, seconds)
        if left:
            for p in left:
                os.kill(p.pid, signal.SIGKILL)
            raise FuzzFailure(survived.format(pids=[p.pid for p in left]))
        if locked is not None and not lock_free(self.run_dir):
            raise FuzzFailure(locked)

    def children(self, launcher: Launchers) -> list[Proc]:
        """The workers: the launchers' own children."""
        return [p for p in launcher.tree() if (s := _stat(p.pid)) is not None and int(s[1]) in launcher.pids]

    def random_kill(self, launcher: Launchers, start: Start, remaining: int) -> bool:
        """Kill at a random moment (during start-up, or after the first step); False if the run ended first."""
        if self.startup_s is not None and self.rng.random() < self.args.startup_kills:
            return self.startup_kill(launcher, start)
        if not self.wait_first_step(launcher, start):
            return False
        self.check_resume(start)
        first = start.expected_resume or 0
        # no later than this start's share of the remaining steps, and before the last step: the kill lands
        limit = min(first + max(self.args.interval + 1, (self.args.steps - 1 - first) // max(1, remaining)),
                    self.args.steps - 1)
        if limit <= first:
            raise FuzzFailure(f"start {start.index} resumes at step {first} of {self.args.steps}: too few steps left "
                              f"for the remaining {remaining} kill(s) (raise --steps)")
        delay = self.rng.uniform(0.0, self.args.window)
        t_first = time.monotonic()
        while True:
            self.watch(launcher, start)
            recs = self.new_records(start)
            last = recs[-1]["step"] if recs else first
            if launcher.poll() is not None:
                return False
            if time.monotonic() - t_first >= delay or last >= limit:
                break
            time.sleep(0.01)
        start.t_kill = time.monotonic()
        return self.kill(launcher, start, f"{start.t_kill - t_first:.2f} s after the start's first step (last "
                                          f"logged step {last})")

    def startup_kill(self, launcher: Launchers, start: Start) -> bool:
        """Kill once the workers exist, at a random moment before the first step is expected (while the
        workers import, take the lock, join the process group, load the checkpoint)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.children(launcher)) < start.procs:
            if launcher.poll() is not None:
                return False
            if time.monotonic() > deadline:
                raise FuzzFailure(f"start {start.index}: no {start.procs} workers within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.01)
        delay = self.rng.uniform(0.0, max(0.0, self.startup_s - (time.monotonic() - start.t_launch)))
        t0 = time.monotonic()
        while time.monotonic() - t0 < delay:
            self.watch(launcher, start)
            if launcher.poll() is not None:
                return False
            time.sleep(0.01)
        start.t_kill = time.monotonic()
        recs = self.new_records(start)
        self.check_resume(start, partial=True)
        phase = f"after its first step (last logged step {recs[-1]['step']})" if recs else "during start-up"
        return self.kill(launcher, start, f"{start.t_kill - start.t_launch:.2f} s after launch, {phase}")

    def kill(self, launcher: Launchers, start: Start, when: str) -> bool:
        workers = self.children(launcher)
        start.seen.update(launcher.tree())
        if len(workers) != start.procs:
            raise FuzzFailure(f"start {start.index}: the launcher has {len(workers)} child process(es), expected "
                              f"{start.procs} workers")
        if start.kind == "worker":
            victim = self.rng.choice(workers)
            os.kill(victim.pid, signal.SIGKILL)
            start.kill_note = f"worker pid {victim.pid} killed {when}"
        elif start.kind in ("job", READERS):
            for pid in launcher.pids:
                os.kill(pid, signal.SIGKILL)
            for w in workers:
                os.kill(w.pid, signal.SIGKILL)
            start.kill_note = f"launcher + {len(workers)} workers killed {when}" + (
                f"; the restart runs {self.other_procs(start.procs)} process(es)" if start.kind == READERS else "")
        elif start.kind == NODE:
            return self.node_kill(launcher, start, workers, when)
        else:
            victim = self.rng.choice(launcher.procs)  # (one node's, with --nodes)
            workers = [w for w in workers if (s := _stat(w.pid)) is not None and int(s[1]) == victim.pid]
            victim.kill()
            victim.wait()
            alone = len(launcher.procs) == 1  # with --nodes, the other nodes' ranks (rank 0 too) end by themselves
            self.require_gone(workers, 10.0, f"start {start.index}: workers {{pids}} outlived their SIGKILLed "
                              f"launcher by 10 s (PR_SET_PDEATHSIG)", f"start {start.index}: the run directory's "
                              f"lock is held after the launcher was killed and its workers died" if alone else None)
            start.kill_note = f"launcher alone killed {when}; its workers died by themselves, the lock is free" \
                if alone else f"node {launcher.procs.index(victim)}'s launcher alone killed {when}; its workers " \
                              f"died by themselves, the other node(s) ended, the lock is free"
        self.finish_kill(launcher, start)
        return True

    def node_kill(self, launcher: Launchers, start: Start, workers: list[Proc], when: str) -> bool:
        """SIGKILL one node (its launcher and workers at once); the other nodes must end by themselves within
        NODE_LOSS_S, a surviving rank naming the lost node."""
        index = self.rng.randrange(len(launcher.procs))
        victim = launcher.procs[index]
        mine = [w for w in workers if (s := _stat(w.pid)) is not None and int(s[1]) == victim.pid]
        victim.kill()
        for w in mine:
            os.kill(w.pid, signal.SIGKILL)
        victim.wait()
        t0 = time.monotonic()
        try:
            launcher.wait(timeout=NODE_LOSS_S)
        except subprocess.TimeoutExpired:
            raise FuzzFailure(f"start {start.index} ({NODE}): the other node(s) still ran {NODE_LOSS_S:.0f} s after "
                              f"one was killed (log {start.log})") from None
        ended = time.monotonic() - t0
        text = start.log.read_text(errors="replace")
        named = LOST_PEER.findall(text)
        if named:
            how = f"naming node {named[0]}" if named[0] else "naming the lost store (the node that hosted it)"
        elif STORE_LOST in text:  # the killed node hosted the rendezvous: the others' launchers end first
            how = "their launchers having lost the rendezvous store it hosted"
        else:
            raise FuzzFailure(f"start {start.index} ({NODE}): the surviving node ended without a line naming the "
                              f"lost one (log {start.log})")
        start.kill_note = (f"launcher {index} + its {len(mine)} worker(s) killed {when}; the other node(s) ended by "
                           f"themselves {ended:.1f} s later, {how}")
        self.finish_kill(launcher, start)
        return True

    def targeted_kill(self, launcher: Launchers, start: Start) -> bool:
        """The fault fires by itself; False if the run ended without it."""
        deadline = time.monotonic() + START_TIMEOUT_S + EXIT_TIMEOUT_S
        resume_checked = False
        while launcher.poll() is None:
            self.watch(launcher, start)
            if not resume_checked and self.new_records(start):
                self.check_resume(start)
                resume_checked = True
            if time.monotonic() > deadline:
                raise FuzzFailure(f"start {start.index}: {start.fault} did not fire within "
                                  f"{START_TIMEOUT_S + EXIT_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        if not resume_checked:
            self.check_resume(start)
        if launcher.returncode == 0:
            return False
        start.t_kill = time.monotonic()
        self.finish_kill(launcher, start)
        self.check_landing(start)
        recs = self.new_records(start)
        start.kill_note = (f"rank {start.rank} killed itself at {start.fault.split(':')[-1]} of the step_"
                           f"{start.aim:08d} checkpoint ({'async' if start.async_save else 'sync'} save), last "
                           f"logged step {recs[-1]['step'] if recs else start.expected_resume}")
        return True

    def check_landing(self, start: Start) -> None:
        """A targeted kill hit the checkpoint it was aimed at: for checkpoint_write its files and manifest
        are on disk (renamed complete only if rank 0 survived to do it); for checkpoint_in_flight it is not
        renamed complete."""
        ck = self.run_dir / "checkpoints"
        tmp, final = ck / f".tmp-step_{start.aim:08d}", ck / f"step_{start.aim:08d}"
        if start.kind == "ckpt_in_flight":
            ok = tmp.is_dir() and not final.exists()
        elif start.rank == 0:
            ok = (tmp / "checksums.json").is_file() and not final.exists()
        else:
            ok = (tmp / "checksums.json").is_file() or (final / "checksums.json").is_file()
        if not ok:
            on_disk = sorted(p.name + ("" if (p / "checksums.json").is_file() else " (no manifest)")
                             for p in ck.iterdir()) if ck.is_dir() else []
            self.failures.append(f"start {start.index}: {start.fault} should have killed rank {start.rank} while the "
                                 f"step_{start.aim:08d} checkpoint was being written, but the checkpoints directory "
                                 f"then held {on_disk}: the fault fired elsewhere")

    # --- the whole fuzz ----------------------------------------------------------------------------------
    def other_procs(self, procs: int) -> int:
        """The process count after a `readers` kill: 1 after --procs, --procs after 1."""
        return 1 if procs == self.args.procs else self.args.procs

    def plan(self) -> list[str]:
        kinds: list[str] = []
        while len(kinds) < self.args.kills:
            round_ = [*self.args.kinds, *([READERS] if self.args.reader_kills else []),
                      *([NODE] if self.args.nodes > 1 else [])]
            self.rng.shuffle(round_)
            kinds += round_
        return kinds[:self.args.kills]

    def aim(self, start: Start, kind: str) -> None:
        newest = start.expected_resume or 0
        interval, steps = self.args.interval, self.args.steps
        target = min((newest // interval + 1) * interval, steps)
        start.aim, start.rank = target, self.rng.randrange(start.procs)
        point = "checkpoint_in_flight" if kind == "ckpt_in_flight" else "checkpoint_write"
        start.async_save = kind != "ckpt_write_sync"
        start.fault = f"kill:rank={start.rank}:step={target}:point={point}"

    def reference(self) -> None:
        self.say(f"uninterrupted reference run ({self.args.steps} steps, synchronous saves) in {self.ref_dir}")
        shutil.rmtree(self.ref_dir, ignore_errors=True)
        log = self.logs / "uninterrupted.log"
        env = {k: v for k, v in os.environ.items() if k != "FLASHTRAIN_FAULT"}
        with open(log, "w") as out:
            rc = subprocess.run(self.command(self.ref_dir, False), cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, timeout=START_TIMEOUT_S + 30 * self.args.steps).returncode
        if rc != 0:
            raise FuzzFailure(f"the uninterrupted run failed (exit {rc}); log {log}:\n"
                              + log.read_text(errors="replace")[-3000:])

    def fuzz(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        kinds = self.plan()
        pending: Start | None = None  # the previous kill, reported once its restart has resumed
        async_flip = self.rng.random() < 0.5
        procs = self.args.procs
        for i in range(self.args.kills + 1):
            kind = kinds[i] if i < len(kinds) else None
            newest = verify_checkpoints(self.run_dir)
            async_flip = not async_flip
            start = Start(i, kind, async_save=True if kind is None else async_flip, expected_resume=newest,
                          procs=procs)
            if kind is not None and kind not in RANDOM_KINDS:
                if newest is not None and newest >= self.args.steps:
                    raise FuzzFailure(f"the run already has its final checkpoint before kill {i + 1} (raise --steps)")
                self.aim(start, kind)
            launcher = self.launch(start, self.run_dir)
            self.current = (launcher, start)
            if kind is None:
                self.complete(launcher, start)
            elif kind in RANDOM_KINDS:
                landed = self.random_kill(launcher, start, self.args.kills - i)
            else:
                landed = self.targeted_kill(launcher, start)
            if pending is not None:
                self.report(pending, start)
            if kind is None:
                self.say(f"start {i}: completed the run, {start.resumed_note}")
                return
            if not landed and start.fault:
                raise FuzzFailure(f"start {i}: FLASHTRAIN_FAULT={start.fault} never fired: the start ran to completion "
                                  f"(exit 0) without reaching point {start.fault.split('point=')[1]} of step "
                                  f"{start.aim} on rank {start.rank} (log {start.log})")
            if not landed:
                raise FuzzFailure(f"start {i}: the run finished before kill {i + 1} of {self.args.kills} landed "
                                  f"(raise --steps)")
            verify_checkpoints(self.run_dir)
            pending = start
            if kind == READERS:
                procs = self.other_procs(procs)
                self.readers_changed = True

    def report(self, killed: Start, restart: Start) -> None:
        print(kill_line(killed, restart, self.args.kills, self.t0), flush=True)

    def complete(self, launcher: Launchers, start: Start) -> None:
        try:
            rc = launcher.wait(timeout=START_TIMEOUT_S + 30 * self.args.steps)
        except subprocess.TimeoutExpired:
            launcher.kill()
            raise FuzzFailure(f"the completing start did not finish (log {start.log})") from None
        self.check_resume(start)
        if rc != 0:
            raise FuzzFailure(f"the completing start failed (exit {rc}); log {start.log}:\n"
                              + start.log.read_text(errors="replace")[-3000:])

    def compare(self) -> None:
        steps = self.args.steps
        final = [d / "checkpoints" / f"step_{steps:08d}" for d in (self.run_dir, self.ref_dir)]
        for d in final:
            if (problem := checkpoint_damage(d)) is not None:
                raise FuzzFailure(f"final checkpoint {d}: {problem}")
        if self.readers_changed:
            return self.compare_per_document(final[0])
        n, params, state = compare_final(*final, self.work)
        if params:
            self.failures.append(f"{len(params)} of {n} final model / optimizer tensors differ from the uninterrupted "
                                 f"run: " + ", ".join(params[:20]) + (" ..." if len(params) > 20 else ""))
        else:
            self.say(f"final checkpoint step_{steps:08d}: all {n} model / optimizer tensors equal the uninterrupted "
                     f"run's (torch.equal)")
        if state:
            line = (f"the final checkpoint's other state differs from the uninterrupted run's at "
                    f"{', '.join(state[:10])}{' ...' if len(state) > 10 else ''}")
            if self.args.strict_state:
                self.failures.append(line)
            else:
                self.say(f"NOTE: {line}; --strict-state makes this a failure")
        else:
            self.say("every rank's data-loader and RNG state equal the uninterrupted run's too")
        ref, bad_ref = read_records(self.ref_dir / "metrics.jsonl")
        got, bad = read_records(self.run_dir / "metrics.jsonl")
        failures, notes = metrics_verdict(ref, got, steps)
        self.failures += failures
        for line in notes:
            self.say(line)
        if bad or bad_ref:
            self.say(f"note: {len(bad) + len(bad_ref)} unreadable metrics.jsonl line(s) (cut by a kill): {bad[:3]}")

    def compare_per_document(self, final: Path) -> None:
        """After a change of readers: each step logged once with the uninterrupted run's LR and tokens; every
        document read once, from the data trace and the final checkpoint's documents in flight against the
        shards (`documents_read_once`)."""
        steps = self.args.steps
        ref = {r["step"]: r for r in read_records(self.ref_dir / "metrics.jsonl")[0]}
        got = read_records(self.run_dir / "metrics.jsonl")[0]
        if [r["step"] for r in got] != list(range(1, steps + 1)):
            self.failures.append(f"metrics.jsonl holds steps {[r['step'] for r in got]}, not 1..{steps} once each")
        wrong = [r["step"] for r in got if (r["lr"], r["tokens_seen"]) != (ref[r["step"]]["lr"],
                                                                            ref[r["step"]]["tokens_seen"])]
        if wrong:
            self.failures.append(f"the LR or tokens seen differ from the uninterrupted run's at steps {wrong[:10]}")
        problems, read, traced = documents_read_once(self.run_dir, final, self.work)
        self.failures += problems[:20]
        if not problems and not wrong:
            self.say(f"readers changed: metrics.jsonl holds each step once with the uninterrupted run's LR and "
                     f"tokens; {read} documents read, each once ({traced} trace lines, the final checkpoint's "
                     f"documents in flight, the shards' contents)")

    def run(self) -> int:
        a = self.args
        self.say(f"crash fuzz: {a.kills} kills, {a.steps} steps, checkpoint every {a.interval}, seed {a.seed}, "
                 f"work directory {self.work}")
        try:
            self.reference()
            self.fuzz()
            self.compare()
        except FuzzFailure as e:
            self.failures.append(str(e))
        finally:
            self.cleanup()
        if self.failures:
            print("VERDICT: FAIL\n  " + "\n  ".join(self.failures), flush=True)
        else:
            end = ("every document read once, every step once with the uninterrupted run's LR" if self.readers_changed
                   else "the run ended bit-identical to the uninterrupted one")
            print(f"VERDICT: PASS ({a.kills} kills, {time.monotonic() - self.t0:.0f} s): every restart resumed from "
                  f"the newest complete checkpoint and {end}", flush=True)
        if not a.keep_dir and not self.failures:
            shutil.rmtree(self.work, ignore_errors=True)
        elif self.failures:
            print(f"work directory kept: {self.work}", flush=True)
        return 1 if self.failures else 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch/fuzz_restarts.py", description=__doc__.split("\n\nKills")[0],
                                epilog="Its runs are +exp=flash_tiny on 4 layers; --extra adds Hydra overrides "
                                       "(key=value, keys and defaults in conf/GROUP/*.yaml).",
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs before the run may complete (default 20)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of the run (default 2 x kills + 10)")
    p.add_argument("--interval", type=int, default=2, help="train.checkpoint.interval (default 2)")
    p.add_argument("--window", type=float, default=1.0,
                   help="a random kill lands within this many seconds after the start's first step (default 1)")
    p.add_argument("--startup-kills", type=float, default=0.25,
                   help="fraction of the worker / job / launcher kills that land during start-up (default 0.25)")
    p.add_argument("--seed", type=int, default=0, help="seeds the kinds, moments and ranks of the kills (default 0)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"the kinds of kill a round visits, comma-separated (default all six: {','.join(KINDS)})")
    p.add_argument("--procs", type=int, default=2, help="torchrun --nproc_per_node (default 2)")
    p.add_argument("--keep-dir", default=None,
                   help="work directory to use and keep (default: a temporary one, removed after a pass)")
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for both runs (default none)")
    p.add_argument("--nodes", type=int, default=1,
                   help="torchrun launchers per start (--nnodes, a c10d rendezvous on 127.0.0.1), --procs / nodes "
                        "processes each; 2 or more adds the `node` kill (default 1: one --standalone launcher)")
    p.add_argument("--reader-kills", action="store_true",
                   help="add the `readers` kill: its restart runs on the other number of processes (--procs <-> 1), "
                        "and the end is checked per document and step instead of bit for bit (default off)")
    p.add_argument("--strict-state", action="store_true",
                   help="fail when the final data-loader / RNG state differs (default: a note; parameters must match)")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds or len(set(kinds)) != len(kinds):
        p.error(f"--kinds {args.kinds!r}: name each kind once, from {','.join(KINDS)}"
                + (f" ({', '.join(unknown)} is not one)" if unknown else ""))
    args.kinds = tuple(kinds)
    if args.steps is None:
        args.steps = 2 * args.kills + 10
    if args.kills < 0 or args.steps < 2 or args.interval < 1 or args.window < 0:
        p.error("--kills >= 0, --steps >= 2, --interval >= 1 and --window >= 0")
    if args.nodes < 1 or args.procs % args.nodes:
        p.error(f"--nodes={args.nodes} must be >= 1 and divide --procs={args.procs}")
    return args


def main(argv=None) -> int:
    return Fuzzer(parse_args(argv)).run()


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    sys.exit(exit_on_user_error(main))
