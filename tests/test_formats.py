"""The weights in the release's formats (issue 35; model/formats.py, `model.qat.experts_fp4` / `weights_fp8` /
`weights_bf16`): which format each weight has (against the export's own table), the value the forward
computes with against hand-made blocks (tests/hand_formats.py), the straight-through gradient, the fixed
point an import relies on, and the switches at a resume.

The end-to-end property -- export -> import gives exactly the weights trained with and the same held-out
loss -- runs the launch tools in tests/test_exact_export.py."""

import dataclasses

import pytest
import torch
from hand_formats import BLOCK, adversarial, fp4_rows, fp8_rows, fp8_tiles
from layer_plans import EIGHT_LAYERS

from flashtrain.config.errors import ConfigError
from flashtrain.model.config import FP8Config, ModelConfig, QATConfig
from flashtrain.model.formats import Linear, Stored, as_trained, weight_formats
from flashtrain.model.moe import RoutedExperts
from flashtrain.model.param_kinds import parameter_kinds
from flashtrain.parallel.construct import model_template
from flashtrain.train.config import compose, model_config
from flashtrain.train.official.layout import storage_format
from flashtrain.train.resume import check_model_config

ALL_ON = QATConfig(experts_fp4=True, weights_fp8=True, weights_bf16=True)


@pytest.fixture(scope="module")
def qat_cfg():
    """flash_tiny on the 8-layer plan (every layer role, both Engram modules), with Engram heads of 32 channels
    (the FP8 Engram format scales 32 channels) and the three weight switches on."""
    cfg = model_config(compose(["+exp=flash_tiny", *EIGHT_LAYERS, "model.engram_head_dim=32"]))
    return dataclasses.replace(cfg, qat=ALL_ON)


def test_off_by_default_and_widths_the_formats_cannot_hold_are_refused(tiny_cfg):
    assert ModelConfig().qat == QATConfig() and ModelConfig().fp8 == FP8Config()
    assert not (QATConfig().experts_fp4 or QATConfig().weights_fp8 or QATConfig().weights_bf16)
    assert not FP8Config().enabled and tiny_cfg.fp8 == FP8Config()
    with pytest.raises(ConfigError, match=r"model.qat.experts_fp4=true needs model.moe_inter_dim \(=48\) to be a "
                                          r"multiple of 32"):
        dataclasses.replace(tiny_cfg, moe_inter_dim=48, qat=QATConfig(experts_fp4=True)).validate()
    with pytest.raises(ConfigError, match=r"model.qat.weights_fp8=true needs model.engram_head_dim \(=8\)"):
        dataclasses.replace(tiny_cfg, qat=QATConfig(weights_fp8=True)).validate()
    dataclasses.replace(tiny_cfg, qat=QATConfig(weights_fp8=True), engram_layer_ids=[]).validate()  # no tables


def test_every_weight_has_the_format_the_export_writes_it_in(qat_cfg):
    """The model's declarations (model/formats.py) against the export's table (train/official/layout.py),
    parameter by parameter, on flash_tiny's layer roles with its ViT: the two agree, and every format occurs."""
    template = model_template(qat_cfg)
    formats, kinds = weight_formats(template), parameter_kinds(template)
    assert set(formats) == set(kinds) and None not in formats.values()
    assert {n: formats[n].value for n in formats} == {n: storage_format(n, kinds[n], True) for n in kinds}
    assert set(formats.values()) == set(Stored)
    assert formats["layers.0.attn.wo_b.weight"] is Stored.FP8 and formats["layers.0.attn.wo_a.weight"] is Stored.BF16
    assert formats["layers.1.engram.embed.weight"] is Stored.FP8_ROWS
    assert formats["layers.0.ffn.experts.w2"] is Stored.FP4 and formats["layers.0.hc_ffn_fn"] is Stored.FP32


def test_fp8_weights_lie_on_their_tiles_in_the_forward():
    """An FP8 Linear [40, 80] (partial tiles at both edges) with weights_fp8: the forward's weight is the hand
    quantisation tile by tile (a zero tile, amax at a tile edge, E4M3 ties, subnormal codes, an amax rounding
    down to 224 x scale), and the output is F.linear with it; off, the weight itself."""
    cfg = ModelConfig(qat=QATConfig(weights_fp8=True))
    lin = Linear(80, 40, cfg, Stored.FP8)
    with torch.no_grad():
        lin.weight.copy_(adversarial((40, 80), 0))
    want = fp8_tiles(lin.weight.detach()).float()
    assert torch.equal(lin.value(), want)
    assert want[2, BLOCK + 1] == 1.0 and want[2, BLOCK + 2] == -1.25 and want[3, 7] == 224.0  # the hand ties
    x = torch.randn(3, 5, 80)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, want))
    off = Linear(80, 40, ModelConfig(), Stored.FP8)
    assert off.value() is off.weight
    assert not torch.equal(want, lin.weight.detach())  # the weight really is off the grid


