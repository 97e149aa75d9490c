"""CSA2 sparse attention in training mode: whole sequences, no KV cache (V41_SPEC §1-2).

Every layer computes its own query and its own sliding-window KV. Layers with a compress ratio add
`index_topk` compressed entries chosen by an indexer; which compressed KV and which indices they use
follows their `LayerRole` (model/layer_plan.py):

- FULL:    `Compressor` pools its own compressed KV; its `Indexer` derives index-K from the pre-RoPE
           latent, scores and selects top-k; both are published in the carry (`SharedKV`).
           The candidate source also ranks blocks of `candidate_block_size` positions and publishes
           the best `candidate_topk_blocks` as a block mask.
- REUSE:   reads the carry's KV and top-k (gradients flow back into the owner's compressor).
- REINDEX: own indexer query and weights over the carry's index-K, scoring only inside the
           candidate pool when restriction is on; publishes its top-k for the Reuse layers after it.

Attention is one softmax over the window slots, the selected compressed slots and a per-head sink
logit (exp(sink) added to the denominator, no value). K = V = the shared 512-d latent, RoPE'd on its
last `rope_head_dim` channels, so the output gets the inverse rotation before the grouped output
projection (`wo_a` block-diagonal over `o_groups`, then `wo_b`).

Memory (DESIGN.md): the selected window + top-k entries are gathered once per query (MQA-like, not
per head) and queries are processed in chunks of `attn_chunk_size`, so the [chunk, W + k, D] block,
the indexer's score matrix and the candidate mask never exist for the whole sequence at once.

The indexer is trained by the KL auxiliary loss (Megatron-LM's DeepSeek-V3.2 form, not published by
DeepSeek): per query, target = main attention probability over its selected compressed entries,
summed over heads and renormalised; prediction = softmax of the indexer logits over the same set;
the indexer's inputs are detached, so only indexer weights receive this gradient.

This file is the plain-PyTorch reference path; a fused kernel slots in behind `sparse_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.aux import StepStats, attach_aux_loss
from model.config import ModelConfig
from model.layer_plan import LayerRole, Role
from model.norm import RMSNorm
from model.rope import apply_rope, rope_angles, rope_frequencies


@dataclass
class SharedKV:
    """The CSA2 part of the block carry (DESIGN.md table)."""

    kv: torch.Tensor | None = None  # [B, N, head_dim] compressed KV, RoPE'd at j*m
    index_k: torch.Tensor | None = None  # [B, N, index_head_dim] index keys, RoPE'd
    topk: torch.Tensor | None = None  # [B, S, k] int64 compressed indices, -1 = empty slot
    candidates: torch.Tensor | None = None  # [B, S, n_blocks] bool block mask of the candidate pool


def visible_compressed(seq_len: int, ratio: int, device=None) -> torch.Tensor:
    """n_vis[t] = number of compressed groups visible to query t: group j is visible once t >= (j+1)m - 1."""
    return torch.arange(1, seq_len + 1, device=device) // ratio


class Compressor(nn.Module):
    """Ratio 1: RMSNorm(wkv(x)). Ratio m > 1: per channel softmax-weighted pooling of each complete,
    non-overlapping group of m tokens (kv = wkv(x), score = wgate(x), both fp32), then RMSNorm.
    Returns the pre-RoPE latent [B, S // m, head_dim]."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(cfg.dim, cfg.head_dim, bias=False)
        if ratio > 1:
            self.wgate = nn.Linear(cfg.dim, cfg.head_dim, bias=False)
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.ratio
        if m == 1:
            return self.norm(self.wkv(x))
        B, S, _ = x.shape
        n = S // m
        xf = x[:, : n * m].float()
        kv = F.linear(xf, self.wkv.weight.float()).unflatten(1, (n, m))
        score = F.linear(xf, self.wgate.weight.float()).unflatten(1, (n, m))
        pooled = (kv * score.softmax(dim=2)).sum(dim=2)
        return self.norm(pooled.to(x.dtype))


class Indexer(nn.Module):
    """Lightning indexer: score(t, j) = sum_h ReLU(q_th . k_j) * w_th, w = weights_proj(x) (H d)^-1/2.
    Only the kv-source (FULL) layer owns `wk`/`k_norm` (index-K from the compressed latent)."""

    def __init__(self, cfg: ModelConfig, owns_k: bool):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.dim, cfg.index_n_heads, bias=False)
        if owns_k:
            self.wk = nn.Linear(cfg.head_dim, cfg.index_head_dim, bias=False)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.norm_eps)

    def index_keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(self.k_norm(self.wk(stop_gradient_connected(latent))), cos, sin)

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q [B, S, H, d] RoPE'd, w [B, S, H]) from detached inputs."""
        q = self.wq_b(qr.detach()).unflatten(-1, (self.n_heads, self.head_dim))
        w = self.weights_proj(x.detach()).float() * (self.n_heads * self.head_dim) ** -0.5
        return apply_rope(q, cos, sin), w


