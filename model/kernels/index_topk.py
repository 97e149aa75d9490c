"""Fused lightning-indexer selection (V41_SPEC §2): scoring + top-k per query block in one Triton kernel.

Reference: `model.attention.index_select` (plain PyTorch, chunk by chunk). Per query t of batch b

    score(t, j) = sum_h ReLU(q[b, t, h] . k[b, j]) * w[b, t, h]    (fp32; entries j >= n_vis[t] are -inf)

- candidate source (`source_blocks` > 0): the blocks of `block` consecutive entries ranked by their max
  visible score, the block holding entry n_vis[t] - 1 pinned first; the best min(source_blocks,
  ceil(N / block)) block ids, int32, -1 where a block's max is -inf. From the scores before any restriction.
- restriction (`candidates` [B, S, n] block ids, -1 empty): only entries whose block j // block is listed.
- top-k: the `topk` best entries, score descending and ties to the lower index (`top_indices`, a stable
  descending sort), -1 where the selected score is -inf.

`index_topk_triton` returns exactly the reference's indices and candidate blocks, plus the selected
scores (`values`, 0.0 at empty slots: the forward value of the indexer's KL logits).

Design. No [S, heads, N] (nor [S, N]) tensor exists: a program owns BLOCK_M queries and streams over the
keys in tiles of BLOCK_N = 2^LOG_N entries (autotuned; BLOCK_M = 64 // heads, at most 2048 // K, the
heads padded so that BLOCK_M * heads >= 16). One `tl.dot` per tile scores them against all the program's
heads (the tile's entries are the dot's rows, the BLOCK_M * H query heads its columns, fp32 accumulation;
two 16-bit operands of one type go to the tensor cores as they are -- their products are exact in fp32 --
and fp32 operands use IEEE precision, never TF32); ReLU, the head weights and the sum over heads follow
in registers. Each score becomes one int64 key, ordered score bits * 2^31 + (2^31 - 1 - j): the score's
bits mapped to a signed integer with the float order (-0.0 folded into +0.0, which torch's sort treats
as equal) above the inverted entry index. Descending key order is therefore score descending, index
ascending -- the reference's stable order -- and keys are unique. A running buffer of the K best keys
(K = the next power of two >= max(topk, 16)) per query lives in registers, sorted descending; a tile is
merged by the bitonic rule: sort the tile ascending (or, when it is at least K wide, reduce it to its K
best, ascending), take the elementwise max with the buffer's last BLOCK_N slots (the max of a descending
and an ascending sequence holds the K best of both and is bitonic), then one bitonic merge (log2 K
compare-exchange stages). A tile none of whose keys beats its query's K-th best skips the merge. Invisible,
padding and excluded entries get a sentinel key below every real one (-1 / 0.0 in the outputs). The
networks are tl.sort's hypercube formulation with the partner found by a pair sum instead of xor_sum
(see `_exchange`).

- No restriction: grid (query blocks, B); a program visits the tiles below its queries' largest n_vis.
  As the candidate source it also writes each tile's block maxima (a tile is a whole number of blocks,
  each padded to a power of two) into a [B, rows, ceil(N / block)] buffer, launched over query chunks of
  chunk * block rows; the pin and the ranking of the blocks are then the reference's own torch code
  (`top_indices`) on that buffer, so the ties and -1 slots are the reference's by construction.
- Restriction: grid (S, B), one query per program (the dot's columns are its heads); the tiles are
  gathered from the query's block list itself (a tile = BLOCK_N / block listed blocks, up to the last
  listed slot), so only the pool is scored and no membership mask exists. The list's block ids are
  assumed distinct, as the candidate source produces them (a repeated id would be selected twice).
"""

from __future__ import annotations

import torch

