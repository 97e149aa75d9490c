"""DeepSeekMoE gate, clamped experts, balance loss and load counts (V41_SPEC §4), against hand values."""

import dataclasses
import math

import torch

from flashtrain.model.moe import Gate, MoE, RoutedExperts, sequence_balance_loss, swiglu_clamped


def _softplus_sqrt(v: float) -> float:
    return math.sqrt(math.log1p(math.exp(v)))


def _cfg(tiny_cfg, **kw):
    return dataclasses.replace(tiny_cfg, **kw)


def test_gate_selects_with_bias_vl_at_image_positions_and_weights_unbiased(tiny_cfg):
    cfg = _cfg(tiny_cfg, dim=2, n_routed_experts=4, n_activated_experts=2, route_scale=1.5)
    gate = Gate(cfg)
    with torch.no_grad():
        gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]]))
        gate.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # text: always pick expert 3
        gate.bias_vl.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # image: always pick expert 0
    x = torch.tensor([[0.5, 2.0], [0.5, 2.0]])
    image = torch.tensor([False, True])
    scores, weights, idx = gate(x, image)
    logits = [0.5, 2.0, 2.5, -0.5]
    s = [_softplus_sqrt(v) for v in logits]
    # unbiased best is expert 2 (2.5); the bias adds expert 3 for text, expert 0 for image
    assert set(idx[0].tolist()) == {3, 2}
    assert set(idx[1].tolist()) == {0, 2}
    for row, (a, b) in ((0, (3, 2)), (1, (0, 2))):
        want = {a: s[a] / (s[a] + s[b] + 1e-20) * 1.5, b: s[b] / (s[a] + s[b] + 1e-20) * 1.5}
        got = dict(zip(idx[row].tolist(), weights[row].tolist()))
        for e in want:
            assert abs(got[e] - want[e]) < 1e-6
    torch.testing.assert_close(scores[0], torch.tensor(s))


def test_swiglu_clamps_by_hand():
    gate = torch.tensor([20.0, 20.0, -30.0, 1.0])
    up = torch.tensor([50.0, -50.0, 3.0, 2.0])
    out = swiglu_clamped(gate, up, 10.0)
    def silu(v):
        return v / (1 + math.exp(-v))
    want = [silu(10.0) * 10.0, silu(10.0) * -10.0, silu(-30.0) * 3.0, silu(1.0) * 2.0]
    torch.testing.assert_close(out, torch.tensor(want))


def test_routed_experts_apply_clamps_and_weight_before_w2(tiny_cfg):
    cfg = _cfg(tiny_cfg, dim=2, moe_inter_dim=1, n_routed_experts=2, n_activated_experts=1, swiglu_limit=10.0)
    ex = RoutedExperts(cfg)
    with torch.no_grad():
        ex.w1.copy_(torch.tensor([[[100.0, 0.0]], [[1.0, 0.0]]]))  # gate pre-activation
        ex.w3.copy_(torch.tensor([[[0.0, 100.0]], [[0.0, -100.0]]]))  # up pre-activation
        ex.w2.copy_(torch.tensor([[[1.0], [2.0]], [[3.0], [-1.0]]]))
    x = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    weights = torch.tensor([[0.5], [2.0]])
    idx = torch.tensor([[0], [1]])
    out = ex(x, weights, idx)
    def silu(v):
        return v / (1 + math.exp(-v))
    a0 = 0.5 * silu(10.0) * 10.0  # gate 100 -> 10, up 100 -> 10
    a1 = 2.0 * silu(1.0) * -10.0  # up -100 -> -10
    torch.testing.assert_close(out, torch.tensor([[a0 * 1.0, a0 * 2.0], [a1 * 3.0, a1 * -1.0]]))


