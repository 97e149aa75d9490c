"""Metrics output: the expert-load heatmap (figure and PNG), strict-JSON metrics.jsonl, one wandb run per
run directory across restarts (offline; the run is read back from its .wandb file, no network)."""

import json
import math
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from layer_plans import FOUR_LAYERS
from test_trainer import corpus_args, pretrain  # noqa: F401 - corpus_args is a fixture used below

from flashtrain.config.errors import ConfigError
from flashtrain.train.metrics import (
    LoggingConfig,
    MetricsLogger,
    WandbConfig,
    expert_load_figure,
    finite_or_none,
    init_wandb,
    load_norm,
    read_run_id,
    relative_loads,
)


@pytest.fixture(autouse=True)
def _wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def _no_constant(name):
    raise ValueError(f"non-strict JSON constant {name}")


def strict_lines(path):
    return [json.loads(line, parse_constant=_no_constant) for line in Path(path).read_text().splitlines()]


def wandb_records(path):
    """Decode a wandb transaction log (`run-<id>.wandb`: a 7-byte ':W&B' header, then LevelDB-log
    style 32 KiB blocks of chunks [crc32 u32, length u16, type u8] + data; types full / first / middle /
    last) into wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:  # zero padding to the end of the block
            pos += left - 7 - n
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def wandb_history(path):
    """(run id, config keys, [{key: json value} per history row]) of one offline run file."""
    run_id, config, rows = None, set(), []
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
            config = {u.key for u in r.run.config.update} - {"_wandb"}
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return run_id, config, rows


def settled_history(path, seconds=30.0):
    """`wandb_history` once the file holds its run record: wandb's service process may still be writing
    the offline file for a moment after `finish()` returns on a loaded machine."""
    deadline = time.monotonic() + seconds
    while True:
        found = wandb_history(path)
        if found[0] is not None or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


# --- heatmap ---------------------------------------------------------------------------------------
LOADS = {0: torch.tensor([[2, 2, 2, 2], [0, 0, 0, 0]]), 3: torch.tensor([[4, 0, 0, 0], [1, 3, 0, 0]])}


def test_relative_loads_by_hand():
    layers, rel = relative_loads(LOADS)
    assert layers == [0, 3] and rel.shape == (2, 2, 4)
    np.testing.assert_array_equal(rel[0], [[1, 1, 1, 1], [4, 0, 0, 0]])  # text: means 2 and 1
    assert np.isnan(rel[1, 0]).all()  # image, layer 0: no image tokens
    np.testing.assert_array_equal(rel[1, 1], [1, 3, 0, 0])  # image, layer 3: mean 1


def _figure_parts(fig):
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    texts = [t.get_text() for ax in panels for t in ax.texts]
    return bars, panels, texts


def test_heatmap_without_image_tokens(tmp_path):
    loads = {0: torch.tensor([[2, 2, 2, 2], [0, 0, 0, 0]]), 1: torch.tensor([[4, 0, 0, 0], [0, 0, 0, 0]])}
    fig = expert_load_figure(loads, 7)
    bars, panels, texts = _figure_parts(fig)
    assert len(bars) == 1 and len(panels) == 2
    assert texts == ["no image tokens in this step"]
    assert len(panels[0].images) == 1 and not panels[1].images  # a note, not a solid block
    title = fig._suptitle.get_text()
    assert "step 7" in title and "text 8" in title and "image 0" in title  # 8 routed text assignments per layer
    np.testing.assert_array_equal(panels[0].images[0].get_array().filled(np.nan), [[1, 1, 1, 1], [4, 0, 0, 0]])
    fig.savefig(tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0


def test_heatmap_panels_share_one_colour_scale():
    fig = expert_load_figure(LOADS, 123)
    bars, panels, texts = _figure_parts(fig)
    assert len(bars) == 1 and not texts
    (text_im,), (image_im,) = panels[0].images, panels[1].images
    assert text_im.norm is image_im.norm and text_im.get_clim() == image_im.get_clim() == (0.0, 4.0)
    assert text_im.norm(1.0) == pytest.approx(0.5)  # balanced sits in the middle of the colour map
    np.testing.assert_array_equal(image_im.get_array().filled(-1), [[-1, -1, -1, -1], [1, 3, 0, 0]])
    title = fig._suptitle.get_text()
    assert "step 123" in title and "text 8" in title and "image 4" in title


def test_heatmaps_of_one_run_share_the_configured_scale_and_clip_above_it(tmp_path, monkeypatch):
    """The colour scale is the run's (`logging.heatmap_max_load`, 3.0 here), not each picture's largest
    load: three steps whose largest relative loads are 2.0, 3.5 and 4.0 get the same norm 0 / 1 / 3, and a
    load above 3 maps past the top, to the over colour (black), with the colour bar's arrow and the count
    and the largest named in the title. Relative loads by hand: load / the layer's mean load."""
    calm = {0: torch.tensor([[2, 1, 1, 0], [0, 0, 0, 0]])}  # text mean 1: 2, 1, 1, 0; no image tokens
    hot = {0: torch.tensor([[7, 1, 0, 0], [1, 1, 1, 1]])}  # text mean 2: 3.5, 0.5, 0, 0; image all 1
    hotter = {0: torch.tensor([[8, 0, 0, 0], [5, 3, 0, 0]])}  # text mean 2: 4, 0, 0, 0; image 2.5, 1.5, 0, 0
    seen = []
    for step, loads in ((10, calm), (20, hot), (30, hotter)):
        fig = expert_load_figure(loads, step, max_load=3.0)
        bars, panels, _ = _figure_parts(fig)
        im = panels[0].images[0]
        seen.append((bars[0]._colorbar, fig._suptitle.get_text(), im))
        assert (im.norm.vmin, im.norm.vcenter, im.norm.vmax) == (0.0, 1.0, 3.0)
        assert "scale 0-3 (logging.heatmap_max_load)" in bars[0].get_ylabel()
    assert seen[0][0].extend == "neither" and "clipped" not in seen[0][1]
    for (bar, title, _), largest in zip(seen[1:], ["3.50", "4.00"]):
        assert bar.extend == "max"
        assert title.endswith(f"\n1 load(s) above 3 drawn black (clipped), the largest {largest}")
    im = seen[1][2]
    assert im.get_array()[0, 0] == 3.5  # the value itself is kept; it is drawn in the over colour
    black = (0.0, 0.0, 0.0, 1.0)
    assert tuple(im.cmap(im.norm(3.5))) == black and tuple(im.cmap(im.norm(3.0))) != black
    assert im.norm(3.0) == 1.0 and im.norm(1.0) == 0.5 and im.norm(0.5) == pytest.approx(0.25)
    n = load_norm(4.0)
    assert (n.vmin, n.vcenter, n.vmax) == (0.0, 1.0, 4.0)
    # the logger draws with the run's configured top
    import flashtrain.train.metrics as metrics

    tops = []

    def spy(loads, step, max_load):
        tops.append(max_load)
        return expert_load_figure(loads, step, max_load)

    monkeypatch.setattr(metrics, "expert_load_figure", spy)
    cfg = LoggingConfig(wandb=WandbConfig(mode="disabled"), heatmap_interval=1, heatmap_max_load=3.0, progress=False)
    logger = MetricsLogger(tmp_path, cfg, {}, enabled=True, total_steps=2, start_step=0)
    logger.log(1, {"step": 1, "loss": 1.0}, hot)
    logger.log(2, {"step": 2, "loss": 1.0}, calm)
    logger.close()
    assert tops == [3.0, 3.0] and (tmp_path / "expert_load" / "step_00000002.png").stat().st_size > 0