from flashtrain.model.kernels.select import HAS_TRITON, interpreting, kernel_op, launch


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best entries of scores [..., N] by value, ties to the lower index (a stable sort: the Triton
    kernel breaks ties the same way, so both paths select the same entries), -1 where the k-th best
    is -inf (nothing left to select)."""
    values, order = scores.sort(dim=-1, descending=True, stable=True)
    return torch.where(values[..., :k] > float("-inf"), order[..., :k], -1)


if HAS_TRITON:
    import triton
    import triton.language as tl

    # below every packed key (the smallest real one holds the ordered bits of -inf, -0x7f800001, << 31);
    # keys lie in [-2^62, 2^62), so the sum of two never overflows int64 (see _exchange)
    _SENT = tl.constexpr(-(2 ** 62))

    # LOG_N: log2 of the key tile (widened to one candidate block when a block is larger). For sm_90 at
    # H = 32, d = 128, bf16, topk = 512 (two queries a program), ptxas gives the top-k kernel 255
    # registers with (6, 8 warps) 8 bytes of spill, (6, 4) none, (7, 8) 656 bytes; the pool kernel
    # 164-187 registers and no spill. Wider tiles amortise the buffer merge (log2 K stages a tile).
    _CONFIGS = ([triton.Config({"LOG_N": 4})] if interpreting() else
                [triton.Config({"LOG_N": n}, num_warps=w, num_stages=2) for n, w in ((6, 8), (6, 4), (7, 8))])
    # A program's running buffer is 2^(LOG_M + LOG_K) int64 keys in registers. The compile gate (sm_90a,
    # train/plan/compile_gate.py): at 1024 keys (exp=flash, 2 queries x top-512) 4 warps take 254-255 registers and
    # no spill; at 2048 (flash_node, 4 queries x top-512) they spill 80-160 bytes: 4 warps only up to 1024 keys.
    _MAX_KEYS_4_WARPS = 1024

    def _prune_configs(configs, named_args, **kwargs):
        keys = 1 << (int(kwargs["LOG_M"]) + int(kwargs["LOG_K"]))
        return [c for c in configs if c.num_warps >= 8 or keys <= _MAX_KEYS_4_WARPS] or configs

    @triton.jit
    def _pack(score, j):
        """(fp32 score, int64 entry index j < 2^31) -> int64 key = ordered score bits * 2^31 + (2^31 - 1 - j):
        descending keys = score descending, index ascending."""
        s = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0
        bits = s.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order = float order
        return (ordered.to(tl.int64) << 31) | (2147483647 - j)

    @triton.jit
    def _unpack(key):
        hi = (key >> 31).to(tl.int32)
        bits = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi)
        return bits.to(tl.float32, bitcast=True), 2147483647 - (key & 2147483647)

    # Bitonic networks on rows, written on the hypercube view ([2] * log2(numel)) like tl.sort, but
    # finding the partner through a sum over the pair's axis (partner = pair sum - self; keys are within
    # +-2^62, so no overflow even under Triton's debug overflow checks) where tl.sort uses xor_sum: one
    # reduction per stage either way on the GPU (ptxas gives both the same registers), and the
    # interpreter runs sums vectorised (its xor_sum is a Python loop per element, ~20x slower here).
    @triton.jit
    def _bit(n: tl.constexpr, i: tl.constexpr):
        """0/1 along the i-th innermost of n hypercube axes, shaped for broadcasting."""
        return tl.reshape(tl.arange(0, 2), [1] * (n - i - 1) + [2] + [1] * i)

    @triton.jit
    def _exchange(h, flip, i: tl.constexpr):
        """Compare-exchange along the i-th innermost axis: the smaller key to the left (flip: right)."""
        n: tl.constexpr = len(h.shape)
        partner = tl.sum(h, axis=n - 1 - i, keep_dims=True) - h
        return tl.where((h > partner) != ((flip ^ _bit(n, i)) != 0), partner, h)

    @triton.jit
    def _merge_stage(h, stage: tl.constexpr, order: tl.constexpr):
        """Bitonic merge of the runs of 2^stage along the innermost axes; order 0 ascending,
        1 descending, 2 alternating between neighbouring runs."""
        if order == 2:
            flip = _bit(len(h.shape), stage)
        else:
            flip = order
        for i in tl.static_range(stage):
            h = _exchange(h, flip, stage - 1 - i)
        return h

    @triton.jit
    def _sort_asc(x, LOG_R: tl.constexpr, LOG_C: tl.constexpr):
        """Rows of x [2^LOG_R, 2^LOG_C] sorted ascending."""
        h = tl.reshape(x, [2] * (LOG_R + LOG_C))
        for i in tl.static_range(1, LOG_C + 1):
            h = _merge_stage(h, i, 2 if i < LOG_C else 0)
        return tl.reshape(h, x.shape)

    @triton.jit
    def _top_asc(x, LOG_R: tl.constexpr, LOG_C: tl.constexpr, LOG_K: tl.constexpr):
        """The 2^LOG_K largest of each row of x [2^LOG_R, 2^LOG_C], ascending: sort runs of 2^LOG_K in
        alternating order, then repeatedly keep the elementwise max of neighbouring runs (bitonic, and
        holding the best 2^LOG_K of both) and merge it."""
        h = tl.reshape(x, [2] * (LOG_R + LOG_C))
        for i in tl.static_range(1, LOG_K + 1):
            h = _merge_stage(h, i, 2 if i < LOG_C else 0)
        for i in tl.static_range(LOG_K + 1, LOG_C + 1):
            h = tl.max(h, axis=len(h.shape) - 1 - LOG_K)
            h = _merge_stage(h, LOG_K, 2 if i < LOG_C else 0)
        return tl.reshape(h, [x.shape[0], 1 << LOG_K])

    @triton.jit
    def _merge(best, keys, LOG_M: tl.constexpr, LOG_T: tl.constexpr, LOG_K: tl.constexpr):
        """best [2^LOG_M, 2^LOG_K] sorted descending, keys [2^LOG_M, 2^LOG_T] -> the 2^LOG_K best of
        both, sorted descending. Skipped (best returned as is) when no key beats its row's last."""
        beats = tl.max(keys, axis=1) > tl.min(best, axis=1)
        if tl.max(beats.to(tl.int32), axis=0) > 0:
            if LOG_T >= LOG_K:
                merged = tl.maximum(best, _top_asc(keys, LOG_M, LOG_T, LOG_K))
            else:  # the tile, ascending, against the buffer's last 2^LOG_T slots
                NS: tl.constexpr = 1 << (LOG_K - LOG_T)
                b3 = tl.reshape(best, [1 << LOG_M, NS, 1 << LOG_T])
                last = (tl.arange(0, NS) == NS - 1)[None, :, None]
                asc = _sort_asc(keys, LOG_M, LOG_T)[:, None, :]
                merged = tl.reshape(tl.where(last, tl.maximum(b3, asc), b3), [1 << LOG_M, 1 << LOG_K])
            h = _merge_stage(tl.reshape(merged, [2] * (LOG_M + LOG_K)), LOG_K, 1)
            # the new buffer is elementwise >= the old one (the i-th best of a superset), so the max
            # changes nothing; it ties the branch's result to the loop-carried layout (without it
            # Triton 3.9's remove-layout-conversions pass fails on this scf.if for sm_90)
            best = tl.maximum(best, tl.reshape(h, [1 << LOG_M, 1 << LOG_K]))
        return best

    @triton.jit
    def _tile_scores(qr, wr, K, kb, j, ok, skn, skd, D, BLOCK_M: tl.constexpr, H_P2: tl.constexpr,
                     D_P2: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr):
        """qr [BLOCK_M * H_P2, D_P2] (query-major rows), wr [BLOCK_M * H_P2] fp32, entries j [TILE] (int64),
        loaded where ok -> scores [BLOCK_M, TILE] fp32 (masked entries score 0: callers mask them).
        The entries are the dot's rows, so the sum over heads runs along its columns (within a warp)."""
        dd = tl.arange(0, D_P2).to(tl.int64)
        kt = tl.load(K + kb + j[:, None] * skn + dd[None, :] * skd, mask=ok[:, None] & (dd < D)[None, :],
                     other=0.0)
        if IEEE:
            s = tl.dot(kt.to(tl.float32), tl.trans(qr), input_precision="ieee")
        else:
            s = tl.dot(kt.to(qr.dtype), tl.trans(qr))
        s = tl.maximum(s, 0.0) * wr[None, :]
        return tl.trans(tl.sum(tl.reshape(s, [TILE, BLOCK_M, H_P2]), axis=2))

    @triton.jit
    def _load_queries(Q, W, b, t, tok, H, D, sqb, sqs, sqh, sqd, swb, sws, swh, BLOCK_M: tl.constexpr,
                      H_P2: tl.constexpr, D_P2: tl.constexpr, IEEE: tl.constexpr):
        """Rows m * H_P2 + h: q [BLOCK_M * H_P2, D_P2] (fp32, or the input's 16-bit type for the tensor
        cores), w [BLOCK_M * H_P2] fp32; padded heads and queries past the end are 0."""
        rows = tl.arange(0, BLOCK_M * H_P2)
        tr = tl.reshape(tl.broadcast_to(t[:, None], [BLOCK_M, H_P2]), [BLOCK_M * H_P2])
        rok = tl.reshape(tl.broadcast_to(tok[:, None], [BLOCK_M, H_P2]), [BLOCK_M * H_P2])
        h = (rows % H_P2).to(tl.int64)
        rok = rok & (h < H)
        dd = tl.arange(0, D_P2).to(tl.int64)
        q = tl.load(Q + b * sqb + tr[:, None] * sqs + h[:, None] * sqh + dd[None, :] * sqd,
                    mask=rok[:, None] & (dd < D)[None, :], other=0.0)
        if IEEE:
            q = q.to(tl.float32)
        w = tl.load(W + b * swb + tr * sws + h * swh, mask=rok, other=0.0).to(tl.float32)
        return q, w

    @triton.jit
    def _store_topk(IDX, VAL, b, t, tok, best, TOPK, sib, sis, svb, svs, K_P2: tl.constexpr):
        score, j = _unpack(best)
        ok = (best > _SENT) & (score > float("-inf"))
        col = tl.arange(0, K_P2)
        m = tok[:, None] & (col < TOPK)[None, :]
        tl.store(IDX + b * sib + t[:, None] * sis + col[None, :], tl.where(ok, j, -1), mask=m)
        tl.store(VAL + b * svb + t[:, None] * svs + col[None, :], tl.where(ok, score, 0.0), mask=m)

    @triton.autotune(configs=_CONFIGS, key=["N", "H", "D", "TOPK", "SEG"],
                     prune_configs_by={"early_config_prune": _prune_configs})
    @triton.jit
    def _index_topk_kernel(Q, W, K, NVIS, IDX, VAL, BMAX, T0, T1, N, H, D, TOPK, SEG, NB,
                           sqb, sqs, sqh, sqd, swb, sws, swh, skb, skn, skd, sib, sis, svb, svs, smb, sms,
                           LOG_M: tl.constexpr, H_P2: tl.constexpr, D_P2: tl.constexpr, LOG_K: tl.constexpr,
                           LOG_SEG: tl.constexpr, DO_TOPK: tl.constexpr, WRITE_BLOCKS: tl.constexpr,
                           IEEE: tl.constexpr, LOG_N: tl.constexpr):
        """Queries T0 + [pid * BLOCK_M, +BLOCK_M) (< T1) of batch row b against all their visible entries.
        A tile is NSEG segments of SEG entries, each padded to 2^LOG_SEG: SEG = block for the candidate
        source (block maxima -> BMAX[b, t - T0, :]), SEG = 1 otherwise."""
        BLOCK_M: tl.constexpr = 1 << LOG_M
        K_P2: tl.constexpr = 1 << LOG_K
        SEG_P2: tl.constexpr = 1 << LOG_SEG
        LOG_T: tl.constexpr = LOG_N if LOG_N > LOG_SEG else LOG_SEG
        TILE: tl.constexpr = 1 << LOG_T
        NSEG: tl.constexpr = TILE // SEG_P2
        b = tl.program_id(1).to(tl.int64)
        t = T0 + tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = t < T1
        nv = tl.minimum(tl.load(NVIS + t, mask=tok, other=0), N).to(tl.int32)  # N < 2^31
        n_hi = tl.max(nv, axis=0)
        qr, wr = _load_queries(Q, W, b, t, tok, H, D, sqb, sqs, sqh, sqd, swb, sws, swh,
                               BLOCK_M, H_P2, D_P2, IEEE)
        seg = tl.arange(0, NSEG).to(tl.int64)
        r = tl.arange(0, SEG_P2)
        offs = tl.reshape(seg[:, None] * SEG + r[None, :], [TILE])
        in_seg = tl.reshape(tl.broadcast_to((r < SEG)[None, :], [NSEG, SEG_P2]), [TILE])
        best = tl.full([BLOCK_M, K_P2], _SENT, tl.int64)
        for s0 in range(0, tl.cdiv(n_hi, SEG), NSEG):
            j = s0 * SEG + offs
            ok = in_seg & (j < N)
            sc = _tile_scores(qr, wr, K, b * skb, j, ok, skn, skd, D, BLOCK_M, H_P2, D_P2, TILE, IEEE)
            vis = ok[None, :] & (j[None, :] < nv[:, None])
            sc = tl.where(vis, sc, float("-inf"))
            if WRITE_BLOCKS:
                bmax = tl.max(tl.reshape(sc, [BLOCK_M, NSEG, SEG_P2]), axis=2)
                blk = s0 + seg
                tl.store(BMAX + b * smb + (t - T0)[:, None] * sms + blk[None, :], bmax,
                         mask=tok[:, None] & (blk < NB)[None, :])
            if DO_TOPK:
                best = _merge(best, tl.where(vis, _pack(sc, j[None, :]), _SENT), LOG_M, LOG_T, LOG_K)
        if DO_TOPK:
            _store_topk(IDX, VAL, b, t, tok, best, TOPK, sib, sis, svb, svs, K_P2)

    @triton.autotune(configs=_CONFIGS, key=["N", "H", "D", "TOPK", "SEG", "NC"])
    @triton.jit
    def _index_topk_pool_kernel(Q, W, K, NVIS, CAND, IDX, VAL, N, H, D, TOPK, SEG, NC,
                                sqb, sqs, sqh, sqd, swb, sws, swh, skb, skn, skd, scb, scs, scn,
                                sib, sis, svb, svs,
                                H_P2: tl.constexpr, D_P2: tl.constexpr, LOG_K: tl.constexpr, LOG_SEG: tl.constexpr,
                                IEEE: tl.constexpr, LOG_N: tl.constexpr):
        """Query t of batch row b against the entries of its listed blocks CAND[b, t, :] (SEG = block)."""
        K_P2: tl.constexpr = 1 << LOG_K
        SEG_P2: tl.constexpr = 1 << LOG_SEG
        LOG_T: tl.constexpr = LOG_N if LOG_N > LOG_SEG else LOG_SEG
        TILE: tl.constexpr = 1 << LOG_T
        NSEG: tl.constexpr = TILE // SEG_P2
        b = tl.program_id(1).to(tl.int64)
        tq = tl.program_id(0).to(tl.int64)
        t = tq + tl.arange(0, 1)
        tok = t >= 0
        nv = tl.minimum(tl.load(NVIS + tq), N).to(tl.int32)
        qr, wr = _load_queries(Q, W, b, t, tok, H, D, sqb, sqs, sqh, sqd, swb, sws, swh, 1, H_P2, D_P2, IEEE)
        cb = CAND + b * scb + tq * scs
        slot = tl.arange(0, NSEG)
        used = tl.zeros([NSEG], tl.int32)  # 1 + the last listed slot (the source lists its blocks first)
        for s0 in range(0, NC, NSEG):
            c = tl.load(cb + (s0 + slot) * scn, mask=s0 + slot < NC, other=-1)
            used = tl.maximum(used, tl.where(c >= 0, s0 + slot + 1, 0))
        n_used = tl.max(used, axis=0)
        r = tl.arange(0, SEG_P2)
        best = tl.full([1, K_P2], _SENT, tl.int64)
        for s0 in range(0, n_used, NSEG):
            c = tl.load(cb + (s0 + slot) * scn, mask=s0 + slot < NC, other=-1).to(tl.int64)
            j2 = c[:, None] * SEG + r[None, :]
            ok2 = (c >= 0)[:, None] & (r < SEG)[None, :] & (j2 < nv)
            j = tl.reshape(j2, [TILE])
            ok = tl.reshape(ok2, [TILE])
            sc = _tile_scores(qr, wr, K, b * skb, j, ok, skn, skd, D, 1, H_P2, D_P2, TILE, IEEE)
            best = _merge(best, tl.where(ok[None, :], _pack(sc, j[None, :]), _SENT), 0, LOG_T, LOG_K)
        _store_topk(IDX, VAL, b, t, tok, best, TOPK, sib, sis, svb, svs, K_P2)


