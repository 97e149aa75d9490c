"""Triton FP8 GEMM with a scale per block of 32 along K (issue 35), the GEMM of model/fp8_linear.py.

Drop-in equal of `fp8_block_gemm_reference` (model/fp8_linear.py): a [M, K] and b [N, K] E4M3 codes with
fp32 power-of-two scales a_scale [M, K / 32], b_scale [N, K / 32] ->
C [M, N] = sum over K blocks j of a_scale[:, j] b_scale[:, j]^T * (A[:, block j] . B[:, block j]^T).

`_fp8_block_gemm_kernel`, one program per BLOCK_M x BLOCK_N tile of C: for each block of 32 along K it
loads the two E4M3 tiles (B K-major, as Hopper's FP8 tensor-core MMA takes it), takes their product on the
tensor cores (`tl.dot`, fp32 accumulator), and adds it scaled by the outer product of the two blocks' scales
to the fp32 accumulator in registers: the promotion V3 does every 128 elements (report §3.3), here every
32, because the release's scales change every 32. The products of E4M3 values are exact in fp32, so the
kernel and the reference differ only in the order of fp32 additions.

On CUDA it is autotuned over a few tile shapes; under TRITON_INTERPRET=1 a single config runs
(model/kernels/select.py). Nothing is accumulated into the output, so autotune's reruns are harmless.
"""

from __future__ import annotations

import torch

from flashtrain.model.kernels.select import HAS_TRITON, interpreting, launch

SCALE_BLOCK = 32

if HAS_TRITON:
    import triton
    import triton.language as tl

    def _configs(interp: dict, cuda: list[tuple[dict, int, int]]):
        if interpreting():
            return [triton.Config(interp)]
        return [triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in cuda]

    _CONFIGS = _configs({"BLOCK_M": 16, "BLOCK_N": 16},
                        [({"BLOCK_M": 64, "BLOCK_N": 64}, 4, 4), ({"BLOCK_M": 128, "BLOCK_N": 64}, 4, 4),
                         ({"BLOCK_M": 64, "BLOCK_N": 128}, 4, 4), ({"BLOCK_M": 128, "BLOCK_N": 128}, 8, 3)])

    @triton.autotune(configs=_CONFIGS, key=["N", "K"])
    @triton.jit
    def _fp8_block_gemm_kernel(A, AS, B, BS, C, M, N, K, n_blocks,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mmask, nmask = rm < M, rn < N
        rk = tl.arange(0, SB)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in range(0, n_blocks):
            k = j * SB + rk
            a = tl.load(A + rm[:, None] * K + k[None, :], mask=mmask[:, None], other=0.0)
            b = tl.load(B + rn[None, :] * K + k[:, None], mask=nmask[None, :], other=0.0)  # [SB, BLOCK_N]
            sa = tl.load(AS + rm * n_blocks + j, mask=mmask, other=0.0)
            sb = tl.load(BS + rn * n_blocks + j, mask=nmask, other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
        tl.store(C + rm[:, None] * N + rn[None, :], acc.to(C.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def fp8_block_gemm_triton(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """The Triton kernel for `fp8_block_gemm_reference`'s arguments (K a multiple of 32)."""
    M, K = a.shape
    N = b.shape[0]
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_gemm_triton takes E4M3 codes, got {a.dtype} and {b.dtype}")
    if K % SCALE_BLOCK or b.shape[1] != K:
        raise ValueError(f"fp8_block_gemm_triton: a {tuple(a.shape)} and b {tuple(b.shape)} need one K, a multiple "
                         f"of {SCALE_BLOCK} (pad it, model/fp8_linear.py)")
    n_blocks = K // SCALE_BLOCK
    a, b = a.contiguous(), b.contiguous()
    a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()

    def grid(meta):
        return triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"])

    launch(_fp8_block_gemm_kernel, grid, a, a_scale, b, b_scale, c, M, N, K, n_blocks, SB=SCALE_BLOCK)
    return c
