"""The ablation switches (docs/training.md "What each component buys"): each removes its V4.1 component
(its parameters are gone) and computes what the plain counterpart computes, checked against the plain
formula written out here on a small model; their FLOPs and activated parameters; the configs they refuse."""

import math

import pytest
import torch
import torch.nn.functional as F
from layer_plans import FOUR_LAYERS

from flashtrain.config.errors import ConfigError
from flashtrain.model import Transformer
from flashtrain.model.carry import SharedKV
from flashtrain.model.layer_plan import Role, layer_plan
from flashtrain.model.rope import rope_angles
from flashtrain.train.build import read_configs
from flashtrain.train.config import compose, model_config
from flashtrain.train.flops import flop_accounting
from flashtrain.train.optim.routing import route_parameters

SMALL = ["+exp=flash_tiny", *FOUR_LAYERS, "model.vision_n_layers=0"]


def cfg_of(*overrides):
    return model_config(compose([*SMALL, *overrides]))


def tokens(seed=0, S=48):
    return torch.randint(3, 400, (2, S), generator=torch.Generator().manual_seed(seed))


def test_engram_off_is_the_model_without_its_memory():
    """`engram_layer_ids: []`: no Engram parameter or hasher, and every other weight and the output equal
    those of the model whose Engram adds nothing (its value projection zeroed)."""
    on, off = Transformer(cfg_of(), seed=3), Transformer(cfg_of("model.engram_layer_ids=[]"), seed=3)
    assert off.engram_hasher is None and not [n for n, _ in off.named_parameters() if "engram" in n]
    on_params = dict(on.named_parameters())
    assert set(on_params) - {n for n, _ in off.named_parameters()} == {n for n in on_params if ".engram." in n}
    for n, p in off.named_parameters():
        assert torch.equal(p, on_params[n]), n
    with torch.no_grad():
        on.layers[1].engram.wkv.weight.zero_()
        torch.testing.assert_close(off(tokens()), on(tokens()), rtol=0, atol=0)


def test_plain_residual_is_x_plus_sublayer():
    """`residual: plain`: one stream, no hc_* parameter, and the output is the textbook pre-norm residual
    x + attn(norm(x)), x + ffn(norm(x)), final norm, head -- Engram adding its gated value to the one stream."""
    cfg = cfg_of("model.residual=plain")
    model = Transformer(cfg, seed=1)
    assert cfg.n_streams == 1 and not [n for n, _ in model.named_parameters() if ".hc_" in n]
    assert tuple(model.layers[1].engram.q_weight.shape) == (1, cfg.dim)
    tok = tokens(1)
    with torch.no_grad():
        ctx = model.context(tok)
        x, shared = model.embed(tok).float(), SharedKV()
        for block in model.layers:
            if block.engram is not None:
                x = block.engram(x.unsqueeze(2), ctx.engram_ids[:, :, block.engram.index], None).squeeze(2)
            x = x + block.attn(block.attn_norm(x), shared)
            x = x + block.ffn(block.ffn_norm(x), None)
        want = model.head(model.norm(x)).float()
        torch.testing.assert_close(model(tok), want, rtol=1e-5, atol=1e-6)


def dense_causal_attention(attn, x):
    """Causal attention over every earlier position with the layer's own projections, K = V (the shared
    latent), and its per-head sink in the softmax's denominator: written out with one einsum per product."""
    S = x.shape[1]
    cos, sin = rope_angles(attn.rope_freqs, torch.arange(S))
    _, q = attn.queries(x, cos, sin)
    kv = attn.window_keys(x, cos, sin)
    logits = torch.einsum("bthd,bsd->bhts", q.float(), kv.float()) * attn.scale
    logits = logits.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    weights = logits.exp() / (logits.exp().sum(-1, keepdim=True) + attn.attn_sink.float().exp()[:, None, None])
    o = torch.einsum("bhts,bsd->bthd", weights, kv.float())
    return attn.output(o.to(x.dtype), cos, sin)


def test_dense_attention_attends_over_the_whole_prefix():
    """`attention: dense`: every layer a sliding-window layer with no compressor / indexer parameters and
    nothing shared, whose output is full causal attention (beyond the published window of 16)."""
    cfg = cfg_of("model.attention=dense")
    assert [r.role for r in layer_plan(cfg)] == [Role.SWA] * cfg.n_layers
    model = Transformer(cfg, seed=2)
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if ".compressor." in n or ".indexer." in n]
    x = torch.randn(2, 48, cfg.dim, generator=torch.Generator().manual_seed(0))
    attn = model.layers[2].attn
    with torch.no_grad():
        for name, p in attn.named_parameters():  # past the init's scale: logits of order one, outputs too
            if p.dim() == 2:
                p.mul_(40)
        attn.attn_sink.copy_(torch.tensor([0.5, -1.0]))
        got = attn(x, SharedKV())
        want = dense_causal_attention(attn, x)
        assert want.abs().max() > 0.5
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert attn.window is None and cfg.window_size == 16
        attn.window = cfg.window_size  # the published SWA layer: 16 keys, which 48 positions go past
        windowed = attn(x, SharedKV())
        torch.testing.assert_close(windowed[:, :16], got[:, :16], rtol=1e-5, atol=1e-5)
        assert (windowed[:, 16:] - got[:, 16:]).abs().max() > 0.1 * want.abs().max()


