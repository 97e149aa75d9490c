"""FP8 GEMMs of a Linear (`model.fp8.enabled`, issue 35): y = x W^T, dx = dy W and dW = dy^T x, each on
E4M3 operands with power-of-two (E8M0) scales per block of 32 along its reduction dimension, accumulated in
fp32.

The recipe is DeepSeek-V3's fine-grained FP8 (V3 report §3.3: per-tile / per-block scales, E4M3 for every
tensor, fp32 accumulation with promotion, master weights and optimizer state in fp32) at V4.1's block of
32 and with its power-of-two scales (the public inference code's `fp8_block_size = 32`, `scale_fmt =
"ue8m0"`), so that the forward multiplies exactly the weight the release stores:

| GEMM | operand A, scales along K | operand B, scales along K | K |
|---|---|---|---|
| forward y = x W^T | x: 1 x 32 blocks (`act_quant`'s) | W: its 32 x 32 tiles (the released codes) | in |
| dgrad dx = dy W | dy: 1 x 32 blocks along out | W^T: the same tiles, transposed (the same codes) | out |
| wgrad dW = dy^T x | dy^T: 32 x 1 blocks (32 tokens) | x^T: 32 x 1 blocks, re-quantised from the saved FP8 x | tokens |

A 32 x 32 tile is square, so W^T needs no second quantisation. The forward keeps x's FP8 codes and scales
for the backward (1 + 1/8 bytes a value against bf16's 2; V3's "low-precision storage") and W's codes and
tile scales; the wgrad operand x^T is dequantised from them, transposed and re-quantised along tokens, as
V3 describes its own backward (§3.5, "transposed GEMM operations"). A dimension that is not a multiple of
32 is zero-padded into a partial last block (zeros change no block's amax and add nothing).

The GEMM itself is one op, `flashtrain::fp8_block_gemm(a, a_scale, b, b_scale)` = the sum over K blocks of
a_scale x b_scale x (A block . B block): the Triton kernel on CUDA (model/kernels/fp8_gemm.py; Hopper has no
`torch._scaled_mm` scaling mode for blocks of 32), the plain-PyTorch reference `fp8_block_gemm_reference`
(dequantise, fp32 matmul: the same products, which E4M3 x E4M3 x powers of two make exact in fp32) on the
CPU and wherever `model.use_triton=false`, and a shape function for the memory estimator's fake tensors
(while the offline compile gate records launches, model/kernels/select.py `recording`, the Triton path's
host code instead: its launch is recorded at the exp's shapes, train/plan/compile_gate.py).
Selective recomputation keeps its output as it keeps every matmul's (model/recompute.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtrain.model.kernels.select import is_recording, use_triton
from flashtrain.model.quant import fp8_block_quant, fp8_weight_quant

BLOCK = 32  # the scale block (the public code's fp8_block_size)


# ---------------------------------------------------------------------------------------------- the GEMM
def fp8_block_gemm_reference(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                             out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] and b [N, K] E4M3 codes, a_scale [M, K / 32] and b_scale [N, K / 32] fp32 powers of two ->
    (a x a_scale) @ (b x b_scale)^T [M, N] in `out_dtype`, accumulated in fp32."""
    return (_dequant(a, a_scale) @ _dequant(b, b_scale).t()).to(out_dtype)


def _dequant(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (codes.float().unflatten(-1, (-1, BLOCK)) * scale.float().unsqueeze(-1)).flatten(-2)


@torch.library.custom_op("flashtrain::fp8_block_gemm", mutates_args=())
def fp8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   out_dtype: torch.dtype, kernel: bool) -> torch.Tensor:
    """`fp8_block_gemm_reference`, by the Triton kernel when `kernel` (CUDA, or CPU tensors under
    TRITON_INTERPRET=1), else by the reference."""
    if kernel:
        from flashtrain.model.kernels.fp8_gemm import fp8_block_gemm_triton

        return fp8_block_gemm_triton(a, a_scale, b, b_scale, out_dtype)
    return fp8_block_gemm_reference(a, a_scale, b, b_scale, out_dtype)


