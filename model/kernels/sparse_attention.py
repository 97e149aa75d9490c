"""Triton kernels of the CSA2 sparse-attention core (model/sparse_attention.py, `sparse_attention_lean`).

Per query t (window_kv row t + q_offset) and head h, one softmax over the window band (rows p with
t + q_offset - window < p <= t + q_offset), the selected compressed entries comp_kv[b, topk[b, t, j]]
(topk = -1: empty, excluded) and a sink logit sink[h] (denominator only); K = V, one latent of D
channels shared by all heads.

Forward, `_sparse_attn_fwd`, one program per (query, batch): for each block of BLOCK_H heads one online
softmax over the window band in tiles of BLOCK_N rows, then over the selected compressed entries in
tiles of BLOCK_N slots (rows gathered by index, masked where the index is empty), then the sink; the K
tile is loaded once per head block and used for all its heads (logits = tl.dot(q [BLOCK_H, D], K^T)).
A second pass over the compressed tiles, with the final log-sum-exp, writes the head-summed
probabilities of the slots (the indexer KL's target); a later head block adds to what an earlier one
of the same program wrote (after a CTA barrier), so no atomics are needed, the sum is deterministic and
a rerun (autotuning) writes the same values.

Backward, FlashAttention-style from the saved log-sum-exp: with P = exp(logit - lse) and
Delta = rowsum(dout * out), dS = P (dout K^T - Delta), dq = scale dS K, dK = scale dS^T q + P^T dout.
- `_sparse_attn_bwd_q`, one program per (query, batch), head blocks in a loop: dq (window and
  compressed tiles) written once, Delta and the sink's per-(query, head) gradient -P_sink Delta written
  to [B, S, H] buffers (the host sums the latter), and the compressed rows' dK added with fp32 atomics
  into a [B, N, D] buffer (one [BLOCK_N, D] tile per head block and compressed tile).
- `_sparse_attn_bwd_kv`, key-major, one program per (BLOCK_N window rows, batch): loops over the queries
  that see any of its rows and over all head blocks, accumulates the rows' dK in registers and stores it
  once (no atomics; rows no query sees get zeros).
Nothing of size [S, H, window + k] is ever materialised. Loads are cast to the input dtype of q for the
tile products (bf16 on GPU, FlashAttention-style: P and dS are rounded to it before their products),
accumulation is fp32; fp32 inputs use IEEE-precision products (no TF32). Offsets that can pass 2^31
(batch and query strides, gathered row indices) are int64.
"""

from __future__ import annotations

import torch