@pytest.mark.parametrize("top", [1.0, 0.5, float("inf"), float("nan")])
def test_a_heatmap_scale_top_at_or_below_balanced_is_refused(top):
    with pytest.raises(ConfigError, match="logging.heatmap_max_load"):
        LoggingConfig(heatmap_max_load=top).validate()


# --- strict JSON -----------------------------------------------------------------------------------
def test_non_finite_values_are_written_as_null(tmp_path):
    assert finite_or_none({"a": [1.0, math.nan, (math.inf,)], "b": {"c": -math.inf, "d": np.float32("nan")},
                           "e": 3, "f": True, "g": "x"}) == {"a": [1.0, None, [None]], "b": {"c": None, "d": None},
                                                              "e": 3, "f": True, "g": "x"}
    cfg = LoggingConfig(wandb=WandbConfig(mode="disabled"), heatmap_interval=2, progress=False)
    logger = MetricsLogger(tmp_path, cfg, {}, enabled=True, total_steps=3, start_step=0)
    for step in (1, 2, 3):
        record = {"step": step, "loss": 1.0, "grad_norm": math.inf if step == 2 else 0.5,
                  "expert_load": {"text": {"cv": [0.1, 0.2]}, "image": {"cv": [math.nan, math.nan]}}}
        logger.log(step, record, LOADS)
    logger.close()
    lines = strict_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert lines[1]["grad_norm"] is None and lines[0]["expert_load"]["image"]["cv"] == [None, None]
    # heatmaps without wandb: the first step, every 2 steps, the last step
    assert sorted(p.name for p in (tmp_path / "expert_load").iterdir()) == [
        "step_00000001.png", "step_00000002.png", "step_00000003.png"]


