"""Quantisation-aware training (model.qat, issue 16 (5)): with a switch on, the tensor the public inference
kernels store quantised is, in the forward, exactly on that format's grid -- checked here from the
definitions (an E2M1 value times a per-block scale that is an E4M3 number / a power of two; FP8 E4M3
codes times a power of two) -- and gradients pass straight through. Off by default."""

import dataclasses

import pytest
import torch

from flashtrain.config.errors import ConfigError
from flashtrain.config.typed import typed_config
from flashtrain.model import attention as attention_module
from flashtrain.model.attention import Attention, SharedKV
from flashtrain.model.config import ModelConfig, QATConfig
from flashtrain.model.layer_plan import layer_plan

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@pytest.fixture
def qat_cfg(tiny_cfg):
    return dataclasses.replace(tiny_cfg, index_head_dim=32,
                               qat=QATConfig(indexer_fp4=True, compressed_kv_fp4=True, window_kv_fp8=True))


def test_off_by_default(tiny_cfg):
    assert ModelConfig().qat == QATConfig() and not any(dataclasses.asdict(QATConfig()).values())
    assert tiny_cfg.qat == QATConfig()


def test_widths_the_formats_cannot_hold_are_refused(tiny_cfg):
    with pytest.raises(ConfigError, match=r"model.qat.indexer_fp4=true needs model.index_head_dim \(=16\) to be a "
                                          r"multiple of 32"):
        dataclasses.replace(tiny_cfg, qat=QATConfig(indexer_fp4=True)).validate()
    with pytest.raises(ConfigError, match="unknown field.*'fp4_kv'"):
        typed_config(ModelConfig, {"qat": {"fp4_kv": True}}, "model")


def test_compressed_kv_and_index_keys_lie_on_their_grids(qat_cfg):
    """Layer 2 (Full, ratio 2): the published compressed KV is E2M1 x an E4M3 scale per 16 channels, the index
    keys E2M1 x a power of two per 32; with QAT off neither is (random floats are not)."""
    plan = layer_plan(qat_cfg)
    for on in (True, False):
        cfg = qat_cfg if on else dataclasses.replace(qat_cfg, qat=QATConfig())
        torch.manual_seed(0)
        attn = Attention(cfg, plan[2])
        shared = SharedKV()
        attn(torch.randn(1, 32, cfg.dim), shared)
        kv, k = shared.kv, shared.index_k
        got_kv = _grid_check(kv, 16, "e4m3")
        got_k = _grid_check(k, 32, "pow2")
        assert got_kv == on and got_k == on


def _grid_check(x, block, kind):
    """Literal, per block: the block's largest |value| is m * s for a grid value m, s is an E4M3 number / a
    power of two, and every value / s is on the E2M1 grid. An E4M3 scale is amax / 6 rounded to E4M3 (2^-4
    relative), so the maximum always lands on 6; a power-of-two scale 2^ceil(log2(amax / 6)) puts it in
    (3, 6]: on 3, 4 or 6."""
    g = x.detach().float().unflatten(-1, (-1, block))
    amax = g.abs().amax(-1, keepdim=True)
    ok = amax == 0
    for m in ((6.0,) if kind == "e4m3" else (3.0, 4.0, 6.0)):
        s = amax / m
        fits = (s == s.to(torch.float8_e4m3fn).float()) if kind == "e4m3" else (s == torch.exp2(torch.log2(s).round()))
        on_grid = (((g / s).abs().unsqueeze(-1) - E2M1).abs().amin(-1) < 1e-5).all(-1, keepdim=True)
        ok = ok | (fits & on_grid)
    return bool(ok.all())


def test_window_kv_is_fake_quantised_in_fp8_and_gradients_pass_through(qat_cfg, monkeypatch):
    """An SWA layer (0): the window KV goes through FP8 fake quantisation (blocks of 32) and the layer's
    output changes; the weight gradient is that of the straight-through estimator (the same graph as
    without QAT, evaluated at the quantised values) -- finite, non-zero."""
    seen = []
    real = attention_module.fake_quant_fp8

    def spy(t, block):
        seen.append((tuple(t.shape), block))
        out = real(t, block)
        codes = (out.detach().float().unflatten(-1, (-1, block)))
        s = codes.abs().amax(-1, keepdim=True) / 448
        assert bool(((codes / torch.exp2(torch.ceil(torch.log2(s)))).to(torch.float8_e4m3fn).float()
                     == codes / torch.exp2(torch.ceil(torch.log2(s)))).all())  # FP8 codes x a power of two
        return out

    monkeypatch.setattr(attention_module, "fake_quant_fp8", spy)
    plan = layer_plan(qat_cfg)
    outs = []
    for cfg in (qat_cfg, dataclasses.replace(qat_cfg, qat=QATConfig())):
        torch.manual_seed(0)
        attn = Attention(cfg, plan[0])
        x = torch.randn(1, 24, cfg.dim)
        out = attn(x, SharedKV())
        out.square().sum().backward()
        outs.append((out.detach(), attn.wkv.weight.grad.clone()))
    assert seen == [((1, 24, qat_cfg.head_dim), 32)]
    assert not torch.equal(outs[0][0], outs[1][0])
    g = outs[0][1]
    assert torch.isfinite(g).all() and g.abs().sum() > 0
