"""The indexer's logits of each query's selected entries, with gradient, for the KL auxiliary loss
(V41_SPEC §2): logit(t, j) = sum_h ReLU(q_th . k_j) * w_th for the k entries j that query t selected.

- `index_logits_reference`: plain PyTorch, one chunk; autograd keeps the gathered index keys
  [C, k, d] and the ReLU outputs [C, H, k] of every chunk.
- `index_logits_lean`: the training path, one autograd function over the sequence that saves nothing
  but its inputs (q, w, the index keys, the indices) and recomputes per chunk in backward:
      s = q . k_j,  r = ReLU(s),  dw_th = sum_j dlogit_tj r_thj,  ds = dlogit_tj w_th [s > 0],
      dq_th = sum_j ds k_j,  dk_j += sum_{t,h} ds q_th  (empty slots, -1, add nothing).
"""

from __future__ import annotations

import torch

from flashtrain.model.chunks import query_chunks
from flashtrain.model.sparse_attention import _flat_rows, gather_rows, no_autocast


def index_logits_reference(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """q [B, C, H, d], w [B, C, H], k [B, N, d], idx [B, C, k] -> [B, C, k] fp32 (empty slots: whatever
    row 0 gives; callers mask them)."""
    s = torch.einsum("bchd,bckd->bchk", q.float(), gather_rows(k, idx).float()).relu()
    return (s * w.float().unsqueeze(-1)).sum(dim=2)


class _LeanIndexLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, k, idx, chunk: int, values):
        with no_autocast(q.device):
            return _LeanIndexLogits._forward(ctx, q, w, k, idx, chunk, values)

    @staticmethod
    def _forward(ctx, q, w, k, idx, chunk, values):
        B, S = idx.shape[:2]
        acc = torch.promote_types(q.dtype, torch.float32)
        ctx.save_for_backward(q, w, k, idx)
        ctx.chunk = chunk
        if values is not None:  # the selection kernel's scores of the selected entries: the same numbers
            return values.to(acc).masked_fill(idx < 0, 0.0)
        out = torch.empty(B, S, idx.shape[-1], dtype=acc, device=q.device)
        for t0, t1 in query_chunks(S, chunk, q):
            kg = gather_rows(k, idx[:, t0:t1]).to(acc)
            s = torch.einsum("bchd,bckd->bchk", q[:, t0:t1].to(acc), kg).relu_()
            logits = (s * w[:, t0:t1].to(acc).unsqueeze(-1)).sum(dim=2)
            out[:, t0:t1] = logits.masked_fill(idx[:, t0:t1] < 0, 0.0)
        return out

    @staticmethod
    def backward(ctx, dlogits):
        with no_autocast(dlogits.device):
            return _LeanIndexLogits._backward(ctx, dlogits)

    @staticmethod
    def _backward(ctx, dlogits):
        q, w, k, idx = ctx.saved_tensors
        B, S = idx.shape[:2]
        acc = dlogits.dtype
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dw = torch.empty(w.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        d = k.shape[-1]
        for t0, t1 in query_chunks(S, ctx.chunk, q):
            kg = gather_rows(k, idx[:, t0:t1]).to(acc)
            qc, wc, dl = q[:, t0:t1].to(acc), w[:, t0:t1].to(acc), dlogits[:, t0:t1]
            s = torch.einsum("bchd,bckd->bchk", qc, kg)
            dl = dl.masked_fill(idx[:, t0:t1] < 0, 0.0)
            dw[:, t0:t1] = (s.relu() * dl.unsqueeze(2)).sum(-1)
            ds = (dl.unsqueeze(2) * wc.unsqueeze(-1)) * (s > 0)
            dq[:, t0:t1] = torch.einsum("bchk,bckd->bchd", ds, kg)
            dkg = torch.einsum("bchk,bchd->bckd", ds, qc)
            dk.view(-1, d).index_add_(0, _flat_rows(idx[:, t0:t1], k.shape[1]).reshape(-1), dkg.reshape(-1, d))
        return dq.to(q.dtype), dw.to(w.dtype), dk.to(k.dtype), None, None, None


def index_logits_lean(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, chunk: int,
                      values: torch.Tensor | None = None) -> torch.Tensor:
    """Whole sequence: q [B, S, H, d], w [B, S, H], k [B, N, d], idx [B, S, k] -> [B, S, k] (0, with no
    gradient, at empty slots). `values` [B, S, k]: the logits already computed by the selection pass
    (model/kernels/index_topk.py), taken as the forward result instead of recomputing them."""
    return _LeanIndexLogits.apply(q, w, k, idx, chunk, values)
