"""launch/bench_learning.py's reported numbers on hand-built cases (the benchmark itself is a measurement,
not a test): the dense baseline's shape and parameter count, which LR a sweep calls best and where it
extends, and the deltas and cells of the tables docs/training.md shows."""

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_learning", ROOT / "launch" / "bench_learning.py")
bench = sys.modules["bench_learning"] = importlib.util.module_from_spec(_spec)  # its dataclass looks itself up
_spec.loader.exec_module(bench)


def test_dense_shape_for_flash_tiny_by_hand():
    """vocab 512, 1,718,304 activated parameters (flash_tiny): d = 128, 4 heads of 32; a layer with the 8/3 d
    = 341 SwiGLU is 4 d^2 + 3 d 341 + 2 d = 196,736, the head and final norm 128 x 512 + 128 = 65,664, so
    round((1,718,304 - 65,664) / 196,736) = round(8.40) = 8 layers; their attention and norms take
    8 (65,536 + 256) + 65,664 = 592,000, leaving 1,126,304 / (3 x 128 x 8) = 366.6 -> 367 for the SwiGLU:
    8 x (65,536 + 140,928 + 256) + 65,664 = 1,719,424 in all -- what the module itself counts."""
    shape = bench.dense_shape(512, 1_718_304)
    assert {k: shape[k] for k in ("dim", "n_layers", "n_heads", "ffn", "params_per_token")} == {
        "dim": 128, "n_layers": 8, "n_heads": 4, "ffn": 367, "params_per_token": 1_719_424}
    model = bench.DenseDecoder(512, 128, 8, 4, 367)
    assert model.params_per_token() == 1_719_424
    small = bench.dense_shape(512, 100_000)  # less than one layer's worth: still one layer, a narrow SwiGLU
    assert small["n_layers"] == 1 and small["ffn"] == 1 and small["params_per_token"] == \
        bench.DenseDecoder(512, 128, 1, 4, 1).params_per_token()


def run(lr, *losses, failed=""):
    r = bench.Run("flashtrain", f"lr {lr:g}", [], Path("/nonexistent"), lr)
    r.evals = [{"step": 50 * (i + 1), "loss": x, "bpb": x / 2} for i, x in enumerate(losses)]
    r.failed = failed
    return r


def test_best_and_extension_of_a_sweep():
    """The lowest final loss wins, the lower LR on a tie, a failed or non-finite run never; an edge holding the
    best goes one x3 step further, a bracketed best goes nowhere."""
    runs = [run(1e-3, 5.0, 4.5), run(3e-3, 5.0, 4.2), run(1e-2, 4.0, 4.2), run(3e-2, 5.0, math.nan)]
    assert bench.best(runs).lr == 3e-3 and bench.extension(runs) is None
    assert bench.best(runs[::-1]).lr == 3e-3  # order of the list does not matter
    top = [run(1e-3, 4.6), run(3e-3, 4.5), run(1e-2, 4.1, failed="exit 1"), run(3e-2, 4.4)]
    assert bench.best(top).lr == 3e-2 and bench.extension(top) == pytest.approx(9e-2)
    bottom = [run(1e-3, 4.0), run(3e-3, 4.5), run(1e-2, math.inf)]
    assert bench.best(bottom).lr == 1e-3 and bench.extension(bottom) == pytest.approx(1e-3 / 3)
    assert bench.extension([run(1e-3, math.nan), run(3e-3, failed="exit 1")]) is None