def test_heatmap_steps():
    cfg = LoggingConfig(wandb=WandbConfig(mode="disabled"), heatmap_interval=50, progress=False)
    logger = MetricsLogger("/nonexistent", cfg, {}, enabled=False, total_steps=120, start_step=60)
    assert [s for s in range(61, 121) if logger.heatmap_due(s)] == [61, 100, 120]
    off = MetricsLogger("/nonexistent", LoggingConfig(heatmap_interval=0), {}, enabled=False, total_steps=9,
                        start_step=0)
    assert not any(off.heatmap_due(s) for s in range(1, 10))


# --- one wandb run per run directory ---------------------------------------------------------------
def test_run_id_is_stored_once_and_reused(tmp_path):
    cfg = WandbConfig(mode="offline", project="flashtrain-test")
    assert read_run_id(tmp_path) is None
    first = init_wandb(tmp_path, cfg, {"lr": 0.1})
    first_id = first.id
    first.finish()
    assert read_run_id(tmp_path) == first_id
    time.sleep(1.1)  # offline-run-<YYYYmmdd_HHMMSS>-<id>: a restart within the same second shares the folder
    second = init_wandb(tmp_path, cfg, {"lr": 0.2})
    assert second.id == first_id
    second.finish()
    assert (tmp_path / "wandb_run_id").read_text().strip() == first_id
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{first_id}/run-{first_id}.wandb"))
    assert len(runs) == 2
    (id1, config1, _), (id2, config2, _) = map(settled_history, runs)
    assert id1 == id2 == first_id
    assert config1 == {"lr"} and config2 == set()  # the config goes to wandb on the first start only


# --- acceptance: a run continued in its directory is one wandb run ---------------------------------
# flash_tiny cut to its first 4 layers (the layer roles made consistent), so that 2 x 4 steps take seconds
# rather than minutes on a CPU: the metrics path is the same for any depth


@pytest.mark.slow
def test_resumed_run_is_one_wandb_run_with_heatmaps(tmp_path, corpus_args):  # noqa: F811
    run = tmp_path / "run"
    args = ["logging.wandb.mode=offline", "logging.heatmap_interval=50", *FOUR_LAYERS]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    pretrain(run, corpus_args, "train.max_steps=4", *args, env=env)
    run_id = read_run_id(run)
    assert run_id
    pretrain(run, corpus_args, "train.max_steps=8", *args, env=env)
    assert read_run_id(run) == run_id

    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)  # two starts, one run id
    rows, heatmap_steps = [], []
    for f in files:
        rid, _, history = wandb_history(f)
        assert rid == run_id
        rows += history
    assert [r["_step"] for r in rows] == list(range(1, 9))
    assert all(isinstance(r["loss"], float) for r in rows)
    heatmap_steps = [r["_step"] for r in rows if r.get("expert_load/heatmap/_type") == "image-file"]
    # the first step of each start (1, and 5 after the resume), and the last step of each start (4, 8)
    assert heatmap_steps == [1, 4, 5, 8]
    assert sorted(p.name for p in (run / "expert_load").glob("*.png")) == [
        f"step_{s:08d}.png" for s in heatmap_steps]

    lines = strict_lines(run / "metrics.jsonl")
    assert [r["step"] for r in lines] == list(range(1, 9))