def _log2_p2(n: int) -> int:
    """log2 of the smallest power of two >= n (n >= 1)."""
    return max(0, int(n) - 1).bit_length()


def index_topk_triton(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, n_vis: torch.Tensor, topk: int,
                      chunk: int, candidates: torch.Tensor | None, block: int, source_blocks: int):
    """Same arguments as `model.attention.index_select`: q [B, S, H, d], w [B, S, H], index keys k [B, N, d],
    n_vis [S]. Returns (top-k indices [B, S, topk] int64 (-1 empty), their scores [B, S, topk] fp32
    (0.0 at empty slots), candidate blocks [B, S, min(source_blocks, ceil(N / block))] int32 (-1 empty)
    when `source_blocks` > 0, else None). `chunk` only sizes the candidate source's block-maxima buffer."""
    B, S, H, d = q.shape
    N = k.shape[1]
    dev = q.device
    idx = torch.empty(B, S, topk, dtype=torch.long, device=dev)
    vals = torch.empty(B, S, topk, dtype=torch.float32, device=dev)
    nb = -(-N // block) if source_blocks or candidates is not None else 0
    cands = (torch.empty(B, S, min(source_blocks, nb), dtype=torch.int32, device=dev)
             if source_blocks else None)
    if B == 0 or S == 0 or (topk == 0 and not source_blocks):
        return idx, vals, cands
    if N == 0:
        idx.fill_(-1)
        vals.zero_()
        cands = None if cands is None else cands.fill_(-1)
        return idx, vals, cands
    n_vis = n_vis.to(device=dev, dtype=torch.long).contiguous()
    # fp32 operands at IEEE precision; two 16-bit operands of one type go to the tensor cores as they are
    # (exact products, fp32 accumulation)
    ieee = not (q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16))
    log_k = max(4, _log2_p2(max(topk, 1)))  # the running buffer: >= topk slots, >= 16
    common = dict(D_P2=max(16, 1 << _log2_p2(d)), LOG_K=log_k, IEEE=ieee)
    qs, ws, ks = (*q.stride(),), (*w.stride(),), (*k.stride(),)
    outs = (idx.stride(0), idx.stride(1), vals.stride(0), vals.stride(1))

    restrict = candidates is not None and topk > 0
    if source_blocks or not restrict:
        h_p2 = 1 << _log2_p2(H)
        # queries per program: their heads are the rows of the dot (<= 64), their buffers <= 2048 keys
        log_m = max(1, min(64 // h_p2, 2048 >> log_k)).bit_length() - 1
        h_p2 = max(h_p2, 16 >> log_m)  # tl.dot wants >= 16 rows: pad heads (zero weights)
        do_topk = topk > 0 and not restrict

        def run(t0, t1, bmax, seg, nblocks, write):
            grid = (triton.cdiv(t1 - t0, 1 << log_m), B)
            sm = bmax.stride()[:2] if write else (0, 0)
            launch(_index_topk_kernel, grid, q, w, k, n_vis, idx, vals, bmax, t0, t1, N, H, d, topk, seg, nblocks,
                   *qs, *ws, *ks, *outs, *sm, LOG_M=log_m, H_P2=h_p2,
                   LOG_SEG=_log2_p2(seg), DO_TOPK=do_topk, WRITE_BLOCKS=write, **common)

        if source_blocks:
            # chunk * block queries a launch: their block maxima are as many numbers as the reference's
            # score chunk [B, chunk, N]
            rows = max(1, chunk * block)
            for t0 in range(0, S, rows):
                t1 = min(S, t0 + rows)
                bmax = torch.full((B, t1 - t0, nb), float("-inf"), dtype=torch.float32, device=dev)
                run(t0, t1, bmax, block, nb, True)
                newest = ((n_vis[t0:t1] - 1) // block).unsqueeze(-1)  # -1: nothing visible, nothing pinned
                bmax.masked_fill_(torch.arange(nb, device=dev) == newest, float("inf"))
                cands[:, t0:t1] = top_indices(bmax, cands.shape[-1]).to(torch.int32)
        else:
            run(0, S, vals, 1, 0, False)
    if restrict:
        cand = candidates.to(device=dev, dtype=torch.int32)
        launch(_index_topk_pool_kernel, (S, B), q, w, k, n_vis, cand, idx, vals, N, H, d, topk, block,
               cand.shape[-1], *qs, *ws, *ks, *cand.stride(), *outs, H_P2=max(16, 1 << _log2_p2(H)),
               LOG_SEG=_log2_p2(block), **common)
    return idx, vals, cands


@kernel_op("index_topk")
def index_topk_op(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, n_vis: torch.Tensor, topk: int, chunk: int,
                  candidates: torch.Tensor | None, block: int, source_blocks: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`index_topk_triton` as a torch.library custom op (model/kernels/select.py `kernel_op`: opaque to
    torch.compile), with an empty int32 candidate tensor [0] where it has none."""
    idx, vals, cands = index_topk_triton(q, w, k, n_vis, topk, chunk, candidates, block, source_blocks)
    return idx, vals, torch.empty(0, dtype=torch.int32, device=q.device) if cands is None else cands