def test_variant_deltas_and_tables_by_hand():
    """Two eval steps; flashtrain ends at 4.0 (bpb 2.0), an ablation at 4.25 (bpb 2.125): delta +0.250 /
    +0.125 at the end and +0.500 at step 50; the unigram row's delta against flashtrain; the sweep table's
    cells (the best in bold, a diverged run named, an LR a sweep did not run left empty)."""
    flash, abl = run(1e-2, 5.0, 4.0), run(1e-2, 5.5, 4.25)
    ref = bench.variant("flashtrain (lr 0.01)", flash, None, 1000, [50, 100])
    v = bench.variant("no Engram", abl, flash, 900, [50, 100])
    assert ref["delta"] == {"loss": 0.0, "bpb": 0.0}
    assert v["final"] == {"step": 100, "loss": 4.25, "bpb": 2.125} and v["delta"] == {"loss": 0.25, "bpb": 0.125}
    assert v["along"]["50"] == {"loss": 5.5, "bpb": 2.75, "delta_loss": 0.5}
    result = {"sweep": {"flashtrain": [{"lr": 3e-3, "final_loss": 4.5}, {"lr": 1e-2, "final_loss": 4.0}],
                        "dense": [{"lr": 1e-3, "final_loss": 4.75}, {"lr": 3e-3, "final_loss": math.inf}]},
              "best_lr": {"flashtrain": 1e-2, "dense": 1e-3}, "variants": [ref, v],
              "unigram": {"loss": 5.0, "bpb": 2.5}, "eval_steps": [50, 100]}
    lines = bench.tables(result).splitlines()
    assert "| flashtrain |  | 4.500 | **4.000** |" in lines
    assert "| dense | **4.750** | diverged |  |" in lines
    assert "| no Engram | 900 | 4.250 | 2.125 | +0.250 | +0.125 |" in lines
    assert "| unigram entropy of the eval tokens | | 5.000 | 2.500 | +1.000 | +0.500 |" in lines
    assert "| no Engram | 5.500 (+0.500) | 4.250 (+0.250) |" in lines
    assert "| flashtrain (lr 0.01) | 5.000 | 4.000 |" in lines


def test_unigram_reference_by_hand():
    """Two held-out rows (seq_len 6, vocab 6; token 5 is an image token): the scored targets are 1, 1, 2 of the
    first row and 1 of the second (an image target and the padding are IGNORE), so p = (3/4, 1/4) over n = 4:
    H = -(3/4 ln 3/4 + 1/4 ln 1/4) nats; with 1 byte for token 1 and 2 for token 2 the targets stand for
    3 + 2 = 5 bytes, so bpb = 4 H / (5 ln 2)."""
    from flashtrain.data.loader import Piece

    def piece(tokens, types):
        return Piece(np.array(tokens, np.int64), np.array(types, np.int64), [], 0)

    rows = [[piece([0, 1, 1], [-1] * 3), piece([2], [-1])], [piece([3, 5, 1], [-1, 0, -1])]]
    heldout = SimpleNamespace(batches=[(None, rows)], spec=None, seq_len=6)
    got = bench.unigram(heldout, np.array([0, 1, 2, 3, 4, 0]), 6)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert got["tokens"] == 4
    assert got["loss"] == pytest.approx(h, rel=1e-12) and got["bpb"] == pytest.approx(4 * h / (5 * math.log(2)))


def test_dense_eval_scores_like_the_heldout_accounting_by_hand():
    """Stand-in logits, vocab 4, token bytes (0, 2, 3, 1). Batch 1: uniform logits, targets 1, IGNORE, 0, 2 ->
    3 scored positions of CE ln 4, two of them (targets 1, 2) standing for 2 + 3 bytes. Batch 2: logit ln 3 on
    token 1, targets 1, 1 -> p = 3/6, CE ln 2 each, 2 + 2 bytes. Loss (3 ln 4 + 2 ln 2) / 5 = 8 ln 2 / 5 over
    5 tokens; bpb (2 ln 4 + 2 ln 2) / (9 ln 2) = 2/3 (token 0 has no bytes: neither its CE nor its 0 bytes)."""
    from flashtrain.data.loader import IGNORE

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(1, 4)

        def forward(self, tokens):
            out = torch.zeros(*tokens.shape, 4)
            out[..., 1] = tokens.float() * math.log(3)  # the stand-in's "token" 1 asks for a logit ln 3 on 1
            return out

    batches = [{"tokens": torch.zeros(1, 4, dtype=torch.long), "labels": torch.tensor([[1, IGNORE, 0, 2]])},
               {"tokens": torch.ones(1, 2, dtype=torch.long), "labels": torch.tensor([[1, 1]])}]
    heldout = SimpleNamespace(batches=batches, batch=lambda i: batches[i])
    model = Logits()
    got = bench.dense_eval(model, heldout, np.array([0, 2, 3, 1]))
    assert got["tokens"] == 5 and model.training
    assert got["loss"] == pytest.approx(8 * math.log(2) / 5, rel=1e-6) and got["bpb"] == pytest.approx(2 / 3)


