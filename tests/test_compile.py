"""torch.compile per block (train/compile.py, `train.compile`): on the CPU, inductor's C++ backend compiles
each block's body and the loss tile, and the compiled model equals the eager one -- the loss and every
parameter gradient to fp32 rounding -- on flash_tiny's widths with two layers (SWA + Engram; Full at ratio 2
as kv / index / candidate source: the compressor, the indexer with its KL loss, the sparse attention, mHC,
the MoE), under each recomputation mode. (The Triton kernels under compile: tests/triton_interpret/
test_compiled_kernels.py.) Under pp x cp x ep, compiled training equals eager training (backend
eager: dynamo's graphs), and the graph breaks at the collectives are the ones train/compile.py names."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import warm_launch

from flashtrain.data.loader import IGNORE
from flashtrain.model.aux import StepStats
from flashtrain.parallel.construct import model_template
from flashtrain.train import loss as loss_module
from flashtrain.train.compile import apply_compile, compile_enabled
from flashtrain.train.config import compose, model_config
from flashtrain.train.loss import tiled_lm_loss

ROOT = Path(__file__).resolve().parent.parent

# SWA + Engram, Full (ratio 2; kv, index and candidate source): every block kind but the Reuse / Reindex ones,
# which only read the carry (each distinct block is one more compilation: ~1-2 CPU minutes each here)
TWO_LAYERS = ["model.n_layers=2", "model.compress_ratios=[0,2]", "model.kv_source_layers=[1]",
              "model.index_source_layers=[1]", "model.candidate_source_layer=1", "model.engram_layer_ids=[0]"]
SEQ = 48
TILE = 32  # two loss tiles, the second shorter


def _step(model, recompute: str, tokens, labels):
    model.zero_grad(set_to_none=True)
    model.set_recompute(recompute)
    stats = StepStats()
    hidden = model.final_hidden(model.run(tokens, stats=stats))
    loss = tiled_lm_loss(hidden, model.head, labels, TILE)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), stats, grads


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="needs a C++ compiler")
def test_compiled_blocks_equal_eager():
    """Slow: inductor compiles two blocks' forward and backward and the loss tile (minutes of CPU).
    The compiled bodies are reused by every recomputation mode (the recomputation wraps them), so the three
    modes cost one compilation.

    Tolerance (as tests/triton_interpret/test_model_kernels.py): inductor fuses and reorders sums, and the
    mHC `base` gradients sum softmax gradients that add up to zero over a row, so they lose digits in any
    reordering (measured: 1.6e-4 of the norm for one; the loss and the others ~1e-6); each gradient in norm
    within 3e-3, all together within 1e-5; a wrong graph moves them by order one."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = model_config(compose(["+exp=flash_tiny", *TWO_LAYERS]))
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, cfg.image_token_id, (1, SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, :5] = IGNORE  # a few ignored positions: the label count is not the position count
    tokens = tokens[:, :-1]
    eager = model_template(cfg).materialize("cpu", 0)
    compiled = model_template(cfg).materialize("cpu", 0)
    try:
        assert apply_compile(compiled) == cfg.n_layers
        loss_module.compile_tile(False)  # apply_compile compiled the loss tile too: on for the compiled model only
        for recompute in ("none", "full", "selective"):
            loss_e, stats_e, grads_e = _step(eager, recompute, tokens, labels)
            loss_module.compile_tile(True)
            loss_c, stats_c, grads_c = _step(compiled, recompute, tokens, labels)
            loss_module.compile_tile(False)
            # the compiled model really ran compiled graphs: at least one per block and the loss tile
            assert counters["stats"]["unique_graphs"] >= cfg.n_layers + 1, dict(counters["stats"])
            torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=0)
            assert set(grads_c) == set(grads_e) and len(grads_e) > 20
            total = sum((grads_c[n] - g).square().sum() for n, g in grads_e.items()).sqrt()
            assert total <= 1e-5 * sum(g.square().sum() for g in grads_e.values()).sqrt(), recompute
            for name, g in grads_e.items():
                err = (grads_c[name] - g).norm() / g.norm().clamp_min(1e-30)
                assert err < 3e-3, f"{recompute}: {name}: relative difference {err:.2e}"
            assert set(stats_c.expert_load) == set(stats_e.expert_load)
            for layer, load in stats_e.expert_load.items():
                torch.testing.assert_close(stats_c.expert_load[layer], load)  # the side channel is filled once
            assert set(stats_c.indexer_loss) == set(stats_e.indexer_loss) == {1}
    finally:
        loss_module.compile_tile(False)


