"""Newton-Schulz orthogonalisation for batches of matrices (V41_SPEC §7), reference and Triton paths.

For X0 = G / (||G||_F + eps) (per matrix), every step (a, b, c) computes
    A = X X^T,  B = b A + c A A^T,  X <- a X + B X
on the small side of the matrix: a tall one is transposed (Triton) or takes the same products from the
other side, A = X^T X and X <- a X + X B (the reference).
V4.1 uses the hybrid schedule: 8 steps of (3.4445, -4.7750, 2.0315), then 2 steps of (2, -1.5, 0.5);
the first set lifts small singular values fast, the second settles them at 1.

The Triton path computes both symmetric products (A = X X^T and A A^T, A being symmetric) with one
kernel that evaluates each lower-triangle tile once and mirrors it into the upper triangle, with the
`b A` term fused into the second one's epilogue; X <- a X + B X is a batched GEMM.
"""

from __future__ import annotations

import torch

from flashtrain.model.kernels.select import HAS_TRITON, interpreting, launch, use_triton

MAIN_COEFFS = (3.4445, -4.7750, 2.0315)
POLISH_COEFFS = (2.0, -1.5, 0.5)
V41_NS_SCHEDULE = (MAIN_COEFFS,) * 8 + (POLISH_COEFFS,) * 2


def _prepare(G: torch.Tensor, eps: float, dtype: torch.dtype, transpose: bool = True):
    """X0 = G / (||G||_F + eps) per matrix, in `dtype` (G converted first, then the norm of the converted
    values, as torch.optim.Muon), contiguous; and whether the matrices are tall. A tall matrix is transposed
    when `transpose` (the Triton path, whose kernel takes the Gram matrix of rows). (The norm is taken on the
    transposed view: with it taken on a transposed copy, the pipelined and one-process runs of
    tests/test_trainer.py, whose ranks batch other sets of matrices, drifted apart beyond 1e-5 -- measured,
    cause not isolated.)"""
    X = G.to(dtype)
    tall = X.shape[-2] > X.shape[-1]
    norm = (X.mT if tall else X).norm(dim=(-2, -1), keepdim=True) + eps
    if tall and transpose:
        X = X.mT
    return torch.div(X, norm, out=torch.empty(X.shape, dtype=dtype, device=X.device)), tall