# --- each step once across a resume ----------------------------------------------------------------
def _log_steps(run_dir, cfg, start_step, steps, events=(), total=20):
    """A start from `start_step` logging `steps` (step, wandb step) pairs; `events`: {after index: event}."""
    logger = MetricsLogger(run_dir, cfg, {"lr": 0.1}, enabled=True, total_steps=total, start_step=start_step)
    for i, (step, wandb_step) in enumerate(steps):
        logger.log(step, {"step": step, "loss": float(step) + 0.25 * start_step}, wandb_step=wandb_step)
        for event in [e for at, e in events if at == i]:
            logger.event(event, wandb_step=event["spike_step"] + wandb_step - step)
    logger.close()


def test_a_resume_removes_the_records_after_its_step(tmp_path):
    """Steps 1-6 logged, the checkpoint at 4: a start from 4 keeps lines through step 4's record and logs 5
    and 6 again, so each step is in the file once, with the re-run's values. With a rollback in the lost
    part (records 1-5, a rollback of spike step 6 to step 3, then 4', 5') a resume from 4 keeps through the
    last record of step 4 -- the re-run 4', written after the rollback event, whose checkpoint replaced the
    first step 4's -- and drops 5' alone. A fresh start (0) keeps nothing; a line cut short by a kill goes."""
    cfg = LoggingConfig(wandb=WandbConfig(mode="disabled"), heatmap_interval=0, progress=False)
    _log_steps(tmp_path, cfg, 0, [(s, s) for s in range(1, 7)])
    _log_steps(tmp_path, cfg, 4, [(5, 5), (6, 6)])
    lines = strict_lines(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 6.0), (6, 7.0)]

    run = tmp_path / "rollback"
    run.mkdir()
    rollback = {"event": "rollback", "spike_step": 6, "to_step": 3}
    _log_steps(run, cfg, 0, [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (4, 7), (5, 8)], events=[(4, rollback)])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a kill in the middle of a line
    _log_steps(run, cfg, 4, [(5, 8)])
    lines = strict_lines(run / "metrics.jsonl")
    assert [r.get("step", r.get("event")) for r in lines] == [1, 2, 3, 4, 5, "rollback", 4, 5]
    assert lines[-1]["loss"] == 6.0  # the re-run's 5' (loss 5 + 0.25 x 4), not the lost one's
    _log_steps(run, cfg, 0, [(1, 1)])
    assert [r["step"] for r in strict_lines(run / "metrics.jsonl")] == [1]


def test_wandb_receives_each_step_once_across_a_resume(tmp_path):
    """Offline wandb: the first start sends steps 1-3; a start from step 1 re-runs 2 and 3 and sends only 4:
    the run's history, read back from its two .wandb files, has each step once, and metrics.jsonl agrees on
    the steps."""
    cfg = LoggingConfig(wandb=WandbConfig(mode="offline"), heatmap_interval=0, progress=False)
    _log_steps(tmp_path, cfg, 0, [(1, 1), (2, 2), (3, 3)])
    _log_steps(tmp_path, cfg, 1, [(2, 2), (3, 3), (4, 4)])
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    rows = [row for f in files for row in settled_history(f)[2]]
    assert [r["_step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == [1.0, 2.0, 3.0, 4.25]  # the first start's 1-3, the resume's 4
    assert [r["step"] for r in strict_lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
