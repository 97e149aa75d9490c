"""Loss-spike detection (train/stability/spike.py): the rule on hand-computed histories, its config errors, and the
in-memory snapshots a rollback restores."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import warm_launch
from layer_plans import FOUR_LAYERS

from flashtrain.config.errors import ConfigError
from flashtrain.config.typed import typed_config
from flashtrain.train.stability.spike import Snapshots, SpikeConfig, SpikeDetector


def detector(**kw):
    return SpikeDetector(SpikeConfig(action="rollback", **kw))


def test_the_rule_on_a_hand_computed_history():
    d = detector(window=4, min_history=4, loss_sigmas=2.0, min_relative=0.0)
    for v in (1.0, 3.0, 1.0, 3.0):  # mean 2, population std 1: the threshold is 2 + 2 x 1 = 4
        assert d.reason(v, 1.0) is None
        d.accept(v, 1.0)
    assert d.reason(3.99, 1.0) is None
    assert "loss 4.01" in d.reason(4.01, 1.0)
    d.accept(3.0, 1.0)  # the window slides: [3, 1, 3, 3], mean 2.5, std sqrt(0.75) = 0.866: threshold 4.232
    assert d.reason(4.2, 1.0) is None and d.reason(4.24, 1.0) is not None


def test_min_relative_keeps_a_flat_curve_from_flagging_noise():
    d = detector(window=5, min_history=5, loss_sigmas=3.0, min_relative=0.05)
    for _ in range(5):
        d.accept(2.0, 1.0)  # std 0: without the floor any rise would be a spike
    assert d.reason(2.09, 1.0) is None  # below 2 + 0.05 x 2 = 2.1
    assert d.reason(2.11, 1.0) is not None


def test_no_verdict_before_min_history_except_non_finite_values():
    d = detector(window=10, min_history=3)
    d.accept(1.0, 1.0)
    assert d.reason(100.0, 1.0) is None  # one step of history says nothing
    assert "non-finite" in d.reason(math.nan, 1.0)
    assert "non-finite" in d.reason(1.0, math.inf)


def test_the_grad_norm_rule_only_when_set():
    quiet, watched = detector(window=3, min_history=3), detector(window=3, min_history=3, grad_norm_sigmas=1.0)
    for d in (quiet, watched):
        for g in (1.0, 1.0, 1.0):
            d.accept(2.0, g)
    assert quiet.reason(2.0, 50.0) is None
    assert "grad norm 50" in watched.reason(2.0, 50.0)


def test_state_round_trip_keeps_the_window():
    d = detector(window=3, min_history=1)
    for v in (1.0, 2.0, 3.0, 4.0):
        d.accept(v, v)
    e = detector(window=3, min_history=1)
    e.load_state_dict(d.state_dict())
    assert list(e.losses) == [2.0, 3.0, 4.0] and e.reason(100.0, 1.0) == d.reason(100.0, 1.0)
    for v in (5.0, 6.0):  # after the resume the window still slides: the last 3 steps, as without the resume
        d.accept(v, v)
        e.accept(v, v)
    assert e.state_dict() == d.state_dict() == {"losses": [4.0, 5.0, 6.0], "grad_norms": [4.0, 5.0, 6.0]}
    assert "of the last 3 steps" in e.reason(100.0, 1.0)


@pytest.mark.parametrize("field,value", [("action", "explode"), ("window", 0), ("min_history", 200),
                                         ("loss_sigmas", 0.0), ("grad_norm_sigmas", -1.0), ("snapshot_interval", 0)])
def test_bad_settings_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=f"train.spike.{field}|{field}"):
        typed_config(SpikeConfig, {field: value}, "train.spike")
    with pytest.raises(ConfigError, match="train.spike"):
        typed_config(SpikeConfig, {"sigma": 3}, "train.spike")


def test_snapshot_restores_weights_buffers_and_optimizer_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))  # a buffer, like the MoE biases
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    class Wrapped:  # the project's optimizers' snapshot interface, over torch's AdamW
        def owned_state(self):
            for p, s in opt.state.items():
                for k, v in s.items():
                    yield p, k, v, None

        def clear_state(self):
            opt.state.clear()

        def install_state(self, p, k, v):
            opt.state[p][k] = v

    def train(n):
        for _ in range(n):
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    train(2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = {(id(p), k): v.clone() for p, s in opt.state.items() for k, v in s.items()}
    snaps = Snapshots(SpikeConfig(action="rollback", rollback_steps=2, snapshot_interval=1))
    snaps.take(2, 100, model, {"adamw": Wrapped()})
    train(3)
    assert not torch.equal(model[0].weight, expected["0.weight"])
    snap = snaps.target(5)
    assert snap.step == 2 and snap.tokens_seen == 100
    for _ in range(2):  # restoring twice gives the same state: the snapshot is not trained in place
        Snapshots.restore(snap, model, {"adamw": Wrapped()})
        for k, v in model.state_dict().items():
            assert torch.equal(v, expected[k]), k
        assert {(id(p), k): v for p, s in opt.state.items() for k, v in s.items()}.keys() == expected_opt.keys()
        for p, s in opt.state.items():
            for k, v in s.items():
                assert torch.equal(v, expected_opt[(id(p), k)])
        train(1)


def test_the_rollback_target_is_at_least_rollback_steps_back():
    snaps = Snapshots(SpikeConfig(action="rollback", rollback_steps=10, snapshot_interval=5))
    model = torch.nn.Linear(2, 2)
    for step in (0, 5, 10, 15, 20, 25):
        if snaps.due(step):
            snaps.take(step, step, model, {})
    assert [s.step for s in snaps.kept] == [15, 20, 25]  # ceil(10 / 5) + 1: a spike at 26..30 needs 15 or 20
    assert snaps.target(27).step == 15  # newest with step <= 27 - 10
    assert snaps.target(35).step == 25
    assert snaps.target(12).step == 15  # none far enough back: the oldest there is


# --- the loop: skip and rollback with a spike injected (FLASHTRAIN_FAULT=spike:..., train/runtime/faults.py) ---
ROOT = Path(__file__).resolve().parent.parent
DETECT = ["train.spike.min_history=3", "train.spike.window=20", "train.spike.loss_sigmas=3",
          "train.spike.rollback_steps=2", "train.spike.snapshot_interval=2",
          "train.anticipatory_routing.delta_steps=1", "train.anticipatory_routing.active_steps=3"]


def lines(run_dir):
    return [json.loads(x, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
            for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def pretrain(run_dir, corpus, *extra, procs=1, env=None):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
                if procs > 1 else [sys.executable])
    cmd = [*launcher, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", *FOUR_LAYERS, f"hydra.run.dir={run_dir}",
           f"data.corpus_dir={corpus}", "data.corpus_text_bytes=300000", "data.corpus_mm_docs=100",
           "data.corpus_shards=2", "train.global_batch_tokens=256", "data.batch_size=1",
           "logging.wandb.mode=disabled", "logging.progress=false", "logging.heatmap_interval=0", *extra]
    return warm_launch.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_a_spike_is_rolled_back_then_routed_ahead_then_normal_on_two_processes(tmp_path):
    """Acceptance (issue 18): step 7's activations are blown up on rank 0 (its head input x 100), the
    run detects it, rolls back to step 4, trains steps 5-7 with anticipatory routing on the data after
    the spike, then normally to step 12, and ends with a normal loss."""
    run = tmp_path / "run"
    out = pretrain(run, tmp_path / "corpus", "train.max_steps=12", "train.spike.action=rollback", *DETECT, procs=2,
                   env={"FLASHTRAIN_FAULT": f"spike:rank=0:step=7:scale=100:once={tmp_path / 'fired'}"})
    assert out.returncode == 0, out.stderr[-4000:]
    records = lines(run)
    event = [r for r in records if "event" in r]
    steps = [r for r in records if "event" not in r]
    assert len(event) == 1 and event[0]["event"] == "rollback"
    assert event[0]["spike_step"] == 7 and event[0]["to_step"] == 4 and event[0]["anticipatory_routing_until"] == 7
    normal_before = [r["loss"] for r in steps[:6]]
    assert event[0]["loss"] > max(normal_before) + 1.0  # the spike really was one
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11, 12]
    assert [r["anticipatory_routing"] for r in steps] == [False] * 6 + [True] * 3 + [False] * 5
    assert all(r["spike"] is None for r in steps) and steps[-1]["rollbacks"] == 1
    # the data after the rollback is not the data before it: steps 5 and 6 trained other batches
    assert [r["loss"] for r in steps[6:8]] != normal_before[4:6]
    assert math.isfinite(steps[-1]["loss"]) and steps[-1]["loss"] < max(normal_before) + 0.05
    log = (run / "pretrain.log").read_text()
    assert "rolled back to step 4" in log


@pytest.mark.slow
def test_skip_drops_the_update_and_counts_it(tmp_path):
    """action=skip: the spiked step changes no parameter, bias or optimizer state (the checkpoint after it
    equals the one before it), is counted, and the run goes on."""
    run = tmp_path / "skip"
    out = pretrain(run, tmp_path / "corpus", "train.max_steps=7", "train.spike.action=skip", *DETECT,
                   "train.checkpoint.interval=1", "train.checkpoint.keep=10",
                   env={"FLASHTRAIN_FAULT": "spike:rank=0:step=6:scale=100"})
    assert out.returncode == 0, out.stderr[-4000:]
    steps = lines(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 7]
    assert steps[5]["spike"] is not None and "loss" in steps[5]["spike"] and steps[5]["spikes_skipped"] == 1
    assert [r["spikes_skipped"] for r in steps] == [0] * 5 + [1, 1]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    before, after = (tmp_path / "5.pt", tmp_path / "6.pt")
    dcp_to_torch_save(run / "checkpoints" / "step_00000005", before)
    dcp_to_torch_save(run / "checkpoints" / "step_00000006", after)
    a, b = torch.load(before, weights_only=False), torch.load(after, weights_only=False)
    assert set(a["model"]) == set(b["model"]) and set(a["optim"]) == set(b["optim"])
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k  # weights and the MoE biases
    for k in a["optim"]:
        assert torch.equal(torch.as_tensor(a["optim"][k]), torch.as_tensor(b["optim"][k])), k
    c = tmp_path / "7.pt"
    dcp_to_torch_save(run / "checkpoints" / "step_00000007", c)
    assert not torch.equal(torch.load(c, weights_only=False)["model"]["head.weight"], b["model"]["head.weight"])