def test_dense_ffn_is_one_swiglu_of_the_activated_width():
    """`ffn: dense`: no gate, experts or biases; one SwiGLU of (6 + 1) ... here (2 + 1) x 32 = 96 wide,
    w2(silu(w1 x) * w3 x) (the clamp at 10 not reached), every token through it; no expert loads."""
    cfg = cfg_of("model.ffn=dense")
    model = Transformer(cfg, seed=4)
    ffn = model.layers[0].ffn
    assert cfg.dense_ffn_dim == (2 + 1) * 32 == 96
    assert {n for n, _ in ffn.named_parameters()} == {"w1.weight", "w2.weight", "w3.weight"}
    assert tuple(ffn.w1.weight.shape) == (96, cfg.dim) and tuple(ffn.w2.weight.shape) == (cfg.dim, 96)
    assert not [n for n, _ in model.named_buffers() if ".gate." in n]
    x = torch.randn(2, 5, cfg.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = (F.silu(x @ ffn.w1.weight.T) * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
        torch.testing.assert_close(ffn(x, None), want, rtol=1e-5, atol=1e-6)
        from flashtrain.model.aux import StepStats

        stats = StepStats()
        model(tokens(), stats=stats)
        assert stats.expert_load == {} and stats.balance_loss == {}


def test_flops_and_activated_parameters_of_the_ablations():
    """Hand-counted: the dense FFN's matmul parameters, the dense attention core over t + 1 keys, and the
    activated parameters per token without mHC's hc_*_fn."""
    S = 48
    D, L, H, hd = 64, 4, 2, 32
    ffn = flop_accounting(cfg_of("model.ffn=dense"), S)
    assert ffn["matmul_params_by_part"]["dense_ffn"] == L * 3 * D * 96
    assert ffn["matmul_params_by_part"]["routed_experts"] == ffn["matmul_params_by_part"]["gate"] == 0
    dense = flop_accounting(cfg_of("model.attention=dense"), S)
    # 3 (fwd + bwd) x 2 products x 2 FLOPs x hd x H per key, (t + 1) keys, averaged over t < S, per layer
    assert dense["flops_components"]["attention_core"] == pytest.approx(L * 3 * 4 * hd * H * (S + 1) / 2, rel=1e-12)
    assert dense["flops_components"]["indexer"] == 0
    full, plain = flop_accounting(cfg_of(), S), flop_accounting(cfg_of("model.residual=plain"), S)
    mix = 2 * L * 24 * 4 * D  # hc_attn_fn and hc_ffn_fn per layer, [24, 4 D] each
    engram = (1 + 4) * D - (1 + 1) * D  # the one Engram's wkv: [D (n + 1), cols x head_dim], n streams 4 -> 1
    cols = (4 - 1) * 2 * 8
    vectors = 2 * L * (24 + 3)  # hc_*_base [24] and hc_*_scale [3]
    assert full["params_activated_per_token_inspect"] - plain["params_activated_per_token_inspect"] == \
        mix + vectors + engram * cols + 2 * (4 - 1) * D  # and Engram's q_weight / k_weight [n, D]
    assert full["matmul_params_by_part"]["mhc"] == mix and plain["matmul_params_by_part"]["mhc"] == 0


def test_adamw_matrices_take_what_muon_took():
    """`optim.matrices: adamw`: no Muon group; every parameter Muon took is AdamW's with weight decay
    optim.adamw.weight_decay; the rest is routed as before."""
    c = read_configs(compose([*SMALL]))
    a = read_configs(compose([*SMALL, "optim.matrices=adamw", "optim.adamw.weight_decay=0.05"]))
    model = Transformer(c.model, seed=0)
    before = {n: g for g in route_parameters(model, c.model, c.optim) for n in g.names}
    after = {n: g for g in route_parameters(model, a.model, a.optim) for n in g.names}
    assert set(before) == set(after)
    muon = {n for n, g in before.items() if g.optimizer == "muon"}
    assert muon and "layers.0.attn.wq_b.weight" in muon and "layers.0.ffn.experts.w1" in muon
    for n, g in after.items():
        if n in muon:
            assert (g.optimizer, g.rule, g.options, g.lr_mult) == ("adamw", "adamw_matrix", {"weight_decay": 0.05}, 1.0)
        else:
            assert (g.optimizer, g.rule) == (before[n].optimizer, before[n].rule), n


@pytest.mark.parametrize("overrides, message", [
    (["model.attention=sparse"], r"model\.attention='sparse': must be one of csa2, dense"),
    (["model.residual=hc"], r"model\.residual='hc': must be one of mhc, plain"),
    (["model.ffn=mlp"], r"model\.ffn='mlp': must be one of moe, dense"),
    (["optim.matrices=sgd"], r"optim\.matrices='sgd': must be muon \(V4\.1\) or adamw"),
    (["model.attention=dense", "parallel.cp=2"], r"parallel\.cp=2: model\.attention=dense .* set parallel\.cp=1"),
    (["model.ffn=dense", "parallel.ep=2"], r"parallel\.ep=2: model\.ffn=dense has no experts .* parallel\.ep=1"),
    (["model.residual=plain", "parallel.pp=2"], r"parallel\.pp=2: the ablation\(s\) model\.residual=plain"),
    (["model.ffn=dense", "train.spike.action=rollback"], r"train\.spike\.action=rollback: .*model\.ffn=dense"),
])
def test_refused_ablation_configs_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        read_configs(compose([*SMALL, *overrides]))


def test_a_published_model_is_not_ablated():
    cfg = cfg_of()
    assert cfg.ablated == [] and cfg.n_streams == 4
    assert cfg_of("model.ffn=dense", "model.attention=dense").ablated == ["attention=dense", "ffn=dense"]
    assert math.isclose(cfg_of("model.residual=plain").n_streams, 1)


ALL_SWITCHES = ["model.attention=dense", "model.residual=plain", "model.ffn=dense", "model.engram_layer_ids=[]",
                "optim.matrices=adamw"]


@pytest.mark.slow
@pytest.mark.xdist_group("ablations_trainer")
def test_the_trainer_runs_and_resumes_every_switch_at_once(tmp_path):
    """launch/pretrain.py with all five switches (FOUR_LAYERS, 2 steps, a checkpoint after each): the startup
    line names them; the checkpoint holds none of the removed parameters; the step records carry no expert
    load; stopping after step 1, then resuming, gives step 2's record exactly (the loss bit for bit); and the
    release export refuses the checkpoint, writing nothing."""
    from test_trainer import pretrain, records

    corpus = [f"data.corpus_dir={tmp_path / 'corpus'}", "data.corpus_text_bytes=300000", "data.corpus_mm_docs=200",
              "data.corpus_shards=2"]
    run = ["model.vision_n_layers=0", "data.mix=[1,0]", "train.checkpoint.interval=1", *ALL_SWITCHES]
    straight = pretrain(tmp_path / "straight", corpus, "train.max_steps=2", *run, plan=FOUR_LAYERS)
    assert ("ablation: model.attention=dense, model.residual=plain, model.ffn=dense, model.engram_layer_ids=[], "
            "optim.matrices=adamw (not V4.1 as published)") in straight.stdout
    pretrain(tmp_path / "resumed", corpus, "train.max_steps=1", *run, plan=FOUR_LAYERS)
    resumed = pretrain(tmp_path / "resumed", corpus, "train.max_steps=2", *run, plan=FOUR_LAYERS)
    assert "resumed from" in resumed.stdout
    a, b = records(tmp_path / "straight"), records(tmp_path / "resumed")
    assert [r["step"] for r in a] == [1, 2] and [r["step"] for r in b] == [1, 2]
    assert b[1]["loss"] == a[1]["loss"] and b[1]["grad_norm"] == a[1]["grad_norm"]
    no_loads = {"max_over_mean": [], "cv": []}
    assert all(math.isfinite(r["loss"]) and r["balance_loss"] == 0 and r["indexer_loss"] == 0
               and r["expert_load"] == {"text": no_loads, "image": no_loads} for r in a)
    from test_trainer import final_model

    weights, _ = final_model(tmp_path / "straight", 2)
    removed = [k for k in weights if any(s in k for s in (".hc_", ".experts.", ".gate.", "compressor", "indexer",
                                                          ".engram."))]
    assert not removed and any(k.endswith("ffn.w1.weight") for k in weights)
    from flashtrain.train.official.convert import OfficialCheckpointError, export_official

    ckpt = tmp_path / "straight" / "checkpoints" / "step_00000002"
    with pytest.raises(OfficialCheckpointError, match=r"ablation\(s\) attention=dense, residual=plain, ffn=dense"):
        export_official(ckpt, tmp_path / "release")
    assert not (tmp_path / "release").exists()
