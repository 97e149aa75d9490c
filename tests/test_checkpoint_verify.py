"""Verified checkpoints (issue 18 item 6): every checkpoint records the size and SHA-256 of its files
(`checksums.json`); loading verifies them, a damaged or partial newest checkpoint is reported and skipped
for the previous complete one; a failed save leaves the previous checkpoints untouched and says so.
Issue 18 item 7, under two gloo processes: rank 0 alone picks the checkpoint to resume from, and a
checkpoint is renamed complete only once every rank's files are confirmed in rank 0's view."""

import datetime
import errno
import hashlib
import json
import os
import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import warm_launch
from layer_plans import FOUR_LAYERS
from torch import nn

from flashtrain.train import checkpoint as ck

pytestmark = pytest.mark.xdist_group("checkpoint_verify")  # its module-scoped reference runs are shared

ROOT = Path(__file__).resolve().parent.parent


def _save(run_dir, steps):
    model = nn.Linear(64, 32)
    writer = ck.CheckpointWriter(run_dir, keep=5)
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        writer.save(step, model, {}, {"step": step}, {"data": step})
    return model


def _data_file(path):
    return sorted(p for p in Path(path).iterdir() if p.suffix == ".distcp")[0]


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    _save(tmp_path, [1])
    path = ck.step_dir(tmp_path, 1)
    listed = json.loads((path / ck.MANIFEST).read_text())
    files = sorted(p.name for p in path.iterdir() if p.name != ck.MANIFEST)
    assert sorted(listed) == files and ".metadata" in listed
    for name in files:  # independent of the module's hashing: one read of the whole file
        data = (path / name).read_bytes()
        assert listed[name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert ck.checkpoint_problem(path) is None


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous(tmp_path, damage):
    _save(tmp_path, [1, 2])
    f = _data_file(ck.step_dir(tmp_path, 2))
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
        want = f"{f.name} has {len(data) // 2} bytes, {len(data)} were written"
    else:
        data[len(data) // 3] ^= 0xFF
        f.write_bytes(bytes(data))
        want = f"{f.name} does not match its checksum"
    reports = []
    assert ck.checkpoint_problem(f.parent) == want
    assert ck.latest_verified_checkpoint(tmp_path, report=reports.append) == ck.step_dir(tmp_path, 1)
    assert len(reports) == 1 and "step_00000002 is damaged" in reports[0] and want in reports[0]
    (ck.step_dir(tmp_path, 1) / ".metadata").unlink()  # a partial older one is not complete: nothing left
    assert ck.latest_verified_checkpoint(tmp_path, report=reports.append) is None


def test_the_stage_is_chosen_from_the_checkpoint_a_resume_would_load(tmp_path):
    """The recipe picks a start's stage from its resume point's tokens before anything is built
    (train/recipe.py `resume_tokens`): a newest checkpoint with a data file deleted is read past, as the
    resume itself does, instead of stopping the start with DCP's traceback (DCP raises a BaseException)."""
    from omegaconf import OmegaConf

    from flashtrain.train.recipe import resume_tokens

    model = nn.Linear(8, 4)
    writer = ck.CheckpointWriter(tmp_path, keep=5)
    for step, tokens in ((1, 1000), (2, 3000)):
        writer.save(step, model, {}, {"step": step, "tokens_seen": tokens}, {"data": step})
    cfg = OmegaConf.create({"train": {"resume_from": None}})
    assert resume_tokens(cfg, tmp_path) == 3000.0
    _data_file(ck.step_dir(tmp_path, 2)).unlink()
    with pytest.raises(ck.CheckpointError, match=r"step_00000002 could not be read \(FileNotFoundError: .*__0_0"
                                                 r"\.distcp.*\); it is damaged or still being written"):
        ck.read_meta(ck.step_dir(tmp_path, 2))
    assert resume_tokens(cfg, tmp_path) == 1000.0
    assert resume_tokens(cfg, tmp_path / "elsewhere") == 0.0  # nothing to resume: a fresh start


def test_the_tools_refuse_a_damaged_checkpoint_as_a_resume_would(tmp_path, capsys):
    """Issue 47 item 4: launch/evaluate.py, the harness and launch/export_official.py verify the checkpoint
    they read (train/checkpoint.py `check_readable`) and refuse one whose files fail their checksums, or one
    set aside as `.damaged-*`, naming the problem, before anything is read or written; --allow-damaged turns
    the refusal into a warning. The quick form (before a process group exists) hashes `.metadata` alone and
    checks every file's size."""
    import importlib.util

    from flashtrain.train.evaluation.checkpoint import checkpoint_config

    _save(tmp_path, [1])
    path = ck.step_dir(tmp_path, 1)
    f = _data_file(path)
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0xFF
    f.write_bytes(bytes(data))
    refusal = (f"checkpoint {path} is damaged ({f.name} does not match its checksum); give an intact one (a resume "
               f"would skip this one for the previous complete checkpoint), or --allow-damaged to read it anyway")
    with pytest.raises(ck.CheckpointError) as refused:
        ck.check_readable(path)
    assert str(refused.value) == refusal
    ck.check_readable(path, quick=True)  # a data file's bytes: only the full check hashes them
    reports = []
    ck.check_readable(path, allow_damaged=True, report=reports.append)
    assert reports == [f"checkpoint {path} is damaged ({f.name} does not match its checksum); reading it anyway "
                       f"(--allow-damaged)"]

    spec = importlib.util.spec_from_file_location("export_official", ROOT / "launch" / "export_official.py")
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    with pytest.raises(ck.CheckpointError) as refused:
        export.main([str(path), str(tmp_path / "out")])
    assert str(refused.value) == refusal and not (tmp_path / "out").exists()  # nothing written
    with pytest.raises(Exception) as later:  # allowed: past the check, with a warning (this model is no release)
        export.main([str(path), str(tmp_path / "out"), "--allow-damaged"])
    assert not isinstance(later.value, ck.CheckpointError)
    assert f"warning: checkpoint {path} is damaged ({f.name} does not match its checksum)" in capsys.readouterr().err

    truncated = bytes(data[: len(data) // 2])
    f.write_bytes(truncated)  # the quick check sees a size
    with pytest.raises(ck.CheckpointError, match=rf"\({f.name} has {len(truncated)} bytes, {len(data)} were written\)"):
        checkpoint_config(str(path), [])
    meta = path / ".metadata"
    f.write_bytes(bytes(data))
    flipped = bytearray(meta.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    meta.write_bytes(bytes(flipped))
    with pytest.raises(ck.CheckpointError, match=r"\(\.metadata does not match its checksum\)"):
        checkpoint_config(str(path), [])  # before the meta is read: no unpickling error

    aside = ck.set_aside(path, "__0_0.distcp is missing")  # what a resume moved aside
    with pytest.raises(ck.CheckpointError) as refused:
        checkpoint_config(str(aside), [])
    assert str(refused.value).startswith(f"checkpoint {aside} is damaged (step_00000001 was found damaged when "
                                         f"resuming: __0_0.distcp is missing); give an intact one")
    (aside / ck.DAMAGED_NOTE).unlink()
    with pytest.raises(ck.CheckpointError, match=r"is damaged \(it was set aside as damaged\)"):
        ck.check_readable(aside)


def test_a_failed_save_keeps_the_previous_checkpoints_and_says_so(tmp_path, monkeypatch):
    model = _save(tmp_path, [1])

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck.dcp, "save", full)
    with pytest.raises(ck.CheckpointError, match=r"writing checkpoint step_00000002 .* failed \(OSError: .*No space "
                                                 r"left on device\); the previous checkpoints are untouched \(newest: "
                                                 r"step_00000001\)"):
        ck.CheckpointWriter(tmp_path, keep=1).save(2, model, {}, {"step": 2}, {"data": 2})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001"]  # no .tmp-* left
    assert ck.checkpoint_problem(ck.step_dir(tmp_path, 1)) is None


@pytest.mark.slow
def test_a_restart_continues_its_own_checkpoints_past_imported_weights(tmp_path):
    """train.resume_from names weights-only imported weights (as launch/import_official.py writes them): a fresh
    run starts from them; once the run directory holds its own checkpoints (steps 1 and 2), a restart continues
    from its newest, step 2, not from the weights at step 0. A resume_from that is a full checkpoint (another
    run's, with optimizer and data state) is loaded as named, even beside the run's own."""
    from flashtrain.train.official.dcp_parts import PartsWriter
    from flashtrain.train.resume import resume_path

    imported = tmp_path / "imported"
    writer = PartsWriter(imported)
    writer.add({"model": nn.Linear(64, 32).state_dict()})
    writer.add({"meta": ck._blob({"step": 0, "tokens_seen": 0, "weights_only": True})})
    writer.close()
    assert ck.weights_only(imported)
    run = tmp_path / "run"
    assert resume_path(str(imported), run, is_main=True) == str(imported)
    _save(run, [1, 2])
    assert Path(resume_path(str(imported), run, is_main=True)).name == "step_00000002"
    other = tmp_path / "other"
    _save(other, [5])
    full = other / "checkpoints" / "step_00000005"
    assert not ck.weights_only(full) and resume_path(str(full), run, is_main=True) == str(full)


def test_a_run_resumes_from_the_previous_checkpoint_when_the_newest_is_damaged(tmp_path):
    run = tmp_path / "run"
    base = [sys.executable, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", *FOUR_LAYERS,
            f"hydra.run.dir={run}", "logging.wandb.mode=disabled", "logging.progress=false",
            "logging.heatmap_interval=0", f"data.corpus_dir={tmp_path / 'corpus'}", "data.corpus_text_bytes=300000",
            "data.corpus_mm_docs=100", "data.corpus_shards=2",
            "train.checkpoint.interval=1", "train.global_batch_tokens=128", "data.batch_size=1"]
    first = warm_launch.run(base + ["train.max_steps=2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    f = _data_file(run / "checkpoints" / "step_00000002")
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01
    f.write_bytes(bytes(data))
    again = warm_launch.run(base + ["train.max_steps=3"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ})
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert "step_00000002 is damaged" in out and f"resumed from {run}/checkpoints/step_00000001 at step 1" in out


# ------------------------------------------------------------------------------------ two processes
DAMAGES = [("after_report", "vanish"), ("after_report", "truncate"), ("before_report", "vanish"),
           ("before_report", "truncate"), ("async", "truncate")]


def _damage(how, directory, record):
    """Rank 1: remove or halve the data file it wrote into `directory`; its name goes to `record`."""
    f = sorted(Path(directory).glob("__1_*.distcp"))[0]
    record.append(f.name)
    if how == "vanish":
        f.unlink()
    else:
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])


def _two_rank_worker(rank, store, root):
    """Every two-process scenario in one process group (one start-up for all): results to rank<r>.json,
    the checkpoints stay on disk for the tests to inspect."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    root, out = Path(root), {}
    torch.manual_seed(0)
    real_listing = ck.complete_checkpoints
    # rank 1 lists the checkpoints differently from rank 0: the newest of rank 0's listing is damaged
    run = root / "listing"
    _save(run, [1, 2, 3])
    if rank == 0:
        f = _data_file(ck.step_dir(run, 3))
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    dist.barrier()
    for case, seen in {"hidden": lambda d: real_listing(d)[:1],
                       "extra": lambda d: real_listing(d) + [ck.step_dir(run, 9)]}.items():
        if rank == 1:
            ck.complete_checkpoints = seen
        reports = []
        got = ck.latest_verified_checkpoint(run, report=reports.append)
        ck.complete_checkpoints = real_listing
        out[f"listing_{case}"] = {"got": str(got), "reports": reports}
    # a rank-1 file that is gone or shorter when rank 0 confirms: the save fails, nothing is renamed
    for where, how in DAMAGES:
        run = root / f"{where}_{how}"
        writer = ck.CheckpointWriter(run, keep=5, async_save=where == "async")
        model = nn.Linear(8, 4)
        writer.save(1, model, {}, {"step": 1}, {"data": 1})
        writer.wait()
        damaged, real_report, real_seam = [], ck._written_files, ck._before_confirm
        if rank == 1 and where == "before_report":  # before rank 1 records what it wrote
            ck._written_files = lambda d, r: (_damage(how, d, damaged), real_report(d, r))[1]
        elif rank == 1:  # after it recorded its files, before rank 0 confirms them
            ck._before_confirm = lambda d: _damage(how, d, damaged)
        try:
            writer.save(2, model, {}, {"step": 2}, {"data": 2})
            writer.wait()
            error = None
        except ck.CheckpointError as e:
            error = str(e)
        ck._written_files, ck._before_confirm = real_report, real_seam
        out[f"{where}_{how}"] = {"error": error, "damaged": damaged}
        dist.barrier()
    (root / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(_two_rank_worker, args=(str(root / "store"), str(root)), nprocs=2)
    return root, [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


def _intact(path):
    """Every file of `path` but the manifest is listed in it with its size and SHA-256 (read here)."""
    listed = json.loads((path / ck.MANIFEST).read_text())
    names = sorted(p.name for p in path.iterdir() if p.name != ck.MANIFEST)
    return sorted(listed) == names and all(
        listed[n] == {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
        for n in names for b in [(path / n).read_bytes()])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hidden", "extra"])
def test_every_rank_resumes_from_the_checkpoint_rank_0_lists(two_ranks, case):
    root, results = two_ranks
    run = root / "listing"
    step2, step3 = ck.step_dir(run, 2), ck.step_dir(run, 3)
    assert _intact(step2) and not _intact(step3)  # the newest is damaged on disk, the one before is not
    # rank 1 saw only step 1 ("hidden") or a step 9 that is not there ("extra"); both take rank 0's listing
    assert [r[f"listing_{case}"]["got"] for r in results] == [str(step2), str(step2)]
    for r in results:
        assert len(r[f"listing_{case}"]["reports"]) == 1 and "step_00000003 is damaged" in \
            r[f"listing_{case}"]["reports"][0]


@pytest.mark.parametrize("where,how", DAMAGES)
def test_a_checkpoint_is_renamed_only_once_every_ranks_files_are_confirmed(two_ranks, where, how):
    root, results = two_ranks
    run = root / f"{where}_{how}"
    [name] = results[1][f"{where}_{how}"]["damaged"]
    errors = [r[f"{where}_{how}"]["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1]  # both ranks raised, with the same message
    assert "writing checkpoint step_00000002" in errors[0] and "rank 1" in errors[0] and name in errors[0]
    assert "the previous checkpoints are untouched (newest: step_00000001)" in errors[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]  # no step_2, no .tmp-*
    first = ck.step_dir(run, 1)
    assert _intact(first)  # both ranks' files, listed from their reports
    assert {p.name for p in first.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp", ck.MANIFEST}


# ------------------------------------------------------------------ a damaged newest checkpoint, end to end


@pytest.mark.slow
def test_a_damaged_checkpoint_is_set_aside_and_each_step_is_logged_once(tmp_path):
    """Issue 30 item 12, the user's scenario: a checkpoint every 2 steps, keep 2, 3 steps (so step_2 and the
    final step_3), one .distcp of step_3 deleted, restarted with train.max_steps=4. The restart resumes from
    step_2 and sets step_3 aside (reported, a DAMAGED note inside, never counted or deleted), so after its
    step_4 the two complete checkpoints are step_2 and step_4 -- counting the damaged one toward keep would
    have deleted step_2. metrics.jsonl and the wandb run (offline files) hold each step once; wandb's value
    for the re-run step 3 is the first start's, equal to the re-run's (a resume is bit-exact)."""
    from test_metrics import settled_history, strict_lines

    run = tmp_path / "run"
    base = [sys.executable, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", f"hydra.run.dir={run}",
            "logging.wandb.mode=offline", "logging.progress=false", "logging.heatmap_interval=0",
            f"data.corpus_dir={tmp_path / 'corpus'}", "data.corpus_text_bytes=300000", "data.corpus_mm_docs=100",
            "data.corpus_shards=2", "train.checkpoint.interval=2", "train.checkpoint.keep=2",
            "train.global_batch_tokens=128", "data.batch_size=1", *FOUR_LAYERS]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    first = warm_launch.run(base + ["train.max_steps=3"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002", "step_00000003"]
    lost = _data_file(checkpoints / "step_00000003")
    lost.unlink()
    again = warm_launch.run(base + ["train.max_steps=4"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    aside = checkpoints / ".damaged-step_00000003"
    assert f"checkpoint {checkpoints / 'step_00000003'} is damaged ({lost.name} is missing); moved it aside to " \
           f"{aside}" in out
    assert f"resumed from {checkpoints / 'step_00000002'} at step 2" in out
    assert sorted(p.name for p in checkpoints.iterdir()) == [".damaged-step_00000003", "step_00000002",
                                                             "step_00000004"]
    assert all(ck.checkpoint_problem(checkpoints / n) is None for n in ("step_00000002", "step_00000004"))
    assert lost.name in (aside / ck.DAMAGED_NOTE).read_text() and not (aside / lost.name).exists()

    lines = strict_lines(run / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3, 4]  # step 3 once: the re-run's record
    assert "removed 1 step record(s) (step 3) written after step 2" in out
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    rows = [row for f in files for row in settled_history(f)[2]]
    assert [r["_step"] for r in rows] == [1, 2, 3, 4]  # the re-run's step 3 was not sent again
    assert [r["loss"] for r in rows] == [r["loss"] for r in lines]  # bit-exact resume: the same values


def test_a_damaged_checkpoint_moved_aside_never_counts_toward_keep(tmp_path):
    """keep=2 with step_2 and step_3; step_3 loses its data file. The resume's check moves it to
    .damaged-step_00000003, so the next save keeps the two
    complete ones, step_2 and step_4, and deletes nothing that is damaged. Without moving it, step_3 would
    count as one of the two and step_2, the only complete one before step_4, would be deleted."""
    model = nn.Linear(8, 4)
    writer = ck.CheckpointWriter(tmp_path, keep=2)
    for step in (1, 2, 3):
        writer.save(step, model, {}, {"step": step}, {"data": step})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
    _data_file(root / "step_00000003").unlink()
    reports = []
    assert ck.latest_verified_checkpoint(tmp_path, report=reports.append, move_damaged=True) == root / "step_00000002"
    assert len(reports) == 1 and "step_00000003 is damaged (__0_0.distcp is missing); moved it aside" in reports[0]
    writer.save(4, model, {}, {"step": 4}, {"data": 4})
    assert sorted(p.name for p in root.iterdir()) == [".damaged-step_00000003", "step_00000002", "step_00000004"]
    assert "__0_0.distcp is missing" in (root / ".damaged-step_00000003" / ck.DAMAGED_NOTE).read_text()
    # a step_* without .metadata is damaged too (a step_* exists only once complete), and a damaged step
    # whose name was set aside before gets the next free one
    writer.save(5, model, {}, {"step": 5}, {"data": 5})  # keep=2: step_4 and step_5; step_2 goes
    (root / "step_00000005" / ".metadata").unlink()
    (root / ".damaged-step_00000005").mkdir()
    assert ck.latest_verified_checkpoint(tmp_path, report=reports.append, move_damaged=True) == root / "step_00000004"
    assert sorted(p.name for p in root.iterdir()) == [".damaged-step_00000003", ".damaged-step_00000005",
                                                      ".damaged-step_00000005-2", "step_00000004"]
    assert ".metadata is missing" in reports[-1]


# ---------------------------------------------------------------------- no arbitrary unpickling on load
class _Planted:
    """A pickle that creates `marker` when unpickled (what a malicious checkpoint would do, harmlessly)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("where", ["meta blob", "dp0 blob", "dcp entry", "metadata"])
def test_a_checkpoint_carrying_a_malicious_pickle_is_refused_without_running_it(tmp_path, where):
    """A checkpoint whose state blob (meta, a rank's state), whose DCP entry around a blob, or whose DCP
    `.metadata` holds a pickled call of `open(marker, "w")`: loading it raises one-line CheckpointError
    naming the refused global, the marker file is never created, and the checksums being right (the
    checkpoint was made that way, not damaged) does not help. A genuine checkpoint still loads."""
    marker = tmp_path / "ran"
    model = nn.Linear(8, 4)
    ck.CheckpointWriter(tmp_path / "good", keep=1).save(1, model, {}, {"step": 1}, {"data": [1], "rng": None})
    good = ck.step_dir(tmp_path / "good", 1)
    path = ck.step_dir(tmp_path / "bad", 1)
    evil = _Planted(marker)
    if where == "metadata":
        ck.CheckpointWriter(tmp_path / "bad", keep=1).save(1, model, {}, {"step": 1}, {"data": 1})
        (path / ".metadata").write_bytes(pickle.dumps(evil))
    else:
        path.mkdir(parents=True)
        blob = {"meta blob": {"meta": ck._blob(evil), "dp0": ck._blob({"data": 1})},
                "dp0 blob": {"meta": ck._blob({"step": 1}), "dp0": ck._blob({"data": evil})},
                "dcp entry": {"meta": evil, "dp0": ck._blob({"data": 1})}}[where]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": model.state_dict(), "optim": {}, **blob}, checkpoint_id=str(path))
    ck.write_manifest(path)
    assert ck.checkpoint_problem(path) is None and not marker.exists()
    with pytest.raises(ck.CheckpointError) as e:
        ck.load_checkpoint(path, nn.Linear(8, 4), {})
    assert not marker.exists(), "the planted pickle ran"
    message = str(e.value)
    assert "\n" not in message and "(io.open)" in message and "refusing to load it" in message, message
    meta, mine = ck.load_checkpoint(good, nn.Linear(8, 4), {})
    assert meta == {"step": 1} and mine["data"] == [1]


def test_a_rank_keeps_its_data_position_only_when_the_reader_count_is_the_saved_one(tmp_path):
    """`load_checkpoint(dims=...)`: a checkpoint written by one data-parallel reader, loaded as reader 0 of 1
    keeps its data position; as reader 0 or 1 of 2 (another number of readers, whose positions are re-split,
    data/loader.py `relayout`) the state comes without it, though reader 0's own `dp0` state exists."""
    from types import SimpleNamespace

    ck.CheckpointWriter(tmp_path, keep=1).save(1, nn.Linear(8, 4), {}, {"step": 1}, {"data": [5], "rng": None})
    path = ck.step_dir(tmp_path, 1)
    got = {(dp, rank): ck.load_checkpoint(path, nn.Linear(8, 4), {}, SimpleNamespace(dp=dp, dp_rank=rank))[1]["data"]
           for dp, rank in ((1, 0), (2, 0), (2, 1))}
    assert got == {(1, 0): [5], (2, 0): None, (2, 1): None}
