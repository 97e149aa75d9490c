"""Triton kernels under TRITON_INTERPRET=1 (fp32, CPU tensors) against the plain-PyTorch references."""

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"

from flashtrain.train.optim import Muon, SinkhornBalanced  # noqa: E402
from flashtrain.train.optim.newton_schulz import newton_schulz_reference, newton_schulz_triton, syrk  # noqa: E402
from flashtrain.train.optim.sinkhorn import sinkhorn_update_reference, sinkhorn_update_triton  # noqa: E402


@pytest.mark.parametrize("b, m, k", [(1, 16, 16), (2, 37, 20), (3, 50, 33)])
def test_syrk_lower_triangle_mirrored(b, m, k):
    torch.manual_seed(0)
    X = torch.randn(b, m, k)
    torch.testing.assert_close(syrk(X), X @ X.mT, atol=1e-4, rtol=1e-5)
    A = X @ X.mT
    torch.testing.assert_close(syrk(A, alpha=2.0315, S=A, beta=-4.775), 2.0315 * (A @ A) - 4.775 * A,
                               atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (3, 32, 32)])
def test_newton_schulz_triton_matches_reference(shape):
    torch.manual_seed(0)
    G = torch.randn(*shape)
    torch.testing.assert_close(newton_schulz_triton(G), newton_schulz_reference(G), atol=1e-4, rtol=1e-4)


def test_muon_triton_path_matches_reference_path():
    torch.manual_seed(0)
    shapes = [(32, 20), (32, 20), (2, 16, 24)]
    ref = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    tri = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    o_ref = Muon(ref, lr=0.02, use_triton=False)
    o_tri = Muon(tri, lr=0.02, use_triton=True)
    for _ in range(2):
        for a, b in zip(ref, tri):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        o_ref.step()
        o_tri.step()
    for a, b in zip(ref, tri):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m, n", [(70, 24), (24, 70), (33, 33)])
def test_sinkhorn_triton_matches_reference(m, n):
    torch.manual_seed(0)
    W, G, M = torch.randn(m, n), torch.randn(m, n), torch.randn(m, n)
    G[[2, 5]] *= 1e-6
    M[[2, 5]] *= 1e-6
    W_ref, M_ref = W.clone(), M.clone()
    sinkhorn_update_reference(W_ref, G, M_ref, 0.1, 0.95, 11, 1e-3, 1e-20, 0.18)
    W_tri, M_tri = W.clone(), M.clone()
    sinkhorn_update_triton(W_tri, G, M_tri, 0.1, 0.95, 11, 1e-3, 1e-20, 0.18)
    step = (W_ref - W).abs().max()
    assert ((W_tri - W_ref).abs().max() / step).item() < 1e-5
    torch.testing.assert_close(M_tri, M_ref)
    assert (W_tri[[2, 5]] == W[[2, 5]]).all()
    rms = ((W - W_tri) / (0.18 * 0.1)).pow(2).mean(1).sqrt()
    keep = [i for i in range(m) if i not in (2, 5)]
    torch.testing.assert_close(rms[keep], torch.ones(len(keep)), atol=1e-5, rtol=0)


def test_sinkhorn_optimizer_triton_path():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(40, 16))
    b = torch.nn.Parameter(a.detach().clone())
    oa, ob = SinkhornBalanced([a], lr=0.05, use_triton=False), SinkhornBalanced([b], lr=0.05, use_triton=True)
    for _ in range(2):
        g = torch.randn(40, 16)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(b.detach()).all()
