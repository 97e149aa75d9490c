"""Triton kernels for single-pass mHC (manifold-constrained hyper-connections), V41_SPEC §3.

Drop-in equals of the plain-PyTorch references in `model/mhc.py`, forward and backward:

| function | equals (model/mhc.py) | kernels |
|---|---|---|
| `hc_mixes_triton` | `hc_mixes` (+ `hc_split_sinkhorn_reference`) | `_mixes_fwd_kernel`; backward: |
|  |  | `_mixes_bwd_mix_kernel`, `_mixes_bwd_x_kernel` |
| `hc_collapse_triton` | `hc_collapse` | `_collapse_fwd_kernel`, `_collapse_bwd_kernel` |
| `hc_expand_triton` | `hc_expand` | `_expand_fwd_kernel`, `_expand_bwd_kernel` |

All are written for n = 4 streams (the only layout ModelConfig allows); tokens are the flattened
leading dims, T = B * S. Arithmetic is fp32 whatever the input dtype (bf16 is cast on load); outputs
are in the reference's dtype (fp32 mixes, h.dtype for collapse / expand, input dtypes for gradients).

Mixes, forward (`_mixes_fwd_kernel`, one program per BLOCK_T tokens): loops over 4D in BLOCK_K tiles,
accumulating sum(x^2) and the 24 dot products as two fp32 `tl.dot`s against fn (rows 0..7 padded to
16 for pre/post, rows 8..23 for comb); then m = dot * rsqrt(mean(x^2) + norm_eps), the sigmoids, the
row softmax (+hc_eps), one column normalisation and iters-1 (row, column) rounds, all on a
[BLOCK_T, 4, 4] register tile. It also writes m [T, 24] and the rsqrt [T] for the backward.

Mixes, backward, two kernels:
  1. `_mixes_bwd_mix_kernel` (a fixed grid of programs striding over token blocks): from the saved m it
     recomputes the softmax and backpropagates through the Sinkhorn by recomputation: for round
     r = iters-1 .. 1 it rebuilds that round's input from the first column-normalised matrix (r-1
     rounds; O(iters^2) 4x4 ops per token, exact), then steps back through its column and row
     normalisation; then the first column step and the softmax. It writes dm * rsqrt [T, 24] and the
     per-token coefficient of the rsqrt term, and per-program partial sums for dbase and dscale.
  2. `_mixes_bwd_x_kernel` (grid: 4D tiles x token splits): dx = (dm*r) . fn - (r^2/4D) (dm . m) x per
     token tile, and partial dfn[split] = sum_t (dm*r)_t x_t^T over that split's tokens, summed in torch.

Collapse / expand: elementwise over [tokens, D] tiles with the 4 streams as a [BLOCK_T, 4, BLOCK_D]
register tile; their backward kernels loop over D per token block so the per-token reductions (dpre;
dpost, dcomb) are finished inside the kernel.

On CUDA every kernel is autotuned over a few configs; under TRITON_INTERPRET=1 a single config runs
(model/kernels/select.py). No kernel accumulates into its outputs, so autotune's reruns are harmless.
"""

from __future__ import annotations

import math

import torch

from flashtrain.model.kernels.select import HAS_TRITON, interpreting, kernel_op, launch

N_STREAMS = 4
N_MIX = (2 + N_STREAMS) * N_STREAMS  # 24

# Backward reduction layout (host-chosen, so the partial buffers do not depend on the autotuned blocks).
_MIXGRAD_PROGRAMS = 1024  # at most this many programs stride over the token blocks of the mix-gradient kernel
_DFN_SPLITS = 16  # at most this many token splits of the dfn reduction
_DFN_MIN_TOKENS = 256  # ... each of at least this many tokens