from flashtrain.model.kernels.select import HAS_TRITON, interpreting, kernel_op, launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    if interpreting():
        _FWD_CONFIGS = [triton.Config({"BLOCK_H": 16, "BLOCK_N": 16})]
        _BWD_Q_CONFIGS = [triton.Config({"BLOCK_H": 16, "BLOCK_N": 16})]
        _BWD_KV_CONFIGS = [triton.Config({"BLOCK_H": 16, "BLOCK_N": 16})]
    else:
        _FWD_CONFIGS = [triton.Config({"BLOCK_H": h, "BLOCK_N": n}, num_warps=w, num_stages=s)
                        for h, n, w, s in ((16, 32, 4, 2), (16, 64, 8, 2), (16, 32, 8, 1), (32, 32, 8, 2),
                                           (32, 64, 8, 1), (64, 32, 8, 1))]
        # (16, 32, 4 warps, 2 stages) spilled 40-56 bytes at D = 256 and 424-444 at D = 512 (compile gate): dropped
        _BWD_Q_CONFIGS = [triton.Config({"BLOCK_H": h, "BLOCK_N": n}, num_warps=w, num_stages=s)
                          for h, n, w, s in ((16, 16, 4, 1), (16, 32, 8, 1), (32, 32, 8, 1), (64, 16, 8, 1))]
        _BWD_KV_CONFIGS = [triton.Config({"BLOCK_H": h, "BLOCK_N": n}, num_warps=w, num_stages=s)
                           for h, n, w, s in ((16, 16, 4, 1), (16, 32, 8, 1), (32, 32, 8, 1), (64, 16, 8, 1),
                                              (64, 32, 8, 1))]

    # Register footprint at D = 512 (exp=flash; train/plan/compile_gate.py, docs/kernels.md): with 4 warps every
    # config spills in bf16 (forward (16, 32): 44-48 bytes; backward query kernel (16, 16): 8-32, (16, 32):
    # 424-444; key kernel (16, 16): 8), and the backward query kernel's (32, 32, 8 warps) spills 60-76 bytes:
    # at D >= 512 only 8 warps, and the query kernel's BLOCK_H x BLOCK_N <= 512 (its dq, q, dout [BLOCK_H, D]
    # and k [BLOCK_N, D] tiles live together).
    _WIDE_D = 512
    _BWD_Q_WIDE_TILE = 512
    # Spills the compile gate measured and accepts (train/plan/compile_gate.py): one 4-byte word in the key kernel's
    # (16, 32, 8 warps) at D = 256 on sm_90a (flash_node), where the only other config its prune keeps is
    # (16, 16, 4 warps)
    SPILLS_MEASURED = {("_sparse_attn_bwd_kv", "BLOCK_H=16, BLOCK_N=32, num_warps=8, num_stages=1", "sm_90a"): 4}

    def _prune_configs(configs, named_args, **kwargs):
        """Drop head blocks wider than the (padded) head count (they would only add masked work) and tiles
        whose register footprint at this head dim would spill ([BLOCK_H, D] and [BLOCK_N, D] tiles; 4 warps
        at D >= 512)."""
        cap = max(16, triton.next_power_of_2(int(named_args["H"])))
        block_d = max(16, triton.next_power_of_2(int(named_args["D"])))
        kept = [c for c in configs if c.kwargs["BLOCK_H"] <= cap and c.kwargs["BLOCK_H"] * block_d <= 16384
                and c.kwargs["BLOCK_N"] * block_d <= 32768 and (block_d < _WIDE_D or c.num_warps == 8)]
        return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_H"] * c.kwargs["BLOCK_N"])]

    def _prune_bwd_q(configs, named_args, **kwargs):
        """`_prune_configs`, and at D >= 512 head blocks x key tiles of at most 512."""
        block_d = max(16, triton.next_power_of_2(int(named_args["D"])))
        kept = [c for c in _prune_configs(configs, named_args, **kwargs)
                if block_d < _WIDE_D or c.kwargs["BLOCK_H"] * c.kwargs["BLOCK_N"] <= _BWD_Q_WIDE_TILE]
        return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_H"] * c.kwargs["BLOCK_N"])]

    @triton.jit
    def _online_tile(m, l, acc, s, k, PREC: tl.constexpr):
        """One online-softmax step: logits s [BLOCK_H, BLOCK_N] (-inf where masked), values k [BLOCK_N, D]."""
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None], input_precision=PREC)
        return m_new, l, acc

    @triton.autotune(configs=_FWD_CONFIGS, key=["H", "D", "K", "window"],
                     prune_configs_by={"early_config_prune": _prune_configs})
    @triton.jit
    def _sparse_attn_fwd(Q, KV, COMP, TOPK, SINK, OUT, LSE, TARGET,
                         H, D, K, N, window, q_offset, scale,
                         sqb, sqs, sqh, sqd, skb, skn, skd, scb, scn, scd, stb, sts, stk,
                         sob, sos, soh, sod, slb, sls, slh, sgb, sgs, sgk,
                         HAS_COMP: tl.constexpr, PREC: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        t = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        t64 = t.to(tl.int64)
        pos = t + q_offset
        lo = tl.maximum(pos - window + 1, 0)
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < D
        nn = tl.arange(0, BLOCK_N)
        q_row = Q + b * sqb + t64 * sqs
        kv_b = KV + b * skb
        comp_b = COMP + b * scb
        topk_row = TOPK + b * stb + t64 * sts
        for h0 in range(0, H, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            hmask = heads < H
            q = tl.load(q_row + heads[:, None] * sqh + dd[None, :] * sqd, mask=hmask[:, None] & dmask[None, :],
                        other=0.0)
            # the running maximum starts finite: a tile with every logit masked (-inf) then adds 0, not NaN
            m = tl.full([BLOCK_H], -1.0e30, tl.float32)
            l = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            for n0 in range(lo, pos + 1, BLOCK_N):
                rows = n0 + nn
                rmask = rows <= pos
                k = tl.load(kv_b + rows.to(tl.int64)[:, None] * skn + dd[None, :] * skd,
                            mask=rmask[:, None] & dmask[None, :], other=0.0).to(q.dtype)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
                s = tl.where(rmask[None, :], s, float("-inf"))
                m, l, acc = _online_tile(m, l, acc, s, k, PREC)
            if HAS_COMP:
                for j0 in range(0, K, BLOCK_N):
                    jj = j0 + nn
                    idx = tl.load(topk_row + jj * stk, mask=jj < K, other=-1).to(tl.int64)
                    valid = (idx >= 0) & (idx < N)
                    k = tl.load(comp_b + idx[:, None] * scn + dd[None, :] * scd,
                                mask=valid[:, None] & dmask[None, :], other=0.0).to(q.dtype)
                    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
                    s = tl.where(valid[None, :], s, float("-inf"))
                    m, l, acc = _online_tile(m, l, acc, s, k, PREC)
            sink = tl.load(SINK + heads, mask=hmask, other=0.0).to(tl.float32)
            m_f = tl.maximum(m, sink)
            corr = tl.exp(m - m_f)
            l_f = l * corr + tl.exp(sink - m_f)
            lse = m_f + tl.log(l_f)
            o = acc * (corr / l_f)[:, None]
            tl.store(OUT + b * sob + t64 * sos + heads[:, None] * soh + dd[None, :] * sod,
                     o.to(OUT.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
            tl.store(LSE + b * slb + t64 * sls + heads * slh, lse, mask=hmask)
            if HAS_COMP:
                # the slots' probabilities need the final lse: a second pass over the compressed tiles.
                # The barrier makes the previous head block's target stores visible to every thread of
                # the program before they are read back below (a no-op under the interpreter).
                tl.debug_barrier()
                for j0 in range(0, K, BLOCK_N):
                    jj = j0 + nn
                    jmask = jj < K
                    idx = tl.load(topk_row + jj * stk, mask=jmask, other=-1).to(tl.int64)
                    valid = (idx >= 0) & (idx < N)
                    k = tl.load(comp_b + idx[:, None] * scn + dd[None, :] * scd,
                                mask=valid[:, None] & dmask[None, :], other=0.0).to(q.dtype)
                    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
                    p = tl.where(hmask[:, None] & valid[None, :], tl.exp(s - lse[:, None]), 0.0)
                    t_ptr = TARGET + b * sgb + t64 * sgs + jj * sgk
                    # the first head block stores, later ones add (the program owns this row of target)
                    prev = tl.load(t_ptr, mask=jmask & (h0 > 0), other=0.0)
                    tl.store(t_ptr, prev + tl.sum(p, 0), mask=jmask)

    @triton.autotune(configs=_BWD_Q_CONFIGS, key=["H", "D", "K", "window"], reset_to_zero=["DCOMP"],
                     prune_configs_by={"early_config_prune": _prune_bwd_q})
    @triton.jit
    def _sparse_attn_bwd_q(Q, KV, COMP, TOPK, SINK, OUT, DOUT, LSE, DQ, DCOMP, DELTA, DSINK,
                           S, H, D, K, N, window, q_offset, scale,
                           sqb, sqs, sqh, sqd, skb, skn, skd, scb, scn, scd, stb, sts, stk,
                           sob, sos, soh, sod, sdb, sds, sdh, sdd, slb, sls, slh,
                           HAS_COMP: tl.constexpr, PREC: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        """DQ [B, S, H, D], DELTA and DSINK [B, S, H] fp32 contiguous; DCOMP [B, N, D] fp32 contiguous,
        zeroed (atomics)."""
        t = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        t64 = t.to(tl.int64)
        pos = t + q_offset
        lo = tl.maximum(pos - window + 1, 0)
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < D
        nn = tl.arange(0, BLOCK_N)
        kv_b = KV + b * skb
        comp_b = COMP + b * scb
        dcomp_b = DCOMP + b * N * D
        topk_row = TOPK + b * stb + t64 * sts
        row_bsh = (b * S + t64) * H  # [B, S, H] buffers, and DQ's row / H
        for h0 in range(0, H, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            hmask = heads < H
            qd_mask = hmask[:, None] & dmask[None, :]
            q = tl.load(Q + b * sqb + t64 * sqs + heads[:, None] * sqh + dd[None, :] * sqd, mask=qd_mask, other=0.0)
            do = tl.load(DOUT + b * sdb + t64 * sds + heads[:, None] * sdh + dd[None, :] * sdd, mask=qd_mask,
                         other=0.0).to(q.dtype)
            o = tl.load(OUT + b * sob + t64 * sos + heads[:, None] * soh + dd[None, :] * sod, mask=qd_mask,
                        other=0.0).to(tl.float32)
            delta = tl.sum(do.to(tl.float32) * o, 1)
            lse = tl.load(LSE + b * slb + t64 * sls + heads * slh, mask=hmask, other=0.0)
            dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            for n0 in range(lo, pos + 1, BLOCK_N):
                rows = n0 + nn
                rmask = rows <= pos
                k = tl.load(kv_b + rows.to(tl.int64)[:, None] * skn + dd[None, :] * skd,
                            mask=rmask[:, None] & dmask[None, :], other=0.0).to(q.dtype)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
                p = tl.where(hmask[:, None] & rmask[None, :], tl.exp(s - lse[:, None]), 0.0)
                dp = tl.dot(do, tl.trans(k), input_precision=PREC)
                ds = p * (dp - delta[:, None])
                dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
            if HAS_COMP:
                for j0 in range(0, K, BLOCK_N):
                    jj = j0 + nn
                    idx = tl.load(topk_row + jj * stk, mask=jj < K, other=-1).to(tl.int64)
                    valid = (idx >= 0) & (idx < N)
                    kmask = valid[:, None] & dmask[None, :]
                    k = tl.load(comp_b + idx[:, None] * scn + dd[None, :] * scd, mask=kmask, other=0.0).to(q.dtype)
                    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
                    p = tl.where(hmask[:, None] & valid[None, :], tl.exp(s - lse[:, None]), 0.0)
                    dp = tl.dot(do, tl.trans(k), input_precision=PREC)
                    ds = p * (dp - delta[:, None])
                    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
                    dk = tl.dot(tl.trans((ds * scale).to(q.dtype)), q, input_precision=PREC)
                    dk = tl.dot(tl.trans(p.to(q.dtype)), do, dk, input_precision=PREC)
                    tl.atomic_add(dcomp_b + idx[:, None] * D + dd[None, :], dk, mask=kmask, sem="relaxed")
            tl.store(DQ + (row_bsh + heads)[:, None] * D + dd[None, :], dq * scale, mask=qd_mask)
            sink = tl.load(SINK + heads, mask=hmask, other=0.0).to(tl.float32)
            tl.store(DELTA + row_bsh + heads, delta, mask=hmask)
            tl.store(DSINK + row_bsh + heads, -tl.exp(sink - lse) * delta, mask=hmask)

    @triton.autotune(configs=_BWD_KV_CONFIGS, key=["H", "D", "window"],
                     prune_configs_by={"early_config_prune": _prune_configs})
    @triton.jit
    def _sparse_attn_bwd_kv(Q, KV, DOUT, LSE, DELTA, DKV,
                            S, H, D, L, window, q_offset, scale,
                            sqb, sqs, sqh, sqd, skb, skn, skd, sdb, sds, sdh, sdd, slb, sls, slh,
                            PREC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_N: tl.constexpr):
        """dK of BLOCK_N window rows: DKV [B, L, D] fp32 contiguous, every row written; DELTA [B, S, H] fp32
        contiguous (from _sparse_attn_bwd_q)."""
        n0 = tl.program_id(0) * BLOCK_N
        b = tl.program_id(1).to(tl.int64)
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < D
        rows = n0 + tl.arange(0, BLOCK_N)
        rmask = rows < L
        kmask = rmask[:, None] & dmask[None, :]
        k = tl.load(KV + b * skb + rows.to(tl.int64)[:, None] * skn + dd[None, :] * skd, mask=kmask, other=0.0)
        k = k.to(Q.dtype.element_ty)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        # the queries (at rows pos = t + q_offset) that see a row p: p <= pos < p + window
        first = tl.maximum(n0, q_offset)
        last = tl.minimum(n0 + BLOCK_N + window - 2, q_offset + S - 1)
        for pos in range(first, last + 1):
            t64 = (pos - q_offset).to(tl.int64)
            band = rmask & (rows <= pos) & (rows > pos - window)
            for h0 in range(0, H, BLOCK_H):
                heads = h0 + tl.arange(0, BLOCK_H)
                hmask = heads < H
                qd_mask = hmask[:, None] & dmask[None, :]
                q = tl.load(Q + b * sqb + t64 * sqs + heads[:, None] * sqh + dd[None, :] * sqd, mask=qd_mask,
                            other=0.0)
                do = tl.load(DOUT + b * sdb + t64 * sds + heads[:, None] * sdh + dd[None, :] * sdd, mask=qd_mask,
                             other=0.0).to(q.dtype)
                lse = tl.load(LSE + b * slb + t64 * sls + heads * slh, mask=hmask, other=0.0)
                delta = tl.load(DELTA + (b * S + t64) * H + heads, mask=hmask, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
                p = tl.where(hmask[:, None] & band[None, :], tl.exp(s - lse[:, None]), 0.0)
                dp = tl.dot(do, tl.trans(k), input_precision=PREC)
                ds = p * (dp - delta[:, None]) * scale
                dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PREC)
                dk = tl.dot(tl.trans(p.to(q.dtype)), do, dk, input_precision=PREC)
        tl.store(DKV + (b * L + rows.to(tl.int64))[:, None] * D + dd[None, :], dk, mask=kmask)


def _check(q: torch.Tensor, window_kv: torch.Tensor, comp_kv, topk, sink: torch.Tensor, q_offset: int):
    if not HAS_TRITON:
        raise RuntimeError("the sparse-attention kernels need triton (pip install triton)")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"sparse-attention kernels take fp32, bf16 or fp16 inputs, not {q.dtype}")
    B, S, H, D = q.shape
    if window_kv.shape[0] != B or window_kv.shape[2] != D or window_kv.shape[1] < q_offset + S:
        raise ValueError(f"window_kv {tuple(window_kv.shape)} does not fit q {tuple(q.shape)} with q_offset {q_offset}")
    if sink.shape != (H,):
        raise ValueError(f"sink {tuple(sink.shape)}: expected ({H},)")
    has_comp = topk is not None and topk.shape[-1] > 0
    if has_comp:
        if comp_kv is None or comp_kv.shape[0] != B or comp_kv.shape[2] != D:
            raise ValueError("topk needs comp_kv [B, N, D]")
        if topk.shape[:2] != (B, S) or topk.is_floating_point():
            raise ValueError(f"topk {tuple(topk.shape)} {topk.dtype}: expected integer [B, S, k]")
    return has_comp


def _rows_in(q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | None:
    """K = V rows in q's dtype: the kernels round every loaded row to it before its products anyway, so this
    changes no value; it halves the bytes gathered for fp32 rows (the compressed KV of a Full layer under
    autocast) and leaves one kernel variant per dtype. The compile gate's report showed the fp32-row variant
    at D = 512 spilling 184-608 bytes in 4 of 5 forward and 3 of 4 backward configs (bf16 rows: 0-76) and
    needing up to 224 KiB of shared memory (docs/kernels.md)."""
    return rows if rows is None or rows.dtype == q.dtype else rows.to(q.dtype)


def _common(q: torch.Tensor, D: int):
    block_d = max(16, triton.next_power_of_2(D))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # "tf32" only names the default; bf16 products are exact
    return block_d, prec


def sparse_attention_fwd_triton(q: torch.Tensor, window_kv: torch.Tensor, comp_kv: torch.Tensor | None,
                                topk: torch.Tensor | None, sink: torch.Tensor, window: int, scale: float,
                                q_offset: int = 0):
    """q [B, S, H, D], window_kv [B, >= q_offset + S, D], comp_kv [B, N, D] and topk [B, S, k] (-1 = empty) or
    None, sink [H]. Returns (out [B, S, H, D] in q.dtype, lse [B, S, H] fp32, target [B, S, k] fp32: the
    head-summed probabilities of the compressed slots, [B, S, 0] without them)."""
    has_comp = _check(q, window_kv, comp_kv, topk, sink, q_offset)
    window_kv, comp_kv = _rows_in(q, window_kv), _rows_in(q, comp_kv)
    B, S, H, D = q.shape
    k_sel = topk.shape[-1] if has_comp else 0
    out = torch.empty_like(q)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    target = torch.zeros(B, S, k_sel, dtype=torch.float32, device=q.device)
    if B * S * H == 0:
        return out, lse, target
    comp = comp_kv if has_comp else q
    idx = topk if has_comp else lse
    cs = comp_kv.stride() if has_comp else (0, 0, 0)
    ts = topk.stride() if has_comp else (0, 0, 0)
    gs = target.stride() if has_comp else (0, 0, 0)
    N = comp_kv.shape[1] if has_comp else 0
    sink = sink.contiguous()
    block_d, prec = _common(q, D)
    launch(_sparse_attn_fwd, (S, B), q, window_kv, comp, idx, sink, out, lse, target,
           H, D, k_sel, N, window, q_offset, float(scale),
           *q.stride(), *window_kv.stride(), *cs, *ts, *out.stride(), *lse.stride(), *gs,
           HAS_COMP=has_comp, PREC=prec, BLOCK_D=block_d)
    return out, lse, target


def sparse_attention_bwd_triton(q: torch.Tensor, window_kv: torch.Tensor, comp_kv: torch.Tensor | None,
                                topk: torch.Tensor | None, sink: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                dout: torch.Tensor, window: int, scale: float, q_offset: int = 0):
    """Gradients of sparse_attention_fwd_triton's out given dout [B, S, H, D] and its saved lse [B, S, H]:
    (dq [B, S, H, D], dwindow_kv like window_kv, dcomp_kv like comp_kv or None, dsink [H]), all fp32."""
    has_comp = _check(q, window_kv, comp_kv, topk, sink, q_offset)
    window_kv, comp_kv = _rows_in(q, window_kv), _rows_in(q, comp_kv)
    B, S, H, D = q.shape
    L = window_kv.shape[1]
    dev = q.device
    k_sel = topk.shape[-1] if has_comp else 0
    N = comp_kv.shape[1] if has_comp else 0
    lse = lse.float()
    dq = torch.empty(B, S, H, D, dtype=torch.float32, device=dev)
    dwin = torch.empty(B, L, D, dtype=torch.float32, device=dev)
    dcomp = torch.zeros(B, N, D, dtype=torch.float32, device=dev) if has_comp else None
    if B * S * H == 0:
        return dq, dwin.zero_(), dcomp, torch.zeros(H, dtype=torch.float32, device=dev)
    delta = torch.empty(B, S, H, dtype=torch.float32, device=dev)
    dsink_part = torch.empty(B, S, H, dtype=torch.float32, device=dev)
    comp = comp_kv if has_comp else q
    idx = topk if has_comp else lse
    cs = comp_kv.stride() if has_comp else (0, 0, 0)
    ts = topk.stride() if has_comp else (0, 0, 0)
    sink = sink.contiguous()
    block_d, prec = _common(q, D)
    launch(_sparse_attn_bwd_q, (S, B), q, window_kv, comp, idx, sink, out, dout, lse, dq,
           dcomp if has_comp else torch.zeros(1, dtype=torch.float32, device=dev),
           delta, dsink_part, S, H, D, k_sel, N, window, q_offset, float(scale),
           *q.stride(), *window_kv.stride(), *cs, *ts, *out.stride(), *dout.stride(),
           *lse.stride(), HAS_COMP=has_comp, PREC=prec, BLOCK_D=block_d)

    def grid(meta):
        return (triton.cdiv(L, meta["BLOCK_N"]), B)

    launch(_sparse_attn_bwd_kv, grid, q, window_kv, dout, lse, delta, dwin, S, H, D, L, window, q_offset,
           float(scale), *q.stride(), *window_kv.stride(), *dout.stride(), *lse.stride(), PREC=prec, BLOCK_D=block_d)
    return dq, dwin, dcomp, dsink_part.sum(dim=(0, 1))


# The host functions as torch.library custom ops (model/kernels/select.py `kernel_op`): torch.compile sees one
# opaque operator per direction and never traces into Triton. model/sparse_attention.py calls these.
@kernel_op("sparse_attention_fwd")
def sparse_attention_fwd_op(q: torch.Tensor, window_kv: torch.Tensor, comp_kv: torch.Tensor | None,
                            topk: torch.Tensor | None, sink: torch.Tensor, window: int, scale: float, q_offset: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return sparse_attention_fwd_triton(q, window_kv, comp_kv, topk, sink, window, scale, q_offset)


@kernel_op("sparse_attention_bwd")
def sparse_attention_bwd_op(q: torch.Tensor, window_kv: torch.Tensor, comp_kv: torch.Tensor | None,
                            topk: torch.Tensor | None, sink: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                            dout: torch.Tensor, window: int, scale: float, q_offset: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As sparse_attention_bwd_triton, with an empty dcomp [0] where it has none (an op returns tensors)."""
    dq, dwin, dcomp, dsink = sparse_attention_bwd_triton(q, window_kv, comp_kv, topk, sink, out, lse, dout, window,
                                                         scale, q_offset)
    return dq, dwin, torch.empty(0, dtype=torch.float32, device=q.device) if dcomp is None else dcomp, dsink
