"""The CSA2 sparse-attention core (V41_SPEC §1-2): per query one softmax over its window slots, its
selected compressed slots and a per-head sink logit (exp(sink) in the denominator, no value); K = V
(one shared latent for all heads, MQA-like).

Two implementations, side by side (DESIGN.md "Memory"):
- `sparse_attention`: the plain-PyTorch reference for one chunk of queries. Autograd keeps every
  intermediate for backward: the logits / probabilities [C, H, W + k] and the gathered compressed
  entries [C, k, D] of each chunk -- at 64K tokens and k = 512 that is 64 GiB of gathered KV alone.
- `sparse_attention_lean`: the training path. One autograd function over the whole sequence that saves
  only q, the output, the log-sum-exp per (query, head) and the selected indices (the KV tensors and
  the sink are its inputs, saved by reference) and recomputes logits and gathered entries chunk by
  chunk in backward, FlashAttention-style. With P = exp(logits - lse) and D = rowsum(dout * out):
      dS = P * (dout V^T - D),  dq = scale dS K,  dK = scale dS^T q + P^T dout  (K = V),
      d sink_h = -sum over queries of P_sink * D.
  It also returns the head-summed probabilities of the selected compressed slots [B, S, k] (no
  gradient), the indexer KL's target, instead of keeping [B, S, H, k].
The window part is a band: a chunk's queries against the contiguous key range [t0 - W + 1, t1),
masked to t - W < p <= t; the compressed part gathers each query's k entries once for all heads.

On CUDA (or CPU tensors under TRITON_INTERPRET=1) `sparse_attention_lean` runs the Triton kernels of
model/kernels/sparse_attention.py instead of the chunked PyTorch loops (`use_triton`, decided by
model.kernels.select.use_triton): `sparse_attention_fwd_triton`, one online softmax per (query, head
block) over the window band and the gathered compressed entries in tiles, and
`sparse_attention_bwd_triton`, recomputing P from the same saved log-sum-exp (dq and the compressed
rows' dK query-major, the latter with fp32 atomics; the window rows' dK key-major). Same math, same
saved tensors; `chunk` only sizes the PyTorch path's chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtrain.model.chunks import query_chunks
from flashtrain.model.kernels.select import use_triton as _select_triton
from flashtrain.model.kernels.sparse_attention import sparse_attention_bwd_op, sparse_attention_fwd_op


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table [B, N, D], idx [B, C, k] (-1 allowed, read as row 0) -> [B, C, k, D].

    An embedding lookup into the flattened table: its backward accumulates into a [B*N, D] buffer,
    never into a [B, C, N, D] scratch as a gather on an expanded view would."""
    B, N, D = table.shape
    return F.embedding(_flat_rows(idx, N), table.reshape(B * N, D))