def test_fp4_experts_lie_on_their_grid_and_the_gradient_passes_straight_through(tiny_cfg):
    """Routed experts with experts_fp4: every 32 inputs of every expert row on the E2M1 grid times a power of
    two (by hand); the output is that of the experts holding the quantised weights, and the master's gradient
    is theirs (straight-through: the gradient at the quantised point, passed unchanged)."""
    cfg = dataclasses.replace(tiny_cfg, n_routed_experts=3, qat=QATConfig(experts_fp4=True))
    torch.manual_seed(0)
    qat, plain = RoutedExperts(cfg), RoutedExperts(dataclasses.replace(cfg, qat=QATConfig()))
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            w = getattr(qat, name)
            w.copy_(torch.stack([adversarial(tuple(w.shape[1:]), 10 * e + len(name)) for e in range(w.shape[0])]))
            getattr(plain, name).copy_(torch.stack([fp4_rows(m).float() for m in w]))
    for name, want in zip(("w1", "w2", "w3"), qat.weights()):
        assert torch.equal(want, getattr(plain, name)), name
    x = torch.randn(24, cfg.dim)
    weights = torch.rand(24, cfg.n_activated_experts)
    indices = torch.stack([torch.randperm(cfg.n_routed_experts)[:cfg.n_activated_experts] for _ in range(24)])
    y_qat, y_plain = qat(x, weights, indices), plain(x, weights, indices)
    assert torch.equal(y_qat, y_plain)
    y_qat.square().sum().backward()
    y_plain.square().sum().backward()
    for name in ("w1", "w2", "w3"):
        assert torch.equal(getattr(qat, name).grad, getattr(plain, name).grad), name


def test_engram_rows_and_bf16_weights_in_the_forward(qat_cfg):
    """The Engram table's looked-up rows in FP8 per 32 channels (by hand), and a BF16 weight (a norm, the gate,
    the embedding rows) rounded to BF16, under the switches; off, untouched."""
    model = model_template(qat_cfg).materialize("cpu", 0)
    embed = model.layers[1].engram.embed
    with torch.no_grad():
        embed.weight.copy_(adversarial(tuple(embed.weight.shape), 3))
    ids = torch.tensor([[0, 1, 2, 3, 7]])
    assert torch.equal(embed(ids)[0], fp8_rows(embed.weight.detach()[ids[0]]).float())
    norm = model.layers[0].attn_norm
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(norm.weight.shape) * 1e-3)  # off the bf16 grid
    x = torch.randn(2, norm.weight.shape[0])
    got = norm(x)
    plain = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm.eps)
    assert torch.equal(got, norm.weight.detach().to(torch.bfloat16).float() * plain)
    assert not torch.equal(got, norm.weight.detach() * plain)
    gate = model.layers[0].ffn.gate
    assert torch.equal(as_trained(gate.weight, gate.STORED["weight"], ALL_ON), gate.weight.to(torch.bfloat16).float())
    assert torch.equal(model.embed(ids), model.embed.weight[ids].to(torch.bfloat16).float())
    assert as_trained(gate.weight, Stored.BF16, QATConfig()) is gate.weight


@pytest.mark.parametrize("fmt", [Stored.FP8, Stored.FP4, Stored.FP8_ROWS, Stored.BF16])
def test_the_trained_value_is_a_fixed_point(fmt):
    """Quantising the value trained with gives it back, bit for bit: what an import of the export computes
    with under the same switches. Checked where it is not obvious: a block whose amax rounds down to 224 x
    scale (FP8) or to 3 x scale (FP4) takes half the scale the second time, and its values are still on the
    grid; blocks around the 1e-4 amax floor; six decades of magnitudes."""
    w = adversarial((64, 96), 5)
    w[4, :BLOCK] = torch.linspace(-2.0, 2.0, BLOCK)
    w[4, 0] = 3.2  # FP4: s = pow2_ceil(3.2 / 6) = 1; 3.2 -> 3 (E2M1), so the second pass has s = 0.5
    w[5, :BLOCK] = torch.linspace(-1e-4, 1.05e-4, BLOCK)  # FP8: amax just above the floor
    once = as_trained(w, fmt, ALL_ON)
    assert not torch.equal(once, w)
    assert torch.equal(as_trained(once, fmt, ALL_ON), once)
    if fmt is Stored.FP4:
        assert once[4, 0] == 3.0 and once[4, :BLOCK].abs().max() == 3.0  # the case above happened
    if fmt is Stored.FP8:
        assert once[3, 7] == 224.0


def test_the_weight_switches_may_change_at_a_resume():
    """qat.* and fp8.* change how the step computes, not the model: a checkpoint written without them
    resumes with them (and back); another model field is still refused."""
    saved = {"dim": 64, "qat": dataclasses.asdict(QATConfig()), "fp8": dataclasses.asdict(FP8Config())}
    now = {"dim": 64, "qat": dataclasses.asdict(ALL_ON), "fp8": {"enabled": True}}
    check_model_config(saved, now, "ckpt")
    check_model_config(now, saved, "ckpt")
    with pytest.raises(ConfigError, match=r"fields \['dim'\] differ"):
        check_model_config(saved, {**now, "dim": 32}, "ckpt")


def test_the_estimators_fake_tensors_leave_no_fake_table_behind():
    """The memory estimator runs the formats on fake tensors in the trainer's own process: the E2M1 tables
    (cached per device for real tensors) are built afresh there, so a real quantisation afterwards still
    computes values."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    with FakeTensorMode():
        assert is_fake(as_trained(torch.empty(2, 64, 32), Stored.FP4, ALL_ON))
    w = adversarial((8, 32), 9)
    got = as_trained(w, Stored.FP4, ALL_ON)
    assert not is_fake(got) and torch.equal(got, fp4_rows(w).float())