def stop_gradient_connected(x: torch.Tensor) -> torch.Tensor:
    """x's values with no gradient to x (the indexer trains on its KL loss only), kept as a node of
    x's graph through an exact zero: index-K then depends on the block input, as every other output of
    a pipeline stage does. torch's zero-bubble weight pass (pipelining `stage_backward_weight`) replays
    weight gradients only from nodes that depend on the stage inputs; with a plain detach(), a stage
    that produces index-K for a later stage would lose that gradient to wk / k_norm."""
    return x.detach() + 0.0 * x


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [B, C, H, d], w [B, C, H], k [B, N, d] -> [B, C, N] fp32."""
    s = torch.einsum("bchd,bnd->bchn", q.float(), k.float()).relu_()
    return (s * w.unsqueeze(-1)).sum(dim=2)


def select_candidate_blocks(scores: torch.Tensor, n_vis: torch.Tensor, topk_blocks: int, block: int):
    """scores [B, C, N] with invisible entries at -inf; n_vis [C]. Keep the best `topk_blocks` blocks
    by their max score, always pinning the block that holds the newest visible position.
    Returns a [B, C, ceil(N / block)] bool mask."""
    N = scores.shape[-1]
    padded = F.pad(scores, (0, -N % block), value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block)).amax(dim=-1)
    nb = blocks.shape[-1]
    newest = ((n_vis - 1) // block).unsqueeze(-1)  # -1 when nothing is visible: pins nothing
    blocks = blocks.masked_fill(torch.arange(nb, device=scores.device) == newest, float("inf"))
    top = blocks.topk(min(topk_blocks, nb), dim=-1)
    return torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table [B, N, D], idx [B, C, k] (-1 allowed, read as row 0) -> [B, C, k, D].

    An embedding lookup into the flattened table: its backward accumulates into a [B*N, D] buffer,
    never into a [B, C, N, D] scratch as a gather on an expanded view would."""
    B, N, D = table.shape
    offset = (torch.arange(B, device=idx.device) * N).view(-1, 1, 1)
    return F.embedding(idx.clamp_min(0) + offset, table.reshape(B * N, D))