def native_bf16_matmul(device: torch.device | str) -> bool:
    """Whether bf16 GEMMs run on bf16 hardware here: CUDA, or a CPU with AVX512-BF16 or AMX. Elsewhere (AVX2)
    torch's CPU bf16 GEMM is a slow fallback: 1.3-7 GFLOP/s on one core of the 2-core AVX2 machine of
    docs/kernels.md against 47 GFLOP/s in fp32 at the Newton-Schulz shapes."""
    device = torch.device(device)
    if device.type != "cpu":
        return True
    return any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (nearest even), kept in fp32: what a bf16 GEMM with fp32 accumulation stores."""
    return x.bfloat16().float()


def newton_schulz_reference(G: torch.Tensor, coefficients=V41_NS_SCHEDULE, eps: float = 1e-7,
                            dtype: torch.dtype = torch.float32, native: bool | None = None) -> torch.Tensor:
    """G [..., m, n] -> approximately U V^T of each matrix, same shape, in `dtype`.

    Each step is three (batched) GEMMs, A = X X^T, B = c A A + b A, X <- B X + a X (the last two with
    their sums fused, `baddbmm`, as torch.optim.Muon's `addmm`). A tall matrix is not transposed: its steps
    are the same products from the other side, A = X^T X and X <- X B + a X (the same sums, so the same
    roundings; no transposed copy in and out). bf16 without bf16 hardware (`native_bf16_matmul`; `native`
    overrides): the same bf16 numerics from fp32 GEMMs -- the operands are bf16 values (exact in fp32), the
    products accumulate in fp32 and each result is rounded to bf16, as a bf16 GEMM with fp32 accumulation
    stores it -- at fp32 GEMM speed."""
    X, tall = _prepare(G, eps, dtype, transpose=False)
    if native is None:
        native = dtype != torch.bfloat16 or native_bf16_matmul(X.device)
    shape = X.shape
    X = X.reshape(-1, *shape[-2:])
    if not native:
        X = X.float()
    A = B = spare = None  # the step's products, written into the previous step's tensors
    for a, b, c in coefficients:
        A = torch.bmm(X.mT, X, out=A) if tall else torch.bmm(X, X.mT, out=A)
        A = A if native else _round_bf16(A)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)
        B = B if native else _round_bf16(B)
        Y = torch.baddbmm(X, X, B, beta=a, out=spare) if tall else torch.baddbmm(X, B, X, beta=a, out=spare)
        X, spare = (Y if native else _round_bf16(Y)), X
    return X.to(dtype).reshape(shape)


if HAS_TRITON:
    import triton
    import triton.language as tl

    # (128, 64, 8 warps) spilled 104 bytes on sm_90a with the S epilogue (compile gate, docs/kernels.md): dropped
    _SYRK_CONFIGS = ([triton.Config({"BLOCK": 16, "BLOCK_K": 16})] if interpreting() else
                     [triton.Config({"BLOCK": b, "BLOCK_K": k}, num_warps=w)
                      for b, k, w in ((64, 32, 4), (128, 32, 8), (64, 64, 4))])
    # Spills the compile gate measured and accepts (kernel, config, arch) -> bytes (train/plan/compile_gate.py): the
    # `HAS_S` epilogue loads the [BLOCK, BLOCK] S tile while the accumulator is live; a spill of 1-2 words a
    # program (stored and loaded once, after the K loop) against 2 x BLOCK x K tile loads, and the alternative
    # is fewer configs for the autotuner
    SPILLS_MEASURED = {("_syrk_kernel", "BLOCK=128, BLOCK_K=32, num_warps=8, num_stages=3", "sm_90a"): 4,
                       ("_syrk_kernel", "BLOCK=64, BLOCK_K=64, num_warps=4, num_stages=3", "sm_90a"): 8,
                       ("_syrk_kernel", "BLOCK=64, BLOCK_K=64, num_warps=4, num_stages=3", "sm_100a"): 8}

    @triton.autotune(configs=_SYRK_CONFIGS, key=["M", "K"])
    @triton.jit
    def _syrk_kernel(X, S, OUT, TILE_I, TILE_J, M, K,
                     sxb, sxm, sxk, ssb, ssm, ssn, sob, som, son,
                     alpha, beta, HAS_S: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
        """OUT[b] = alpha * X[b] X[b]^T (+ beta * S[b]) for one lower-triangle tile (i >= j), written
        to (i, j) and mirrored to (j, i). S must be symmetric."""
        t = tl.program_id(0)
        b = tl.program_id(1)
        ti = tl.load(TILE_I + t)
        tj = tl.load(TILE_J + t)
        rows = ti * BLOCK + tl.arange(0, BLOCK)
        cols = tj * BLOCK + tl.arange(0, BLOCK)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            a = tl.load(X + b * sxb + rows[:, None] * sxm + kk[None, :] * sxk,
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            bt = tl.load(X + b * sxb + cols[None, :] * sxm + kk[:, None] * sxk,
                         mask=(cols[None, :] < M) & (kk[:, None] < K), other=0.0)
            acc += tl.dot(a, bt)
        acc = acc * alpha
        mask = (rows[:, None] < M) & (cols[None, :] < M)
        if HAS_S:
            s = tl.load(S + b * ssb + rows[:, None] * ssm + cols[None, :] * ssn, mask=mask, other=0.0)
            acc += beta * s
        out = acc.to(OUT.dtype.element_ty)
        tl.store(OUT + b * sob + rows[:, None] * som + cols[None, :] * son, out, mask=mask)
        if ti != tj:
            tl.store(OUT + b * sob + cols[:, None] * som + rows[None, :] * son, tl.trans(out),
                     mask=(cols[:, None] < M) & (rows[None, :] < M))


_TILES: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _lower_tiles(n_tiles: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (n_tiles, torch.device(device))
    if key not in _TILES:
        ij = torch.tril_indices(n_tiles, n_tiles)
        _TILES[key] = (ij[0].to(device=device, dtype=torch.int32).contiguous(),
                       ij[1].to(device=device, dtype=torch.int32).contiguous())
    return _TILES[key]


def syrk(X: torch.Tensor, alpha: float = 1.0, S: torch.Tensor | None = None, beta: float = 0.0) -> torch.Tensor:
    """alpha X X^T (+ beta S) for X [B, M, K] with the Triton kernel (lower triangle once, mirrored)."""
    B, M, K = X.shape
    out = torch.empty(B, M, M, dtype=X.dtype, device=X.device)
    s = S if S is not None else out

    def grid(meta):
        n = triton.cdiv(M, meta["BLOCK"])
        return (n * (n + 1) // 2, B)

    # the (i, j) tables are the row-major lower triangle, so the table for the smallest candidate
    # block (the most tiles) serves every config the autotuner may pick: a prefix of it is exact
    ti, tj = _lower_tiles(triton.cdiv(M, min(c.kwargs["BLOCK"] for c in _SYRK_CONFIGS)), X.device)
    launch(_syrk_kernel, grid, X, s, out, ti, tj, M, K, *X.stride(), *s.stride(), *out.stride(), alpha, beta,
           HAS_S=S is not None)
    return out


def newton_schulz_triton(G: torch.Tensor, coefficients=V41_NS_SCHEDULE, eps: float = 1e-7,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    shape = G.shape
    X, transposed = _prepare(G.reshape(-1, *shape[-2:]), eps, dtype)  # a tall matrix transposed
    for a, b, c in coefficients:
        A = syrk(X)
        Bm = syrk(A, alpha=c, S=A, beta=b)
        X = torch.baddbmm(X, Bm, X, beta=a, alpha=1.0)
    X = X.mT if transposed else X
    return X.reshape(shape)


def newton_schulz(G: torch.Tensor, coefficients=V41_NS_SCHEDULE, eps: float = 1e-7,
                  dtype: torch.dtype | None = None, triton: bool | None = None,
                  native: bool | None = None) -> torch.Tensor:
    """Dispatch: Triton on CUDA (bf16 there unless `dtype` says otherwise), reference on CPU (fp32; bf16 from
    fp32 GEMMs where the CPU has no bf16 GEMM, `newton_schulz_reference`)."""
    if dtype is None:
        dtype = torch.bfloat16 if G.is_cuda else torch.float32
    if use_triton(G, triton):
        return newton_schulz_triton(G, coefficients, eps, dtype)
    return newton_schulz_reference(G, coefficients, eps, dtype, native)
