"""torch.compile per block (train/compile.py, `train.compile`): on the CPU, inductor's C++ backend compiles
each block's body and the loss tile, and the compiled model equals the eager one -- the loss and every
parameter gradient to fp32 rounding -- on flash_tiny's widths with two layers (SWA + Engram; Full at ratio 2
as kv / index / candidate source: the compressor, the indexer with its KL loss, the sparse attention, mHC,
the MoE), under each recomputation mode. (The Triton kernels under compile: tests/triton_interpret/
test_compiled_kernels.py.)"""

import shutil

import pytest
import torch

from flashtrain.data.loader import IGNORE
from flashtrain.model.aux import StepStats
from flashtrain.parallel.construct import model_template
from flashtrain.train import loss as loss_module
from flashtrain.train.compile import apply_compile, compile_enabled
from flashtrain.train.config import compose, model_config
from flashtrain.train.loss import tiled_lm_loss

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