def _flat_rows(idx: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Row of [B * N, ...] for each index of idx [B, ...] (-1 read as row 0)."""
    offset = (torch.arange(idx.shape[0], device=idx.device) * n_rows).view(-1, *([1] * (idx.dim() - 1)))
    return idx.clamp_min(0) + offset


def no_autocast(device: torch.device):
    """The lean functions do their own precision (fp32 accumulation): autocast would run their einsums
    in bf16 on CUDA."""
    return torch.autocast(device.type, enabled=False)


def chunk_logits(q: torch.Tensor, window_kv: torch.Tensor, q_start: int, window: int,
                 comp_kv: torch.Tensor | None, comp_idx: torch.Tensor | None, scale: float, dtype: torch.dtype):
    """The masked logits of a chunk of queries q [B, C, H, D] (positions q_start..q_start+C-1), in `dtype`.

    Returns (lo, keys [B, L, D] = window_kv[:, lo:q_start+C], window logits [B, C, H, L] (-inf outside
    the band), gathered compressed entries [B, C, k, D] and their logits [B, C, H, k] (-inf at empty
    slots), the last two None without compressed slots)."""
    C = q.shape[1]
    lo = max(0, q_start - window + 1)
    keys = window_kv[:, lo:q_start + C].to(dtype)
    t = torch.arange(q_start, q_start + C, device=q.device).unsqueeze(-1)
    p = torch.arange(lo, q_start + C, device=q.device)
    band = (p <= t) & (p > t - window)  # [C, L]
    qf = q.to(dtype)
    logits = (torch.einsum("bchd,bld->bchl", qf, keys) * scale).masked_fill(~band.view(1, C, 1, -1), float("-inf"))
    if comp_idx is None or comp_idx.shape[-1] == 0:
        return lo, keys, logits, None, None
    gathered = gather_rows(comp_kv, comp_idx).to(dtype)
    clog = (torch.einsum("bchd,bckd->bchk", qf, gathered) * scale).masked_fill((comp_idx < 0).unsqueeze(2),
                                                                               float("-inf"))
    return lo, keys, logits, gathered, clog


def sparse_attention(q: torch.Tensor, window_kv: torch.Tensor, q_start: int, window: int,
                     comp_kv: torch.Tensor | None, comp_idx: torch.Tensor | None, sink: torch.Tensor,
                     scale: float):
    """Reference, one chunk: q [B, C, H, D]; window_kv [B, S, D] (all positions); comp_kv [B, N, D];
    comp_idx [B, C, k] (-1 = empty). Returns (out [B, C, H, D], probabilities of the compressed slots
    [B, C, H, k] or None)."""
    B, C, H, D = q.shape
    _, keys, logits, gathered, clog = chunk_logits(q, window_kv, q_start, window, comp_kv, comp_idx, scale,
                                                   torch.float32)
    n_win = logits.shape[-1]
    if gathered is not None:
        logits = torch.cat([logits, clog], dim=-1)
    sink_col = sink.float().view(1, 1, H, 1).expand(B, C, H, 1)
    probs = torch.cat([logits, sink_col], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("bchl,bld->bchd", probs[..., :n_win], keys)
    comp_probs = None
    if gathered is not None:
        comp_probs = probs[..., n_win:]
        out = out + torch.einsum("bchk,bckd->bchd", comp_probs, gathered)
    return out.to(q.dtype), comp_probs


class _LeanSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, window_kv, comp_kv, sink, topk, window: int, scale: float, chunk: int, q_offset: int,
                use_triton: bool | None = None):
        ctx.triton = _select_triton(q, use_triton)
        with no_autocast(q.device):
            if ctx.triton:
                return _LeanSparseAttention._forward_triton(ctx, q, window_kv, comp_kv, sink, topk, window, scale,
                                                            chunk, q_offset)
            return _LeanSparseAttention._forward(ctx, q, window_kv, comp_kv, sink, topk, window, scale, chunk,
                                                 q_offset)

    @staticmethod
    def _forward_triton(ctx, q, window_kv, comp_kv, sink, topk, window, scale, chunk, q_offset):
        has_comp = topk is not None and topk.shape[-1] > 0
        out, lse, target = sparse_attention_fwd_op(q, window_kv, comp_kv if has_comp else None,
                                                   topk if has_comp else None, sink, int(window), float(scale),
                                                   int(q_offset))
        ctx.save_for_backward(q, window_kv, comp_kv if has_comp else None, sink, topk if has_comp else None, out, lse)
        ctx.window, ctx.scale, ctx.chunk, ctx.q_offset = window, scale, chunk, q_offset
        ctx.mark_non_differentiable(target)
        return out, target

    @staticmethod
    def _forward(ctx, q, window_kv, comp_kv, sink, topk, window, scale, chunk, q_offset):
        B, S, H, D = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        has_comp = topk is not None and topk.shape[-1] > 0
        out = torch.empty_like(q)
        lse = torch.empty(B, S, H, dtype=acc, device=q.device)
        target = torch.zeros(B, S, topk.shape[-1] if has_comp else 0, dtype=acc, device=q.device)
        sink_col = sink.to(acc).view(1, 1, H, 1)
        for t0, t1 in query_chunks(S, chunk, q, window, q_offset):
            _, keys, lw, gathered, lc = chunk_logits(q[:, t0:t1], window_kv, t0 + q_offset, window, comp_kv,
                                                     topk[:, t0:t1] if has_comp else None, scale, acc)
            parts = [lw] + ([lc] if has_comp else []) + [sink_col.expand(B, t1 - t0, H, 1)]
            lse_c = torch.cat(parts, dim=-1).logsumexp(dim=-1)
            pw = (lw - lse_c.unsqueeze(-1)).exp()
            o = torch.einsum("bchl,bld->bchd", pw, keys)
            if has_comp:
                pc = (lc - lse_c.unsqueeze(-1)).exp()
                o = o + torch.einsum("bchk,bckd->bchd", pc, gathered)
                target[:, t0:t1] = pc.sum(dim=2)
            out[:, t0:t1] = o.to(q.dtype)
            lse[:, t0:t1] = lse_c
        ctx.save_for_backward(q, window_kv, comp_kv if has_comp else None, sink, topk if has_comp else None, out, lse)
        ctx.window, ctx.scale, ctx.chunk, ctx.q_offset = window, scale, chunk, q_offset
        ctx.mark_non_differentiable(target)
        return out, target

    @staticmethod
    def backward(ctx, dout, _dtarget):
        with no_autocast(dout.device):
            if ctx.triton:
                return _LeanSparseAttention._backward_triton(ctx, dout)
            return _LeanSparseAttention._backward(ctx, dout)

    @staticmethod
    def _backward_triton(ctx, dout):
        q, window_kv, comp_kv, sink, topk, out, lse = ctx.saved_tensors
        dq, dwin, dcomp, dsink = sparse_attention_bwd_op(q, window_kv, comp_kv, topk, sink, out, lse, dout,
                                                         int(ctx.window), float(ctx.scale), int(ctx.q_offset))
        return (dq.to(q.dtype), dwin.to(window_kv.dtype), None if comp_kv is None else dcomp.to(comp_kv.dtype),
                dsink.to(sink.dtype), None, None, None, None, None, None)

    @staticmethod
    def _backward(ctx, dout):
        q, window_kv, comp_kv, sink, topk, out, lse = ctx.saved_tensors
        B, S, H, D = q.shape
        acc = lse.dtype
        window, scale, off = ctx.window, ctx.scale, ctx.q_offset
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dwin = torch.zeros(window_kv.shape, dtype=acc, device=q.device)
        dcomp = None if comp_kv is None else torch.zeros(comp_kv.shape, dtype=acc, device=q.device)
        dsink = torch.zeros(H, dtype=acc, device=q.device)
        for t0, t1 in query_chunks(S, ctx.chunk, q, window, off):
            idx = None if topk is None else topk[:, t0:t1]
            lo, keys, lw, gathered, lc = chunk_logits(q[:, t0:t1], window_kv, t0 + off, window, comp_kv, idx, scale,
                                                      acc)
            lse_c = lse[:, t0:t1].unsqueeze(-1)
            qf, do = q[:, t0:t1].to(acc), dout[:, t0:t1].to(acc)
            row = (do * out[:, t0:t1].to(acc)).sum(-1, keepdim=True)  # D = rowsum(dout * out) [B, C, H, 1]
            pw = (lw - lse_c).exp()
            dsw = pw * (torch.einsum("bchd,bld->bchl", do, keys) - row)
            dq_c = torch.einsum("bchl,bld->bchd", dsw, keys)
            dwin[:, lo:t1 + off] += (torch.einsum("bchl,bchd->bld", dsw, qf) * scale
                                     + torch.einsum("bchl,bchd->bld", pw, do))
            if gathered is not None:
                pc = (lc - lse_c).exp()  # 0 at empty slots, so they add nothing below
                dsc = pc * (torch.einsum("bchd,bckd->bchk", do, gathered) - row)
                dq_c = dq_c + torch.einsum("bchk,bckd->bchd", dsc, gathered)
                dg = torch.einsum("bchk,bchd->bckd", dsc, qf) * scale + torch.einsum("bchk,bchd->bckd", pc, do)
                dcomp.view(-1, D).index_add_(0, _flat_rows(idx, comp_kv.shape[1]).reshape(-1), dg.reshape(-1, D))
            dq[:, t0:t1] = dq_c * scale
            p_sink = (sink.to(acc).view(1, 1, H) - lse[:, t0:t1]).exp()
            dsink -= (p_sink * row.squeeze(-1)).sum(dim=(0, 1))
        return (dq.to(q.dtype), dwin.to(window_kv.dtype), None if dcomp is None else dcomp.to(comp_kv.dtype),
                dsink.to(sink.dtype), None, None, None, None, None, None)


def sparse_attention_lean(q: torch.Tensor, window_kv: torch.Tensor, comp_kv: torch.Tensor | None,
                          topk: torch.Tensor | None, sink: torch.Tensor, window: int, scale: float, chunk: int,
                          q_offset: int = 0, use_triton: bool | None = None):
    """Whole sequence: q [B, S, H, D], window_kv [B, q_offset + S, D], comp_kv [B, N, D] and topk [B, S, k]
    (-1 = empty) or None, sink [H]. Query t sits at window_kv row t + q_offset (the first `q_offset` rows:
    the context-parallel halo of earlier positions). Returns (out [B, S, H, D], head-summed probabilities
    of the compressed slots [B, S, k] without gradient; [B, S, 0] without compressed slots).
    use_triton: None = the Triton kernels on CUDA (or under TRITON_INTERPRET=1), the chunked PyTorch path
    (chunks of `chunk` queries) elsewhere; True / False force one (model.kernels.select.use_triton)."""
    return _LeanSparseAttention.apply(q, window_kv, comp_kv, sink, topk, window, scale, chunk, q_offset, use_triton)