@fp8_block_gemm.register_fake
def _(a, a_scale, b, b_scale, out_dtype, kernel):
    # the compile gate (train/plan/compile_gate.py): the CUDA path's host code, its launch recorded (select.py `launch`)
    if kernel and is_recording():
        from flashtrain.model.kernels.fp8_gemm import fp8_block_gemm_triton

        return fp8_block_gemm_triton(a, a_scale, b, b_scale, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


# ---------------------------------------------------------------------------------------------- operands
def _pad_to_block(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t zero-padded along `dim` to a multiple of 32 (t itself when it is one)."""
    extra = -t.shape[dim] % BLOCK
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    if t.dtype == torch.float8_e4m3fn:  # pad the bytes: code 0 is +0.0
        return F.pad(t.view(torch.uint8), pad).view(torch.float8_e4m3fn)
    return F.pad(t, pad)


def quant_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> (E4M3 codes [R, C'], fp32 scales [R, C' / 32]), blocks of 32 along C (C' = C padded to a
    multiple of 32): `act_quant` with power-of-two scales (model/quant.py `fp8_block_quant`)."""
    codes, scale = fp8_block_quant(_pad_to_block(t, 1), BLOCK)
    return codes, scale.float()


def weight_operands(codes: torch.Tensor, tiles: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's codes [N, K] and tile scales [ceil(N/32), ceil(K/32)] as a GEMM's B operand with scales
    along its K: W itself ([N, K'], [N, K' / 32]) or W^T ([K, N'], [K, N' / 32])."""
    scale = tiles.float()
    if transpose:
        codes, scale = codes.t(), scale.t()
    rows = codes.shape[0]
    return _pad_to_block(codes.contiguous(), 1), scale.repeat_interleave(BLOCK, 0)[:rows].contiguous()


# ---------------------------------------------------------------------------------------------- the Linear
class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, kernel: bool) -> torch.Tensor:
        lead, K = x.shape[:-1], x.shape[-1]
        xc, xs = quant_rows(x.reshape(-1, K))
        wc, ws = fp8_weight_quant(weight, BLOCK)
        y = fp8_block_gemm(xc, xs, *weight_operands(wc, ws, transpose=False), out_dtype, kernel)
        ctx.save_for_backward(xc, xs, wc, ws)
        ctx.x_dtype, ctx.w_dtype, ctx.K, ctx.kernel = x.dtype, weight.dtype, K, kernel
        return y.view(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xc, xs, wc, ws = ctx.saved_tensors
        K, kernel = ctx.K, ctx.kernel
        N = wc.shape[0]
        dy2 = dy.reshape(-1, N)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dgrad: dy (1 x 32 along out) . W^T tiles
            a, sa = quant_rows(dy2)
            dx = fp8_block_gemm(a, sa, *weight_operands(wc, ws, transpose=True), ctx.x_dtype, kernel)
            dx = dx.view(*dy.shape[:-1], K)
        if ctx.needs_input_grad[1]:  # wgrad: dy^T . x^T, both in blocks of 32 tokens
            x = _dequant(xc, xs)[:, :K]
            a, sa = quant_rows(dy2.t())
            b, sb = quant_rows(x.t())
            dw = fp8_block_gemm(a, sa, b, sb, torch.float32, kernel).to(ctx.w_dtype)
        return dx, dw, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, requested_triton: bool | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T with the three GEMMs in FP8 (the table above); the output in the
    matmul's dtype (autocast's bf16 on CUDA, else x's). `requested_triton`: `model.use_triton` (None: the
    kernel on CUDA, the reference on the CPU)."""
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    return _FP8Linear.apply(x, weight, out_dtype, use_triton(x, requested_triton))