if HAS_TRITON:
    import triton
    import triton.language as tl

    def _configs(interp: dict, cuda: list[tuple[dict, int]]):
        if interpreting():
            return [triton.Config(interp)]
        return [triton.Config(kw, num_warps=w) for kw, w in cuda]

    _FWD_CONFIGS = _configs({"BLOCK_T": 16, "BLOCK_K": 128},
                            [({"BLOCK_T": 32, "BLOCK_K": 128}, 4), ({"BLOCK_T": 64, "BLOCK_K": 128}, 8),
                             ({"BLOCK_T": 64, "BLOCK_K": 64}, 4), ({"BLOCK_T": 128, "BLOCK_K": 64}, 8)])
    _MIXGRAD_CONFIGS = _configs({"BLOCK_T": 16},
                                [({"BLOCK_T": 32}, 4), ({"BLOCK_T": 64}, 4), ({"BLOCK_T": 128}, 8)])
    # the compile gate (train/plan/compile_gate.py, docs/kernels.md) measured BLOCK_T = 64 spilling 808-896 bytes in
    # this kernel on sm_90a and sm_100a (the [32, BLOCK_K] dfn accumulator beside the [BLOCK_T, BLOCK_K] tiles)
    _XGRAD_CONFIGS = _configs({"BLOCK_T": 16, "BLOCK_K": 128},
                              [({"BLOCK_T": 32, "BLOCK_K": 64}, 4), ({"BLOCK_T": 32, "BLOCK_K": 128}, 4)])
    _ELEM_CONFIGS = _configs({"BLOCK_T": 8, "BLOCK_D": 32},
                             [({"BLOCK_T": 4, "BLOCK_D": 128}, 4), ({"BLOCK_T": 4, "BLOCK_D": 256}, 4),
                              ({"BLOCK_T": 8, "BLOCK_D": 128}, 4), ({"BLOCK_T": 8, "BLOCK_D": 256}, 8)])
    # the expand backward holds dh [BLOCK_T, 4, BLOCK_D] and dcomb [BLOCK_T, 4, 4] besides its loads: with 8 tokens
    # a block it spilled 32-176 bytes, with (4, 256) 64-204 (compile gate, sm_90a and sm_100a); (4, 128): 133-168
    # registers, none
    _EXPAND_BWD_CONFIGS = _configs({"BLOCK_T": 8, "BLOCK_D": 32}, [({"BLOCK_T": 4, "BLOCK_D": 128}, 4)])

    # ---------------------------------------------------------------- Sinkhorn on [BLOCK_T, 4, 4] tiles

    @triton.jit
    def _row_norm(c, eps):
        return c / (tl.sum(c, axis=2)[:, :, None] + eps)

    @triton.jit
    def _col_norm(c, eps):
        return c / (tl.sum(c, axis=1)[:, None, :] + eps)

    @triton.jit
    def _row_norm_bwd(g, x, eps):
        """y = x / (rowsum(x) + eps): dL/dx = (g - rowsum(g * y)) / (rowsum(x) + eps)."""
        d = tl.sum(x, axis=2)[:, :, None] + eps
        y = x / d
        return (g - tl.sum(g * y, axis=2)[:, :, None]) / d

    @triton.jit
    def _col_norm_bwd(g, x, eps):
        d = tl.sum(x, axis=1)[:, None, :] + eps
        y = x / d
        return (g - tl.sum(g * y, axis=1)[:, None, :]) / d

    @triton.jit
    def _softmax_rows(z):
        e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
        return e / tl.sum(e, axis=2)[:, :, None]

    # ---------------------------------------------------------------- mixes

    @triton.autotune(configs=_FWD_CONFIGS, key=["K"])
    @triton.jit
    def _mixes_fwd_kernel(X, FN, SCALE, BASE, PRE, POST, COMB, MIX, RS, T, K,
                          norm_eps, hc_eps, iters, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        t64 = t.to(tl.int64)
        c16 = tl.arange(0, 16)
        sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        acc_pp = tl.zeros((BLOCK_T, 16), dtype=tl.float32)  # columns 0..3 pre, 4..7 post, 8..15 padding
        acc_c = tl.zeros((BLOCK_T, 16), dtype=tl.float32)  # comb logits, row-major 4x4
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            x = tl.load(X + t64[:, None] * K + k[None, :], mask=tmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            sumsq += tl.sum(x * x, axis=1)
            f_pp = tl.load(FN + c16[None, :] * K + k[:, None], mask=(c16[None, :] < 8) & kmask[:, None], other=0.0)
            f_c = tl.load(FN + (8 + c16[None, :]) * K + k[:, None], mask=kmask[:, None], other=0.0)
            acc_pp += tl.dot(x, f_pp.to(tl.float32), input_precision="ieee")
            acc_c += tl.dot(x, f_c.to(tl.float32), input_precision="ieee")
        rs = 1.0 / tl.sqrt(sumsq / K + norm_eps)
        m_pp = acc_pp * rs[:, None]
        m_c = acc_c * rs[:, None]
        tl.store(RS + t64, rs, mask=tmask)
        tl.store(MIX + t64[:, None] * 24 + c16[None, :], m_pp, mask=tmask[:, None] & (c16[None, :] < 8))
        tl.store(MIX + t64[:, None] * 24 + 8 + c16[None, :], m_c, mask=tmask[:, None])

        s0 = tl.load(SCALE + 0).to(tl.float32)
        s1 = tl.load(SCALE + 1).to(tl.float32)
        s2 = tl.load(SCALE + 2).to(tl.float32)
        b_pp = tl.load(BASE + c16, mask=c16 < 8, other=0.0).to(tl.float32)
        sc_pp = tl.where(c16 < 4, s0, s1)
        sig = tl.sigmoid(m_pp * sc_pp[None, :] + b_pp[None, :])
        tl.store(PRE + t64[:, None] * 4 + c16[None, :], sig + hc_eps, mask=tmask[:, None] & (c16[None, :] < 4))
        tl.store(POST + t64[:, None] * 4 + (c16[None, :] - 4), 2.0 * sig,
                 mask=tmask[:, None] & (c16[None, :] >= 4) & (c16[None, :] < 8))

        i4 = tl.arange(0, 4)
        ij = i4[:, None] * 4 + i4[None, :]  # [4, 4] row-major
        b_c = tl.load(BASE + 8 + ij).to(tl.float32)
        z = tl.reshape(m_c, (BLOCK_T, 4, 4)) * s2 + b_c[None, :, :]
        c = _col_norm(_softmax_rows(z) + hc_eps, hc_eps)
        for _ in range(iters - 1):
            c = _col_norm(_row_norm(c, hc_eps), hc_eps)
        tl.store(COMB + t64[:, None, None] * 16 + ij[None, :, :], c, mask=tmask[:, None, None])

    @triton.autotune(configs=_MIXGRAD_CONFIGS, key=["K"])
    @triton.jit
    def _mixes_bwd_mix_kernel(MIX, RS, SCALE, BASE, DPRE, DPOST, DCOMB, DU, COEF, PB, PS, T, K,
                              hc_eps, iters, BLOCK_T: tl.constexpr):
        """Per token: dm from (dpre, dpost, dcomb); writes du = dm * rs [T, 24], coef = rs^2 (dm . m) / K,
        and this program's partial sums of dbase (PB[pid, 24]) and of da * m (PS[pid, 24], for dscale)."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        c16 = tl.arange(0, 16)
        i4 = tl.arange(0, 4)
        ij = i4[:, None] * 4 + i4[None, :]
        pp_col = c16 < 8
        s0 = tl.load(SCALE + 0).to(tl.float32)
        s1 = tl.load(SCALE + 1).to(tl.float32)
        s2 = tl.load(SCALE + 2).to(tl.float32)
        sc_pp = tl.where(c16 < 4, s0, s1)
        b_pp = tl.load(BASE + c16, mask=pp_col, other=0.0).to(tl.float32)
        b_c = tl.load(BASE + 8 + ij).to(tl.float32)
        acc_b_pp = tl.zeros((16,), dtype=tl.float32)
        acc_s_pp = tl.zeros((16,), dtype=tl.float32)
        acc_b_c = tl.zeros((4, 4), dtype=tl.float32)
        acc_s_c = tl.zeros((4, 4), dtype=tl.float32)
        n_blocks = tl.cdiv(T, BLOCK_T)
        for blk in range(pid, n_blocks, nprog):
            t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
            tmask = t < T
            t64 = t.to(tl.int64)
            mask_pp = tmask[:, None] & pp_col[None, :]
            mask_c = tmask[:, None, None]
            rs = tl.load(RS + t64, mask=tmask, other=0.0)
            # pre / post: a = m * scale + base, pre = sigmoid(a) + eps, post = 2 sigmoid(a)
            m_pp = tl.load(MIX + t64[:, None] * 24 + c16[None, :], mask=mask_pp, other=0.0)
            g_pre = tl.load(DPRE + t64[:, None] * 4 + c16[None, :], mask=tmask[:, None] & (c16[None, :] < 4),
                            other=0.0).to(tl.float32)
            g_post = tl.load(DPOST + t64[:, None] * 4 + (c16[None, :] - 4),
                             mask=tmask[:, None] & (c16[None, :] >= 4) & pp_col[None, :], other=0.0).to(tl.float32)
            sig = tl.sigmoid(m_pp * sc_pp[None, :] + b_pp[None, :])
            da_pp = tl.where(mask_pp, (g_pre + 2.0 * g_post) * sig * (1.0 - sig), 0.0)
            dm_pp = da_pp * sc_pp[None, :]
            # comb: recompute the softmax, then backpropagate through the Sinkhorn rounds by recomputation
            m_c = tl.load(MIX + t64[:, None, None] * 24 + 8 + ij[None, :, :], mask=mask_c, other=0.0)
            g = tl.load(DCOMB + t64[:, None, None] * 16 + ij[None, :, :], mask=mask_c, other=0.0).to(tl.float32)
            p = _softmax_rows(m_c * s2 + b_c[None, :, :])
            c0 = p + hc_eps
            c1 = _col_norm(c0, hc_eps)
            for rr in range(0, iters - 1):
                r = iters - 1 - rr  # round r maps S_{2r-1} -> S_{2r} (row) -> S_{2r+1} (column)
                x = c1
                for _ in range(0, r - 1):
                    x = _col_norm(_row_norm(x, hc_eps), hc_eps)
                g = _col_norm_bwd(g, _row_norm(x, hc_eps), hc_eps)
                g = _row_norm_bwd(g, x, hc_eps)
            g = _col_norm_bwd(g, c0, hc_eps)
            dz = p * (g - tl.sum(g * p, axis=2)[:, :, None])
            dz = tl.where(mask_c, dz, 0.0)
            dm_c = dz * s2
            # the rsqrt statistic: m = u * rs, so dx = rs (dm . fn) - rs^2 (dm . m) x / K
            dmm = tl.sum(dm_pp * m_pp, axis=1) + tl.sum(tl.sum(dm_c * m_c, axis=2), axis=1)
            tl.store(COEF + t64, rs * rs * dmm / K, mask=tmask)
            tl.store(DU + t64[:, None] * 24 + c16[None, :], dm_pp * rs[:, None], mask=mask_pp)
            tl.store(DU + t64[:, None, None] * 24 + 8 + ij[None, :, :], dm_c * rs[:, None, None], mask=mask_c)
            acc_b_pp += tl.sum(da_pp, axis=0)
            acc_s_pp += tl.sum(da_pp * m_pp, axis=0)
            acc_b_c += tl.sum(dz, axis=0)
            acc_s_c += tl.sum(dz * m_c, axis=0)
        pid64 = pid.to(tl.int64)
        tl.store(PB + pid64 * 24 + c16, acc_b_pp, mask=pp_col)
        tl.store(PS + pid64 * 24 + c16, acc_s_pp, mask=pp_col)
        tl.store(PB + pid64 * 24 + 8 + ij, acc_b_c)
        tl.store(PS + pid64 * 24 + 8 + ij, acc_s_c)

    @triton.autotune(configs=_XGRAD_CONFIGS, key=["K"])
    @triton.jit
    def _mixes_bwd_x_kernel(X, FN, DU, COEF, DX, PFN, T, K, per_split,
                            HAS_DX: tl.constexpr, HAS_DFN: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (k tile, split): dx[t, k] = du[t] . fn[:, k] - coef[t] x[t, k] for the split's tokens,
        and PFN[split, :, k] = sum over the split's tokens of du[t]^T x[t, k]."""
        kt = tl.program_id(0)
        split = tl.program_id(1)
        k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = k < K
        j = tl.arange(0, 32)
        jmask = j < 24
        fn = tl.load(FN + j[:, None] * K + k[None, :], mask=jmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        acc = tl.zeros((32, BLOCK_K), dtype=tl.float32)
        start = split * per_split
        end = tl.minimum(start + per_split, T)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tmask = t < end
            t64 = t.to(tl.int64)
            xmask = tmask[:, None] & kmask[None, :]
            du = tl.load(DU + t64[:, None] * 24 + j[None, :], mask=tmask[:, None] & jmask[None, :], other=0.0)
            x = tl.load(X + t64[:, None] * K + k[None, :], mask=xmask, other=0.0).to(tl.float32)
            if HAS_DX:
                coef = tl.load(COEF + t64, mask=tmask, other=0.0)
                dx = tl.dot(du, fn, input_precision="ieee") - coef[:, None] * x
                tl.store(DX + t64[:, None] * K + k[None, :], dx.to(DX.dtype.element_ty), mask=xmask)
            if HAS_DFN:
                acc += tl.dot(tl.trans(du), x, input_precision="ieee")
        if HAS_DFN:
            base = split.to(tl.int64) * 24 * K
            tl.store(PFN + base + j[:, None] * K + k[None, :], acc, mask=jmask[:, None] & kmask[None, :])

    # ---------------------------------------------------------------- collapse / expand

    @triton.autotune(configs=_ELEM_CONFIGS, key=["D"])
    @triton.jit
    def _collapse_fwd_kernel(H, PRE, Y, T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        i4 = tl.arange(0, 4)
        tmask = t < T
        t64 = t.to(tl.int64)
        mask2 = tmask[:, None] & (d[None, :] < D)
        mask3 = mask2[:, None, :]
        h = tl.load(H + t64[:, None, None] * (4 * D) + i4[None, :, None] * D + d[None, None, :], mask=mask3,
                    other=0.0).to(tl.float32)
        pre = tl.load(PRE + t64[:, None] * 4 + i4[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        y = tl.sum(pre[:, :, None] * h, axis=1)
        tl.store(Y + t64[:, None] * D + d[None, :], y.to(Y.dtype.element_ty), mask=mask2)

    @triton.autotune(configs=_ELEM_CONFIGS, key=["D"])
    @triton.jit
    def _collapse_bwd_kernel(H, PRE, DY, DH, DPRE, T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        i4 = tl.arange(0, 4)
        tmask = t < T
        t64 = t.to(tl.int64)
        pre = tl.load(PRE + t64[:, None] * 4 + i4[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        dpre = tl.zeros((BLOCK_T, 4), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask2 = tmask[:, None] & (d[None, :] < D)
            mask3 = mask2[:, None, :]
            off3 = t64[:, None, None] * (4 * D) + i4[None, :, None] * D + d[None, None, :]
            dy = tl.load(DY + t64[:, None] * D + d[None, :], mask=mask2, other=0.0).to(tl.float32)
            h = tl.load(H + off3, mask=mask3, other=0.0).to(tl.float32)
            tl.store(DH + off3, (pre[:, :, None] * dy[:, None, :]).to(DH.dtype.element_ty), mask=mask3)
            dpre += tl.sum(h * dy[:, None, :], axis=2)
        tl.store(DPRE + t64[:, None] * 4 + i4[None, :], dpre.to(DPRE.dtype.element_ty), mask=tmask[:, None])

    @triton.autotune(configs=_ELEM_CONFIGS, key=["D"])
    @triton.jit
    def _expand_fwd_kernel(Y, H, POST, COMB, OUT, T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        i4 = tl.arange(0, 4)
        tmask = t < T
        t64 = t.to(tl.int64)
        mask2 = tmask[:, None] & (d[None, :] < D)
        mask3 = mask2[:, None, :]
        h = tl.load(H + t64[:, None, None] * (4 * D) + i4[None, :, None] * D + d[None, None, :], mask=mask3,
                    other=0.0).to(tl.float32)
        y = tl.load(Y + t64[:, None] * D + d[None, :], mask=mask2, other=0.0).to(tl.float32)
        for j in tl.static_range(4):
            post_j = tl.load(POST + t64 * 4 + j, mask=tmask, other=0.0).to(tl.float32)
            comb_j = tl.load(COMB + t64[:, None] * 16 + i4[None, :] * 4 + j, mask=tmask[:, None],
                             other=0.0).to(tl.float32)  # comb[t, :, j]
            out = post_j[:, None] * y + tl.sum(comb_j[:, :, None] * h, axis=1)
            tl.store(OUT + t64[:, None] * (4 * D) + j * D + d[None, :], out.to(OUT.dtype.element_ty), mask=mask2)

    @triton.autotune(configs=_EXPAND_BWD_CONFIGS, key=["D"])
    @triton.jit
    def _expand_bwd_kernel(Y, H, POST, COMB, DOUT, DY, DH, DPOST, DCOMB, T, D,
                           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        i4 = tl.arange(0, 4)
        tmask = t < T
        t64 = t.to(tl.int64)
        dpost = tl.zeros((BLOCK_T, 4), dtype=tl.float32)
        dcomb = tl.zeros((BLOCK_T, 4, 4), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask2 = tmask[:, None] & (d[None, :] < D)
            mask3 = mask2[:, None, :]
            off3 = t64[:, None, None] * (4 * D) + i4[None, :, None] * D + d[None, None, :]
            h = tl.load(H + off3, mask=mask3, other=0.0).to(tl.float32)
            y = tl.load(Y + t64[:, None] * D + d[None, :], mask=mask2, other=0.0).to(tl.float32)
            dy = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            dh = tl.zeros((BLOCK_T, 4, BLOCK_D), dtype=tl.float32)
            for j in tl.static_range(4):
                g = tl.load(DOUT + t64[:, None] * (4 * D) + j * D + d[None, :], mask=mask2,
                            other=0.0).to(tl.float32)
                post_j = tl.load(POST + t64 * 4 + j, mask=tmask, other=0.0).to(tl.float32)
                comb_j = tl.load(COMB + t64[:, None] * 16 + i4[None, :] * 4 + j, mask=tmask[:, None],
                                 other=0.0).to(tl.float32)
                dy += post_j[:, None] * g
                dh += comb_j[:, :, None] * g[:, None, :]
                dpost += tl.where(i4[None, :] == j, tl.sum(g * y, axis=1)[:, None], 0.0)
                dcomb += tl.where(i4[None, None, :] == j, tl.sum(h * g[:, None, :], axis=2)[:, :, None], 0.0)
            tl.store(DY + t64[:, None] * D + d[None, :], dy.to(DY.dtype.element_ty), mask=mask2)
            tl.store(DH + off3, dh.to(DH.dtype.element_ty), mask=mask3)
        tl.store(DPOST + t64[:, None] * 4 + i4[None, :], dpost.to(DPOST.dtype.element_ty), mask=tmask[:, None])
        tl.store(DCOMB + t64[:, None, None] * 16 + (i4[:, None] * 4 + i4[None, :])[None, :, :],
                 dcomb.to(DCOMB.dtype.element_ty), mask=tmask[:, None, None])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_h(h: torch.Tensor) -> tuple[int, int]:
    if h.dim() < 2 or h.shape[-2] != N_STREAMS:
        raise ValueError(f"mHC kernels need h [..., {N_STREAMS}, D], got {tuple(h.shape)}")
    return math.prod(h.shape[:-2]), h.shape[-1]


# ---------------------------------------------------------------- host code, one custom op per kernel group
# torch.library custom ops (`flashtrain::hc_*`, model/kernels/select.py `kernel_op`): torch.compile treats each
# launch group as one opaque operator instead of tracing into Triton.

def _empty(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=x.device)


@kernel_op("hc_mixes_fwd")
def hc_mixes_fwd_op(x: torch.Tensor, fn32: torch.Tensor, scale32: torch.Tensor, base32: torch.Tensor,
                    norm_eps: float, hc_eps: float, iters: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, 4D] -> pre [T, 4], post [T, 4], comb [T, 16], the mixes m [T, 24] and the rsqrt [T], fp32."""
    T, K = x.shape
    dev = x.device
    pre = torch.empty(T, N_STREAMS, dtype=torch.float32, device=dev)
    post = torch.empty(T, N_STREAMS, dtype=torch.float32, device=dev)
    comb = torch.empty(T, N_STREAMS * N_STREAMS, dtype=torch.float32, device=dev)
    mix = torch.empty(T, N_MIX, dtype=torch.float32, device=dev)
    rs = torch.empty(T, dtype=torch.float32, device=dev)
    if T:
        launch(_mixes_fwd_kernel, lambda meta: (triton.cdiv(T, meta["BLOCK_T"]),),
               x, fn32, scale32, base32, pre, post, comb, mix, rs, T, K, float(norm_eps), float(hc_eps), int(iters))
    return pre, post, comb, mix, rs


@kernel_op("hc_mixes_bwd")
def hc_mixes_bwd_op(x: torch.Tensor, fn32: torch.Tensor, scale32: torch.Tensor, base32: torch.Tensor,
                    mix: torch.Tensor, rs: torch.Tensor, dpre: torch.Tensor, dpost: torch.Tensor, dcomb: torch.Tensor,
                    hc_eps: float, iters: int, need_x: bool, need_fn: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients from (dpre [T, 4], dpost [T, 4], dcomb [T, 16]) fp32 contiguous: dx [T, 4D] in x.dtype
    (empty unless need_x), dfn [24, 4D] fp32 (empty unless need_fn), and the sums over tokens of dbase and of
    da * m [24] fp32 (dscale's parts)."""
    T, K = x.shape
    dev = x.device
    du = torch.empty(T, N_MIX, dtype=torch.float32, device=dev)
    coef = torch.empty(T, dtype=torch.float32, device=dev)
    n_prog = max(1, min(_cdiv(T, 16), _MIXGRAD_PROGRAMS))
    pb = torch.empty(n_prog, N_MIX, dtype=torch.float32, device=dev)
    ps = torch.empty(n_prog, N_MIX, dtype=torch.float32, device=dev)
    if T:
        launch(_mixes_bwd_mix_kernel, (n_prog,), mix, rs, scale32, base32, dpre, dpost, dcomb, du, coef, pb, ps,
               T, K, float(hc_eps), int(iters))
    else:
        pb.zero_()
        ps.zero_()
    dx, dfn = _empty(x), _empty(x)
    if need_x or need_fn:
        dxb = torch.empty(T, K, dtype=x.dtype, device=dev) if need_x else du
        splits = max(1, min(_DFN_SPLITS, _cdiv(T, _DFN_MIN_TOKENS)))
        pfn = torch.empty(splits, N_MIX, K, dtype=torch.float32, device=dev) if need_fn else du
        if T:
            launch(_mixes_bwd_x_kernel, lambda meta: (triton.cdiv(K, meta["BLOCK_K"]), splits),
                   x, fn32, du, coef, dxb, pfn, T, K, _cdiv(T, splits), HAS_DX=bool(need_x), HAS_DFN=bool(need_fn))
        elif need_fn:
            pfn.zero_()
        if need_x:
            dx = dxb
        if need_fn:
            dfn = pfn.sum(0)
    return dx, dfn, pb.sum(0), ps.sum(0)


@kernel_op("hc_collapse_fwd")
def hc_collapse_fwd_op(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """h [..., 4, D], pre [..., 4], both contiguous -> y [..., D] in h.dtype."""
    T, D = _check_h(h)
    y = torch.empty(*h.shape[:-2], D, dtype=h.dtype, device=h.device)
    if T:
        launch(_collapse_fwd_kernel, lambda meta: (triton.cdiv(T, meta["BLOCK_T"]), triton.cdiv(D, meta["BLOCK_D"])),
               h, pre, y, T, D)
    return y


@kernel_op("hc_collapse_bwd")
def hc_collapse_bwd_op(h: torch.Tensor, pre: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    T, D = _check_h(h)
    dh = torch.empty_like(h)
    dpre = torch.empty_like(pre)
    if T:
        launch(_collapse_bwd_kernel, lambda meta: (triton.cdiv(T, meta["BLOCK_T"]),), h, pre, dy, dh, dpre, T, D)
    return dh, dpre


@kernel_op("hc_expand_fwd")
def hc_expand_fwd_op(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """All contiguous: post_j y + sum_i comb_ij h_i -> [..., 4, D] in h.dtype."""
    T, D = _check_h(h)
    out = torch.empty_like(h)
    if T:
        launch(_expand_fwd_kernel, lambda meta: (triton.cdiv(T, meta["BLOCK_T"]), triton.cdiv(D, meta["BLOCK_D"])),
               y, h, post, comb, out, T, D)
    return out


@kernel_op("hc_expand_bwd")
def hc_expand_bwd_op(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, dout: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, D = _check_h(h)
    dy, dh = torch.empty_like(y), torch.empty_like(h)
    dpost, dcomb = torch.empty_like(post), torch.empty_like(comb)
    if T:
        launch(_expand_bwd_kernel, lambda meta: (triton.cdiv(T, meta["BLOCK_T"]),),
               y, h, post, comb, dout, dy, dh, dpost, dcomb, T, D)
    return dy, dh, dpost, dcomb


class _HcMixes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, fn, scale, base, norm_eps, hc_eps, iters):
        T, D = _check_h(h)
        K = N_STREAMS * D
        if tuple(fn.shape) != (N_MIX, K) or scale.numel() != 3 or base.numel() != N_MIX:
            raise ValueError(f"mHC site shapes: fn {tuple(fn.shape)}, scale {tuple(scale.shape)}, "
                             f"base {tuple(base.shape)} for h {tuple(h.shape)}")
        x = h.contiguous().view(T, K)
        fn32 = fn.detach().float().contiguous()
        scale32 = scale.detach().float().contiguous()
        base32 = base.detach().float().contiguous()
        lead = h.shape[:-2]
        pre, post, comb, mix, rs = hc_mixes_fwd_op(x, fn32, scale32, base32, float(norm_eps), float(hc_eps),
                                                   int(iters))
        ctx.save_for_backward(x, fn32, scale32, base32, mix, rs)
        ctx.hc_eps, ctx.iters, ctx.h_shape = float(hc_eps), int(iters), h.shape
        ctx.dtypes = (h.dtype, fn.dtype, scale.dtype, base.dtype)
        return (pre.view(*lead, N_STREAMS), post.view(*lead, N_STREAMS),
                comb.view(*lead, N_STREAMS, N_STREAMS))

    @staticmethod
    def backward(ctx, dpre, dpost, dcomb):
        x, fn32, scale32, base32, mix, rs = ctx.saved_tensors
        need_h, need_fn, need_scale, need_base = ctx.needs_input_grad[:4]
        T, K = x.shape
        dpre = dpre.reshape(T, N_STREAMS).float().contiguous()
        dpost = dpost.reshape(T, N_STREAMS).float().contiguous()
        dcomb = dcomb.reshape(T, N_STREAMS * N_STREAMS).float().contiguous()
        dx, dfn32, pb, ps = hc_mixes_bwd_op(x, fn32, scale32, base32, mix, rs, dpre, dpost, dcomb, ctx.hc_eps,
                                            ctx.iters, bool(need_h), bool(need_fn))
        dh = dx.view(ctx.h_shape) if need_h else None
        dfn = dfn32.to(ctx.dtypes[1]) if need_fn else None
        dscale = dbase = None
        if need_scale:
            dscale = torch.stack([ps[:N_STREAMS].sum(), ps[N_STREAMS:2 * N_STREAMS].sum(),
                                  ps[2 * N_STREAMS:].sum()]).to(ctx.dtypes[2])
        if need_base:
            dbase = pb.to(ctx.dtypes[3])
        return dh, dfn, dscale, dbase, None, None, None


class _HcCollapse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, pre):
        _check_h(h)
        h = h.contiguous()
        pre_c = pre.contiguous()
        y = hc_collapse_fwd_op(h, pre_c)
        ctx.save_for_backward(h, pre_c)
        return y

    @staticmethod
    def backward(ctx, dy):
        h, pre = ctx.saved_tensors
        return hc_collapse_bwd_op(h, pre, dy.contiguous())


class _HcExpand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, h, post, comb):
        _check_h(h)
        y, h, post, comb = y.contiguous(), h.contiguous(), post.contiguous(), comb.contiguous()
        out = hc_expand_fwd_op(y, h, post, comb)
        ctx.save_for_backward(y, h, post, comb)
        return out

    @staticmethod
    def backward(ctx, dout):
        y, h, post, comb = ctx.saved_tensors
        return hc_expand_bwd_op(y, h, post, comb, dout.contiguous())


def hc_mixes_triton(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                    norm_eps: float, hc_eps: float, iters: int):
    """= `model.mhc.hc_mixes`: h [B, S, 4, D] -> (pre [B, S, 4], post [B, S, 4], comb [B, S, 4, 4]), fp32."""
    return _HcMixes.apply(h, fn, scale, base, norm_eps, hc_eps, iters)


def hc_collapse_triton(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """= `model.mhc.hc_collapse`: sum_i pre_i h_i, [B, S, 4, D] x [B, S, 4] -> [B, S, D] in h.dtype."""
    if pre.shape != h.shape[:-1]:
        raise ValueError(f"pre {tuple(pre.shape)} does not match h {tuple(h.shape)}")
    return _HcCollapse.apply(h, pre)


def hc_expand_triton(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """= `model.mhc.hc_expand`: post_j y + sum_i comb_ij h_i -> [B, S, 4, D] in h.dtype."""
    if (y.shape != h.shape[:-2] + h.shape[-1:] or post.shape != h.shape[:-1]
            or comb.shape != h.shape[:-1] + h.shape[-2:-1]):
        raise ValueError(f"expand shapes: y {tuple(y.shape)}, h {tuple(h.shape)}, post {tuple(post.shape)}, "
                         f"comb {tuple(comb.shape)}")
    return _HcExpand.apply(y, h, post, comb)
