"""Verified checkpoints (issue 18 item 6): every checkpoint records the size and SHA-256 of its files
(`checksums.json`); loading verifies them, a damaged or partial newest checkpoint is reported and skipped
for the previous complete one; a failed save leaves the previous checkpoints untouched and says so."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from train import checkpoint as ck

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
    import hashlib

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


def test_a_run_resumes_from_the_previous_checkpoint_when_the_newest_is_damaged(tmp_path):
    run = tmp_path / "run"
    base = [sys.executable, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", f"hydra.run.dir={run}",
            "logging.wandb.mode=disabled", "logging.progress=false", f"data.corpus_dir={tmp_path / 'corpus'}",
            "data.corpus_text_bytes=300000", "data.corpus_mm_docs=100", "data.corpus_shards=2",
            "train.checkpoint.interval=1", "train.global_batch_tokens=128", "data.batch_size=1"]
    first = subprocess.run(base + ["train.max_steps=2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    f = _data_file(run / "checkpoints" / "step_00000002")
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01
    f.write_bytes(bytes(data))
    again = subprocess.run(base + ["train.max_steps=3"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ})
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert "step_00000002 is damaged" in out and f"resumed from {run}/checkpoints/step_00000001 at step 1" in out
