"""Training you can watch (issue 32 item 4): the start-up check of every listed shard's tar index, the three
loader fields of every record, the warning for a rounded global batch, the MFU peak measured once per
machine and cached, the progress bar showing the step it just finished, and the run's last log line."""

import io
import json
import re
import shutil

import pytest
from layer_plans import FOUR_LAYERS
from test_prepare import run_prepare
from test_trainer import pretrain, records

from flashtrain.train.config import rounded_batch_note
from flashtrain.train.metrics import LoggingConfig, MetricsLogger, WandbConfig
from flashtrain.train.step_values import loader_fields


def test_loader_fields_by_hand():
    v = {"skipped_empty": 2, "skipped_bad_image": 3, "skipped_oversized_image": 5, "bad_samples": 7,
         "corrupt_shards": 11}
    assert loader_fields(v) == {"skipped_samples": 17, "skipped_images": 8, "corrupt_shards": 11}


def test_rounded_global_batch_is_named():
    assert rounded_batch_note(2048, 512) is None
    assert rounded_batch_note(2048, 100) == (
        "train.global_batch_tokens=2048 is not a whole number of data.seq_len=100 sequences: each step uses 20 "
        "sequences = 2000 tokens instead (set train.global_batch_tokens=2000 to request exactly that)")


def test_cpu_peak_is_measured_once_per_machine_and_cached(tmp_path, monkeypatch):
    from flashtrain.train import flops

    monkeypatch.setenv("FLASHTRAIN_CACHE", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return 1.25e11

    first, how = flops.cached_cpu_peak(measure)
    assert first == 1.25e11 and calls == [1] and "measured now" in how and str(tmp_path / "peak_flops.json") in how
    again, how = flops.cached_cpu_peak(measure)
    assert again == 1.25e11 and calls == [1] and "measured on this machine at" in how  # not measured again
    stored = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(stored) == [flops.machine_key()] and stored[flops.machine_key()]["flops"] == 1.25e11
    monkeypatch.setattr(flops, "machine_key", lambda: "another machine")
    assert flops.cached_cpu_peak(measure)[0] == 1.25e11 and calls == [1, 1]  # a machine of its own
    assert len(json.loads((tmp_path / "peak_flops.json").read_text())) == 2


def test_a_shards_tar_index_is_checked_from_its_headers(tmp_path):
    """data/shards.py scan_shard: a whole shard passes; cut inside a member's data, inside a header, or not
    a tar at all, it is named with what is wrong; a compressed tar is not walked (its index is not
    readable without decompressing it)."""
    import gzip

    import numpy as np

    from flashtrain.data.shards import Document, scan_shard, write_shards

    docs = [Document([("text", np.arange(3, 3 + 300 + i, dtype=np.int32))]) for i in range(6)]
    path = tmp_path / write_shards(docs, tmp_path, "text", 10)[0]["path"]
    raw = path.read_bytes()
    assert scan_shard(str(path)) is None
    member = tmp_path / "member.tar"  # the second member's header is at 1024 + 512 x ceil(first data / 512)
    member.write_bytes(raw[:2048 + 700])
    assert re.fullmatch(r"truncated: member '\S+' ends at byte \d+, past the end of the file \(2748 bytes\)",
                        scan_shard(str(member)) or ""), scan_shard(str(member))
    header = tmp_path / "header.tar"
    header.write_bytes(raw[:len(raw) - 1024 - 300])
    assert scan_shard(str(header)).startswith("truncated: ")
    (tmp_path / "text.tar").write_text("plain text, not a tar")
    assert scan_shard(str(tmp_path / "text.tar")).startswith("not readable as a tar (ReadError")
    (tmp_path / "z.tar").write_bytes(gzip.compress(raw))
    assert scan_shard(str(tmp_path / "z.tar")) is None
    assert scan_shard(str(tmp_path / "missing.tar")).startswith("not readable as a tar (FileNotFoundError")


def test_the_progress_bar_shows_the_step_it_just_finished(tmp_path):
    """Every frame the bar draws shows a step's count with that step's own loss (the postfix is set
    before the count that draws it)."""
    out = io.StringIO()
    cfg = LoggingConfig(wandb=WandbConfig(mode="disabled"), heatmap_interval=0, progress=True)
    logger = MetricsLogger(tmp_path, cfg, {}, True, 4, 0, progress_file=out)
    logger._bar.mininterval = logger._bar.miniters = 0  # draw on every update
    losses = {1: 4.5, 2: 3.25, 3: 2.125, 4: 1.0625}
    for step, loss in losses.items():
        logger.log(step, {"step": step, "loss": loss, "tokens_per_s": 100.0 * step})
    logger.close()
    frames = [f for f in re.split(r"[\r\n]", out.getvalue()) if re.search(r"\d/4", f)]
    drawn = {int(re.search(r"(\d)/4", f).group(1)): f for f in frames}
    assert set(drawn) >= {1, 2, 3, 4}, frames
    for f in frames:
        step = int(re.search(r"(\d)/4", f).group(1))
        if step:
            assert f"loss={losses[step]:.4f}" in f and f"tok_s={100 * step}" in f, f


@pytest.mark.slow
def test_a_truncated_shard_is_named_at_start_up_and_counted(tmp_path):
    """A shard list with one truncated tar: the start-up check names it before step 1, and every record
    carries corrupt_shards 1 although the one step never opens it (a 4-piece packing buffer reads one
    shard); with the other start-up and closing lines (a rounded global batch, the MFU peak's source, the
    last line)."""
    src = tmp_path / "docs.txt"
    src.write_text("".join(f"document {i}: the quick brown fox jumps over the dog {i} times\n" for i in range(400)))
    data = tmp_path / "data"
    assert run_prepare(str(data), "+exp=flash_tiny", "--text", str(src), "--lines", "--docs-per-shard", "40") == 0
    shards = sorted(data.glob("text-*.tar"))
    assert len(shards) == 10
    cut = data / "text-00099.tar"
    shutil.copy(shards[3], cut)
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2 + 100])  # inside a member
    run = tmp_path / "run"
    out = pretrain(run, [], f"data.text_shards=[{data}/text-*.tar]", "data.mm_shards=[]", "data.mix=null",
                   "data.pack_buffer=4", "train.max_steps=1", "train.eval.interval=0", "train.global_batch_tokens=500",
                   "train.peak_tflops.cpu=0.5", plan=FOUR_LAYERS)
    log = (run / "pretrain.log").read_text()
    assert re.search(rf"shard {re.escape(str(cut))}: truncated: .*; its complete samples are read", log), log[-3000:]
    assert "start-up check of the shards' tar indexes: 11 shard(s), 1 unreadable" in log
    assert "reading its complete samples only" not in log  # the step never opened it: counted at start-up
    assert log.index("start-up check") < log.index("MFU peak")  # before the first step
    got = records(run)
    assert [r["step"] for r in got] == [1]
    assert all(r["corrupt_shards"] == 1 and r["skipped_samples"] == 0 and r["skipped_images"] == 0 for r in got)
    assert all(type(r[k]) is int for r in got for k in ("corrupt_shards", "skipped_samples", "skipped_images"))
    assert ("train.global_batch_tokens=500 is not a whole number of data.seq_len=128 sequences: each step uses 4 "
            "sequences = 512 tokens instead") in log
    assert "MFU peak per device (cpu): 0.500 TFLOP/s, train.peak_tflops.cpu" in log
    last = [line for line in log.splitlines() if line.strip()][-1]
    assert re.search(rf"finished at step 1 of 1: 512 tokens seen, \d+ s wall time in this start \([0-9:]+\); "
                     rf"newest checkpoint {re.escape(str(run / 'checkpoints' / 'step_00000001'))}$", last), last
    assert out.returncode == 0