def test_run_all_times_a_run_and_reuses_it(tmp_path, monkeypatch):
    """A run (here a stand-in that sleeps 0.3 s, then writes its eval event) is timed from start to exit, the
    time kept in bench_seconds.json; a second run_all finds it finished and reads both back without running."""
    script = ("import json, sys, time; time.sleep(0.3); open(sys.argv[1] + '/metrics.jsonl', 'w').write("
              "json.dumps({'event': 'eval', 'step': 4, 'loss': 4.5, 'bpb': 2.0}) + '\\n')")
    r = bench.Run("flashtrain", "stand-in", ["x=1"], tmp_path, 1e-3)
    monkeypatch.setattr(bench.Run, "command", lambda self: [sys.executable, "-c", script, str(self.dir)])
    bench.run_all([r], 4, 1)
    assert not r.failed and r.final == 4.5 and 0.3 <= r.seconds < 30
    kept = json.loads((r.dir / "bench_seconds.json").read_text())["seconds"]
    assert kept == r.seconds
    again = bench.Run("flashtrain", "stand-in", ["x=1"], tmp_path, 1e-3)
    monkeypatch.setattr(bench.Run, "command", lambda self: pytest.fail("a finished run was started again"))
    bench.run_all([again], 4, 1)
    assert again.seconds == kept and again.evals == r.evals
    assert not bench.Run("flashtrain", "stand-in", ["x=1"], tmp_path, 1e-3).finished(5)  # its last eval is step 4


def test_a_sweep_with_an_ablation_switch_extends_until_bracketed(tmp_path, monkeypatch):
    """The Muon ablation's own sweep: each run's overrides are the base, its LR's, then the switch (those of the
    ablation run at flashtrain's best LR, so that run is made once); 1e-3 best at the low edge -> 3.33e-4 ->
    best again at the edge -> 1.11e-4, which is worse: bracketed, no third extension."""
    finals = {1e-3: 4.0, 3e-3: 4.5, 1e-3 / 3: 3.9, 1e-3 / 9: 4.2}

    def fake_run_all(runs, steps, parallel):
        for r in runs:
            r.evals = [{"step": steps, "loss": next(v for k, v in finals.items() if math.isclose(k, r.lr)), "bpb": 1}]

    monkeypatch.setattr(bench, "run_all", fake_run_all)
    runs = bench.sweep("flashtrain", ["+exp=x"], [3e-3, 1e-3], tmp_path, 4, 1, 3, switch=("optim.matrices=adamw",),
                       label="no Muon")
    assert [r.lr for r in runs] == pytest.approx([1e-3 / 9, 1e-3 / 3, 1e-3, 3e-3])
    assert bench.best(runs).lr == pytest.approx(1e-3 / 3)
    one = runs[2]
    assert one.name == "no Muon lr 0.001" and one.overrides == [
        "+exp=x", "schedule.peak_lr=0.001", "schedule.final_lr=0.0001", "optim.matrices=adamw"]
    ablation = bench.Run("flashtrain", "no Muon (AdamW matrices)", [*one.overrides[:3], "optim.matrices=adamw"],
                         tmp_path, 1e-3)
    assert ablation.dir == one.dir