def test_compile_setting_resolves_per_device_type():
    defaults = {"cpu": False, "cuda": True}
    assert compile_enabled(None, "cuda", defaults) is True
    assert compile_enabled(None, "cpu", defaults) is False
    assert compile_enabled(None, "xpu", defaults) is False
    assert compile_enabled(True, "cpu", defaults) is True and compile_enabled(False, "cuda", defaults) is False
    from flashtrain.config.errors import ConfigError

    with pytest.raises(ConfigError, match="train.compile"):
        compile_enabled("yes", "cpu", defaults)


def test_backend_is_checked_and_the_report_names_each_graph_break():
    """`train.compile_backend` must name a backend of this installation (one line naming the known ones); the
    report line counts the graphs and groups the graph breaks by their first line and the function named."""
    from torch._dynamo.utils import counters

    from flashtrain.config.errors import ConfigError
    from flashtrain.train.compile import check_backend, compile_report

    check_backend("aot_eager")
    with pytest.raises(ConfigError, match=r"train.compile_backend='inductr' is not a torch.compile backend .*inductor"):
        check_backend("inductr")
    saved = {k: dict(counters[k]) for k in ("stats", "graph_break")}
    try:
        counters["stats"].clear()
        counters["graph_break"].clear()
        counters["stats"]["unique_graphs"] = 7
        counters["graph_break"]["Data dependent operator\n  Explanation: operator `aten.nonzero.default` ..."] = 1
        counters["graph_break"]["P2P compilation disabled\n  Explanation: none"] = 2
        counters["graph_break"]["Skip calling\n  Explanation: function `<function f at 0x7f00ab>` is"] = 1
        counters["graph_break"]["Data dependent operator\n  Explanation: operator `aten.nonzero.default` !"] = 3
        assert compile_report() == ("torch.compile: 7 graph(s), 7 graph break(s): 4 x Data dependent operator "
                                    "(aten.nonzero.default); 2 x P2P compilation disabled; 1 x Skip calling "
                                    "(<function f>)")
    finally:
        for k, v in saved.items():
            counters[k].clear()
            counters[k].update(v)


@pytest.mark.slow
def test_compiled_training_under_pipeline_context_and_expert_parallelism(tmp_path):
    """train.compile=true on 4 gloo processes at pp=2 x cp=2 x ep=2 (flash_tiny, 4-layer plan, text and images,
    2 steps): the pipeline boundary, the context-parallel exchanges and the expert all-to-alls around compiled
    blocks. Backend eager: dynamo's graphs, run as captured. The collectives are outside every graph (the
    breaks), so what a graph holds, and what AOTAutograd and inductor make of it, is what the test above
    checks on one process; here inductor would cost minutes per rank, AOTAutograd doubles the ~13 s of
    tracing per rank. The records equal the eager one-process run's to summation rounding (the tolerances of
    tests/test_trainer.py's layout parity), and the trainer's report names the graph breaks at the
    collectives (train/compile.py): the P2P sends of the pipeline and cp exchanges, the all-to-all split sizes
    read on the host."""
    from layer_plans import FOUR_LAYERS

    common = ["+exp=flash_tiny", *FOUR_LAYERS, f"data.corpus_dir={tmp_path / 'corpus'}",
              "data.corpus_text_bytes=400000", "data.corpus_mm_docs=50", "data.corpus_shards=4", "train.max_steps=2",
              "data.batch_size=1", "train.global_batch_tokens=256", "data.mix=[1,1]", "logging.wandb.mode=disabled",
              "logging.progress=false", "train.eval.interval=0", "train.checkpoint.interval=100"]
    runs = {"eager": ([sys.executable], []),
            "compiled": ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"],
                         ["parallel.pp=2", "parallel.cp=2", "parallel.ep=2", "train.compile=true",
                          "train.compile_backend=eager"])}
    recs, logs = {}, {}
    for name, (launcher, extra) in runs.items():
        out = warm_launch.run([*launcher, str(ROOT / "launch" / "pretrain.py"), *common, *extra,
                                f"hydra.run.dir={tmp_path / name}"], cwd=ROOT, capture_output=True, text=True,
                               timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        logs[name] = out.stdout + out.stderr
        recs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                      if '"event"' not in line]
    assert "torch.compile:" not in logs["eager"]
    report = re.search(r"torch\.compile: (\d+) graph\(s\), (\d+) graph break\(s\): (.*)", logs["compiled"])
    assert report, logs["compiled"][-3000:]
    assert int(report.group(1)) >= 3  # rank 0's two blocks and the loss tile, at least
    assert "P2P" in report.group(3) and "Data dependent operator" in report.group(3), report.group(0)
    assert [r["step"] for r in recs["compiled"]] == [1, 2]
    for x, y in zip(recs["eager"], recs["compiled"], strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6)
        assert y["balance_loss"] == pytest.approx(x["balance_loss"], rel=1e-5)
        assert y["indexer_loss"] == pytest.approx(x["indexer_loss"], rel=1e-4, abs=1e-7)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
        assert y["expert_load"] == x["expert_load"]
