"""The FP8 block-scaled GEMM kernel (model/kernels/fp8_gemm.py) under TRITON_INTERPRET=1 against its
plain-PyTorch reference (model/fp8_linear.py `fp8_block_gemm_reference`), and the FP8 Linear's forward and
backward through the kernel against the same through the reference."""

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"

from flashtrain.model.fp8_linear import fp8_block_gemm_reference, fp8_linear, quant_rows  # noqa: E402
from flashtrain.model.kernels.fp8_gemm import fp8_block_gemm_triton  # noqa: E402


def operands(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes and scales of a [rows, k] tensor whose blocks of 32 span six decades (a zero row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-12, 8, (rows, k // 32), generator=g).float()
                                                       ).repeat_interleave(32, 1)
    x[0] = 0.0
    return quant_rows(x)


@pytest.mark.parametrize("m, n, k", [(1, 1, 32), (5, 7, 32), (37, 19, 96), (16, 48, 64), (70, 33, 160)])
def test_kernel_matches_reference(m, n, k):
    """Ragged tiles at both edges, one to five blocks along K; the difference is fp32 summation order only."""
    a, sa = operands(m, k, 1)
    b, sb = operands(n, k, 2)
    ref = fp8_block_gemm_reference(a, sa, b, sb, torch.float32)
    got = fp8_block_gemm_triton(a, sa, b, sb, torch.float32)
    terms = (a.float().abs().unflatten(-1, (-1, 32)) * sa.unsqueeze(-1)).flatten(-2) @ \
        (b.float().abs().unflatten(-1, (-1, 32)) * sb.unsqueeze(-1)).flatten(-2).t()
    assert ((got - ref).abs() <= 2 * k * 2.0 ** -24 * terms).all()
    assert got[0].eq(0).all() and torch.isfinite(got).all()


def test_kernel_rejects_what_it_cannot_run():
    a, sa = operands(4, 32, 3)
    with pytest.raises(ValueError, match="E4M3 codes"):
        fp8_block_gemm_triton(a.float(), sa, a, sa, torch.float32)
    b, sb = operands(4, 64, 4)
    with pytest.raises(ValueError, match="one K, a multiple of 32"):
        fp8_block_gemm_triton(a, sa, b, sb, torch.float32)


def test_fp8_linear_through_the_kernel_matches_the_reference():
    """Forward, dgrad and wgrad of an FP8 Linear (K = 80 and 40 outputs: partial blocks, 45 tokens) with the
    kernel forced on against the reference path."""
    g = torch.Generator().manual_seed(5)
    x0, w0, dy = torch.randn(3, 15, 80, generator=g), torch.randn(40, 80, generator=g) * 0.05, torch.randn(3, 15, 40,
                                                                                                          generator=g)
    out = []
    for kernel in (True, False):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fp8_linear(x, w, requested_triton=kernel)
        y.backward(dy)
        out.append((y.detach(), x.grad, w.grad))
    for got, ref in zip(*out):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
