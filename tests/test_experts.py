
"""Expert parallelism (parallel/experts.py): all-to-all dispatch parity with the local path under
torchrun/gloo, and expert sharding by hand."""

import sys
from pathlib import Path

import pytest
import torch
import warm_launch

from flashtrain.model.param_kinds import ParamKind, parameter_kinds

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_ep2_matches_ep1_losses_gradients_loads_and_bias_updates():
    run = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            str(ROOT / "tests" / "dist" / "expert_parity.py")], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "rank 0: ep=2 matches ep=1" in run.stdout and "rank 1: ep=2 matches ep=1" in run.stdout


def test_local_experts_by_hand(tiny_cfg):
    """Two tokens, top-2 of 8 experts: the local path is sum_k w_k * w2_e (silu(clamp(w1_e x)) * clamp(w3_e x))."""
    from flashtrain.model.moe import RoutedExperts

    torch.manual_seed(0)
    ex = RoutedExperts(tiny_cfg)
    for w in (ex.w1, ex.w2, ex.w3):
        torch.nn.init.normal_(w, std=0.1)
    x = torch.randn(2, tiny_cfg.dim)
    idx = torch.tensor([[3, 5], [5, 0]])
    wts = torch.tensor([[0.7, 0.3], [0.4, 0.6]])
    lim = tiny_cfg.swiglu_limit

    def expert(e, v):
        g, u = ex.w1[e] @ v, ex.w3[e] @ v
        return ex.w2[e] @ (torch.nn.functional.silu(g.clamp(max=lim)) * u.clamp(-lim, lim))

    want = torch.stack([0.7 * expert(3, x[0]) + 0.3 * expert(5, x[0]), 0.4 * expert(5, x[1]) + 0.6 * expert(0, x[1])])
    torch.testing.assert_close(ex(x, wts, idx), want, rtol=1e-5, atol=1e-6)
    from flashtrain.model.moe import MoE

    kinds = parameter_kinds(MoE(tiny_cfg, 3))  # a routed expert by its module, not its name
    assert kinds["experts.w2"] is ParamKind.ROUTED_EXPERT and kinds["shared_experts.w2.weight"] is ParamKind.MATRIX


def _moe_step(cfg, x, image_mask, grad):
    """One MoE layer forward+backward; returns (output, input gradient, parameter gradients)."""
    from flashtrain.model.moe import MoE

    torch.manual_seed(0)
    moe = MoE(cfg, layer_id=3)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    moe.gate.bias[5] = 10.0  # expert 5 takes every text token
    moe.gate.bias[0] = moe.gate.bias_vl[0] = -10.0  # expert 0 none: an empty group
    x = x.clone().requires_grad_()
    y = moe(x, image_mask)
    y.backward(grad)
    return y.detach(), x.grad, {n: p.grad for n, p in moe.named_parameters()}


def test_grouped_experts_equal_the_looped_reference_without_host_syncs(tiny_cfg):
    """The grouped-GEMM path (default) equals the per-expert loop (model.use_triton=false) in outputs and
    every gradient, and makes no host synchronisation; the loop makes one (its counts), which shows the
    counter sees them."""
    import dataclasses

    from host_syncs import HostSyncs

    torch.manual_seed(1)
    x = torch.randn(2, 24, tiny_cfg.dim)
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[1, 4:12] = True
    grad = torch.randn_like(x)
    looped_cfg = dataclasses.replace(tiny_cfg, use_triton=False)
    with HostSyncs() as grouped_syncs:
        y, dx, dp = _moe_step(tiny_cfg, x, mask, grad)
    with HostSyncs() as looped_syncs:
        y_ref, dx_ref, dp_ref = _moe_step(looped_cfg, x, mask, grad)
    assert grouped_syncs.events == []
    assert looped_syncs.events == ["Tensor.tolist"]
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6)
    for n in dp_ref:
        torch.testing.assert_close(dp[n], dp_ref[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