def test_balance_loss_by_hand():
    # one sequence of T=2 tokens, E=3 experts, k=1
    scores = torch.tensor([[[1.0, 2.0, 1.0], [3.0, 1.0, 0.0]]])
    idx = torch.tensor([[[1], [0]]])
    # f = E/(k T) * counts = 3/2 * [1, 1, 0];
    # P = mean over tokens of s/sum(s) = [(1/4 + 3/4)/2, (2/4 + 1/4)/2, (1/4 + 0)/2]
    f = [1.5, 1.5, 0.0]
    P = [0.5, 0.375, 0.125]
    want = sum(a * b for a, b in zip(f, P))
    assert abs(sequence_balance_loss(scores, idx, 3).item() - want) < 1e-6
    # a batch of two sequences averages the per-sequence values
    scores2 = torch.cat([scores, torch.tensor([[[1.0, 1.0, 2.0], [1.0, 1.0, 2.0]]])])
    idx2 = torch.cat([idx, torch.tensor([[[2], [2]]])])
    want2 = (want + 3.0 * 0.5) / 2  # second: f = [0, 0, 3], P = [.25, .25, .5]
    assert abs(sequence_balance_loss(scores2, idx2, 3).item() - want2) < 1e-6


def test_expert_load_counts_per_modality_and_aux_gradient(tiny_cfg):
    from flashtrain.model.aux import StepStats

    torch.manual_seed(0)
    moe = MoE(tiny_cfg, layer_id=5)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(2, 10, tiny_cfg.dim)
    image = torch.zeros(2, 10, dtype=torch.bool)
    image[0, 3:7] = True
    stats = StepStats()
    y = moe(x, image, stats)
    load = stats.expert_load[5]
    k = tiny_cfg.n_activated_experts
    assert load.shape == (2, tiny_cfg.n_routed_experts)
    assert load[1].sum().item() == 4 * k and load[0].sum().item() == 16 * k
    # the balance loss reaches the gate through the backward pass of y alone
    (y * 0).sum().backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert stats.balance_loss[5].item() > 0
    # the bias buffers are not parameters
    names = {n for n, _ in moe.named_parameters()}
    assert "gate.bias" not in names and "gate.bias_vl" not in names
    assert "gate.bias" in moe.state_dict() and "gate.bias_vl" in moe.state_dict()


def test_moe_layer_equals_the_literal_sum_of_routed_and_shared_experts(tiny_cfg):
    """A whole MoE layer with random weights and random biases, per token from the spec: scores
    s = sqrt(softplus(x W^T)); select the top-k of s + bias (text) or s + bias_vl (image); weights =
    the selected unbiased s normalised to 1, times route_scale; output = sum_k w_k expert_k(x) + the
    shared expert, each a clamped SwiGLU (the routing weight multiplies before w2)."""
    cfg = _cfg(tiny_cfg, route_scale=1.5)
    torch.manual_seed(4)
    moe = MoE(cfg, layer_id=3)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
        moe.gate.bias.normal_(0, 0.3)
        moe.gate.bias_vl.normal_(0, 0.3)
    S, k = 12, cfg.n_activated_experts
    x = torch.randn(1, S, cfg.dim)
    image = torch.zeros(1, S, dtype=torch.bool)
    image[0, 4:9] = True
    with torch.no_grad():
        y = moe(x, image)[0].double()
    W = moe.gate.weight.double()
    def silu(v):
        return v / (1 + torch.exp(-v))
    lim = cfg.swiglu_limit

    def swiglu(w1, w3, w2, v, weight=1.0):
        return w2 @ (silu(torch.clamp(w1 @ v, max=lim)) * torch.clamp(w3 @ v, -lim, lim) * weight)

    ex, sh = moe.experts, moe.shared_experts
    differs = 0
    for t in range(S):
        v = x[0, t].double()
        s = torch.sqrt(torch.nn.functional.softplus(W @ v))
        bias = (moe.gate.bias_vl if image[0, t] else moe.gate.bias).double()
        chosen = sorted(range(cfg.n_routed_experts), key=lambda e: -(s[e] + bias[e]).item())[:k]
        differs += chosen != sorted(range(cfg.n_routed_experts), key=lambda e: -s[e].item())[:k]
        w = s[chosen] / (s[chosen].sum() + 1e-20) * 1.5
        want = sum(swiglu(ex.w1[e].double(), ex.w3[e].double(), ex.w2[e].double(), v, w[i])
                   for i, e in enumerate(chosen))
        want = want + swiglu(sh.w1.weight.double(), sh.w3.weight.double(), sh.w2.weight.double(), v)
        torch.testing.assert_close(y[t], want, atol=1e-4, rtol=1e-4)
    assert differs > 0  # the biases changed some selections, so the test sees which scores weight the experts