def sparse_attention(q: torch.Tensor, window_kv: torch.Tensor, q_start: int, window: int,
                     comp_kv: torch.Tensor | None, comp_idx: torch.Tensor | None, sink: torch.Tensor,
                     scale: float):
    """One softmax over window slots + selected compressed slots + sink, for a chunk of queries.

    q [B, C, H, D] for positions q_start..q_start+C-1; window_kv [B, S, D] (all positions);
    comp_kv [B, N, D]; comp_idx [B, C, k] (-1 = empty). Returns (out [B, C, H, D],
    probabilities of the compressed slots [B, C, H, k] or None).

    The window part is computed as a band: the chunk's queries against the contiguous key range
    [q_start - W + 1, q_start + C), masked to t - W < p <= t (one dense matmul per chunk instead of a
    per-query gather); the compressed part gathers each query's k selected entries once, shared by
    all heads.
    """
    B, C, H, D = q.shape
    lo = max(0, q_start - window + 1)
    keys = window_kv[:, lo:q_start + C]  # [B, L, D]
    t = torch.arange(q_start, q_start + C, device=q.device).unsqueeze(-1)
    p = torch.arange(lo, q_start + C, device=q.device)
    band = (p <= t) & (p > t - window)  # [C, L]
    logits = torch.einsum("bchd,bld->bchl", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~band.view(1, C, 1, -1), float("-inf"))
    n_win = logits.shape[-1]
    gathered = None
    if comp_idx is not None and comp_idx.shape[-1] > 0:
        gathered = gather_rows(comp_kv, comp_idx).float()  # [B, C, k, D]
        clog = torch.einsum("bchd,bckd->bchk", q.float(), gathered) * scale
        clog = clog.masked_fill((comp_idx < 0).unsqueeze(2), float("-inf"))
        logits = torch.cat([logits, clog], dim=-1)
    sink_col = sink.float().view(1, 1, H, 1).expand(B, C, H, 1)
    probs = torch.cat([logits, sink_col], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("bchl,bld->bchd", probs[..., :n_win], keys.float())
    comp_probs = None
    if gathered is not None:
        comp_probs = probs[..., n_win:]
        out = out + torch.einsum("bchk,bckd->bchd", comp_probs, gathered)
    return out.to(q.dtype), comp_probs


def indexer_kl(target_probs: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum over queries of KL(p || softmax(logits)) over each query's valid selected entries, divided by
    the number of queries that have any. target_probs [B, S, H, k] (detached), logits/valid [B, S, k]."""
    p = target_probs.sum(dim=2).masked_fill(~valid, 0.0)
    has = valid.any(-1)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    logq = logits.masked_fill(~valid, float("-inf")).log_softmax(-1)
    terms = torch.where(valid, p * (p.clamp_min(1e-30).log() - logq), torch.zeros_like(p))
    return terms.sum(-1)[has].sum() / has.sum().clamp_min(1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, role: LayerRole):
        super().__init__()
        self.role = role
        self.ratio = role.compress_ratio
        self.n_heads, self.head_dim, self.rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.n_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.window = cfg.window_size
        self.index_topk = cfg.index_topk
        self.cand_blocks, self.cand_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.chunk = cfg.attn_chunk_size
        self.kl_weight = cfg.indexer_loss_weight
        self.scale = cfg.head_dim ** -0.5

        self.attn_sink = nn.Parameter(torch.zeros(cfg.n_heads, dtype=torch.float32))
        self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, cfg.head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.wo_a = nn.Linear(cfg.n_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, bias=False)
        if role.has_compressor:
            self.compressor = Compressor(cfg, self.ratio)
        if role.has_indexer:
            self.indexer = Indexer(cfg, owns_k=role.role is Role.FULL)

        if self.ratio:
            self._rope_args = (cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor,
                               cfg.beta_fast, cfg.beta_slow)
        else:
            self._rope_args = (cfg.rope_head_dim, cfg.rope_theta)
        self.register_buffer("rope_freqs", rope_frequencies(*self._rope_args), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the RoPE frequencies (after materialising a meta-device model)."""
        with torch.device("cpu"):
            self.rope_freqs.copy_(rope_frequencies(*self._rope_args))

    # -------------------------------------------------------------------------------------------
    def _select(self, x, qr, shared: SharedKV, cos, sin, n_vis):
        """Run this layer's indexer: top-k indices [B, S, k], grad-carrying logits of the selected
        entries and their validity (for the KL loss); publish candidates when this is the source."""
        B, S, _ = x.shape
        q_i, w_i = self.indexer.queries(x, qr, cos, sin)
        k_i = shared.index_k
        N = k_i.shape[1]
        k = min(self.index_topk, N)
        restrict = self.role.uses_candidates and shared.candidates is not None
        topk, logits, cands = [], [], []
        pos = torch.arange(N, device=x.device)
        for t0 in range(0, S, self.chunk):
            t1 = min(S, t0 + self.chunk)
            with torch.no_grad():
                sc = index_scores(q_i[:, t0:t1], w_i[:, t0:t1], k_i)
                sc = sc.masked_fill(pos >= n_vis[t0:t1].unsqueeze(-1), float("-inf"))
                if self.role.is_candidate_source:
                    cands.append(select_candidate_blocks(sc, n_vis[t0:t1], self.cand_blocks, self.cand_block_size))
                if restrict:
                    keep = shared.candidates[:, t0:t1].repeat_interleave(self.cand_block_size, dim=-1)[..., :N]
                    sc = sc.masked_fill(~keep, float("-inf"))
                top = sc.topk(k, dim=-1)
                idx = torch.where(top.values > float("-inf"), top.indices, -1)
            topk.append(idx)
            # grad-carrying logits of the selected entries only (for the KL loss)
            kg = gather_rows(k_i, idx)
            s = torch.einsum("bchd,bckd->bchk", q_i[:, t0:t1].float(), kg.float()).relu()
            logits.append((s * w_i[:, t0:t1].unsqueeze(-1)).sum(dim=2))
        if cands:
            shared.candidates = torch.cat(cands, dim=1)
        topk = torch.cat(topk, dim=1)
        return topk, torch.cat(logits, dim=1), topk >= 0

    def forward(self, x: torch.Tensor, shared: SharedKV, stats: StepStats | None = None,
                aux_grad_scale: float = 1.0) -> torch.Tensor:
        """x [B, S, dim] (already attn_norm'ed) -> [B, S, dim]; reads/writes `shared` per the role."""
        B, S, _ = x.shape
        pos = torch.arange(S, device=x.device)
        cos, sin = rope_angles(self.rope_freqs, pos)
        qr = self.q_norm(self.wq_a(x))
        q = apply_rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        window_kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)

        comp_kv = topk = sel_logits = sel_valid = None
        if self.ratio:
            n_vis = visible_compressed(S, self.ratio, x.device)
            if self.role.role is Role.FULL:
                latent = self.compressor(x)
                ccos, csin = rope_angles(self.rope_freqs, torch.arange(latent.shape[1], device=x.device) * self.ratio)
                shared.kv = apply_rope(latent, ccos, csin)
                shared.index_k = self.indexer.index_keys(latent, ccos, csin)
                shared.candidates = None
            comp_kv = shared.kv
            if comp_kv is None:
                raise RuntimeError(f"layer {self.role.id} ({self.role.role.value}) needs the compressed KV of "
                                   f"layer {self.role.kv_source}, but the carry has none")
            if self.role.has_indexer:
                if comp_kv.shape[1] == 0:
                    topk = torch.full((B, S, 0), -1, dtype=torch.long, device=x.device)
                else:
                    topk, sel_logits, sel_valid = self._select(x, qr, shared, cos, sin, n_vis)
                shared.topk = topk
            else:
                topk = shared.topk

        outs, comp_probs = [], []
        for t0 in range(0, S, self.chunk):
            t1 = min(S, t0 + self.chunk)
            o, cp = sparse_attention(q[:, t0:t1], window_kv, t0, self.window, comp_kv,
                                     None if topk is None else topk[:, t0:t1], self.attn_sink, self.scale)
            outs.append(o)
            if sel_logits is not None and cp is not None:
                comp_probs.append(cp.detach())
        o = apply_rope(torch.cat(outs, dim=1), cos, sin, inverse=True)

        o = o.reshape(B, S, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        out = self.wo_b(torch.einsum("bsgd,grd->bsgr", o, wo_a).flatten(2))

        if comp_probs and self.kl_weight > 0 and torch.is_grad_enabled():
            loss = self.kl_weight * indexer_kl(torch.cat(comp_probs, dim=1), sel_logits, sel_valid)
            if stats is not None:
                stats.indexer_loss[self.role.id] = loss.detach()
            out = attach_aux_loss(out, loss, aux_grad_scale)
        return out
