"""mHC Triton kernels (model/kernels/mhc.py) under TRITON_INTERPRET=1 against model/mhc.py: forward
outputs and every input gradient, fp32 CPU tensors, ragged token counts and D."""

import math
import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"

import flashtrain.model.kernels.mhc as kmhc  # noqa: E402
from flashtrain.model.kernels.mhc import hc_collapse_triton, hc_expand_triton, hc_mixes_triton  # noqa: E402
from flashtrain.model.mhc import hc_collapse, hc_expand, hc_mixes  # noqa: E402

NORM_EPS, HC_EPS, ITERS = 1e-20, 1e-6, 20


def _close(actual, expected, rtol=1e-5):
    """rtol 1e-5; atol 1e-6 of the tensor's largest magnitude (for entries that cancel to ~0)."""
    atol = 1e-6 * expected.abs().max().item() + 1e-12
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def _site(D, sharp, gen):
    """fn, scale, base as model/init.py starts them (sharp=False), or scaled up so comb is far from
    uniform and the Sinkhorn rounds matter (sharp=True)."""
    n = 4
    fn = 0.1 * torch.randn(24, n * D, generator=gen) / math.sqrt(n * D)
    base = torch.zeros(24)
    base[:n] = -math.log(n - 1)
    base[2 * n:].view(n, n).fill_diagonal_(1.0)
    scale = torch.ones(3)
    if sharp:
        fn = fn * 10.0
        base = base + 0.5 * torch.randn(24, generator=gen)
        scale = torch.tensor([1.5, 2.0, 4.0])
    else:
        base = base + 0.05 * torch.randn(24, generator=gen)
        scale = scale + 0.1 * torch.randn(3, generator=gen)
    return fn, scale, base


def _run_mixes(fn_impl, h, fn, scale, base, grads):
    leaves = [t.detach().clone().requires_grad_(True) for t in (h, fn, scale, base)]
    outs = fn_impl(*leaves, NORM_EPS, HC_EPS, ITERS)
    loss = sum((o * g).sum() for o, g in zip(outs, grads))
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


@pytest.mark.parametrize("B, S, D, sharp", [(2, 13, 48, False), (2, 13, 48, True), (1, 19, 64, True)])
def test_mixes_match_reference(B, S, D, sharp):
    gen = torch.Generator().manual_seed(D + 7 * sharp)
    h = torch.randn(B, S, 4, D, generator=gen)
    h[0, 0] *= 30.0  # a token with a large RMS statistic
    fn, scale, base = _site(D, sharp, gen)
    grads = [torch.randn(B, S, 4, generator=gen), torch.randn(B, S, 4, generator=gen),
             torch.randn(B, S, 4, 4, generator=gen)]
    outs_ref, grads_ref = _run_mixes(hc_mixes, h, fn, scale, base, grads)
    outs_tri, grads_tri = _run_mixes(hc_mixes_triton, h, fn, scale, base, grads)
    if sharp:  # the case is meant to exercise the Sinkhorn: comb well away from uniform
        assert (outs_ref[2] - 0.25).abs().max() > 0.2
    for a, e in zip(outs_tri, outs_ref):
        _close(a, e)
    for name, a, e in zip(("h", "fn", "scale", "base"), grads_tri, grads_ref):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        _close(a, e)


def test_mixes_reduction_layouts(monkeypatch):
    """Several token blocks per mix-gradient program and several dfn splits (ragged last split)."""
    monkeypatch.setattr(kmhc, "_MIXGRAD_PROGRAMS", 2)
    monkeypatch.setattr(kmhc, "_DFN_SPLITS", 3)
    monkeypatch.setattr(kmhc, "_DFN_MIN_TOKENS", 1)
    gen = torch.Generator().manual_seed(3)
    B, S, D = 1, 53, 48
    h = torch.randn(B, S, 4, D, generator=gen)
    fn, scale, base = _site(D, True, gen)
    grads = [torch.randn(B, S, 4, generator=gen), torch.randn(B, S, 4, generator=gen),
             torch.randn(B, S, 4, 4, generator=gen)]
    _, grads_ref = _run_mixes(hc_mixes, h, fn, scale, base, grads)
    _, grads_tri = _run_mixes(hc_mixes_triton, h, fn, scale, base, grads)
    for a, e in zip(grads_tri, grads_ref):
        _close(a, e)


def test_mixes_partial_requires_grad():
    """Only h needs a gradient (fn, scale, base frozen): the kernel skips dfn; only dcomb flows."""
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(2, 5, 4, 48, generator=gen)
    fn, scale, base = _site(48, True, gen)
    g = torch.randn(2, 5, 4, 4, generator=gen)
    grads_h = []
    for impl in (hc_mixes, hc_mixes_triton):
        x = h.clone().requires_grad_(True)
        (impl(x, fn, scale, base, NORM_EPS, HC_EPS, ITERS)[2] * g).sum().backward()
        grads_h.append(x.grad)
    _close(grads_h[1], grads_h[0])


@pytest.mark.parametrize("B, S, D", [(2, 13, 48), (1, 11, 64)])
def test_collapse_matches_reference(B, S, D):
    gen = torch.Generator().manual_seed(D)
    h = torch.randn(B, S, 4, D, generator=gen)
    pre = torch.rand(B, S, 4, generator=gen)
    g = torch.randn(B, S, D, generator=gen)
    res = []
    for impl in (hc_collapse, hc_collapse_triton):
        hh, pp = h.clone().requires_grad_(True), pre.clone().requires_grad_(True)
        y = impl(hh, pp)
        (y * g).sum().backward()
        res.append((y.detach(), hh.grad, pp.grad))
    for a, e in zip(res[1], res[0]):
        assert a.shape == e.shape and a.dtype == e.dtype
        _close(a, e)


@pytest.mark.parametrize("B, S, D", [(2, 13, 48), (1, 11, 64)])
def test_expand_matches_reference(B, S, D):
    gen = torch.Generator().manual_seed(D + 1)
    y = torch.randn(B, S, D, generator=gen)
    h = torch.randn(B, S, 4, D, generator=gen)
    post = 2 * torch.rand(B, S, 4, generator=gen)
    comb = torch.rand(B, S, 4, 4, generator=gen)
    comb = comb / comb.sum(-1, keepdim=True)
    g = torch.randn(B, S, 4, D, generator=gen)
    res = []
    for impl in (hc_expand, hc_expand_triton):
        leaves = [t.clone().requires_grad_(True) for t in (y, h, post, comb)]
        out = impl(*leaves)
        (out * g).sum().backward()
        res.append((out.detach(), *(t.grad for t in leaves)))
    for a, e in zip(res[1], res[0]):
        assert a.shape == e.shape and a.dtype == e.dtype
        _close(a, e)
