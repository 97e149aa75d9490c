"""CSA2 sparse attention in training mode: whole sequences, no KV cache (V41_SPEC §1-2).

Every layer computes its own query and its own sliding-window KV. Layers with a compress ratio add
`index_topk` compressed entries chosen by an indexer; which compressed KV and which indices they use
follows their `LayerRole` (model/layer_plan.py), and what they read from and publish to the carry is
what the carry contract (model/carry.py) lets their role read and write (`SharedKV.read` / `write`):

- FULL:    `Compressor` pools its own compressed KV; its `Indexer` derives index-K from the pre-RoPE
           latent, scores and selects top-k; all are published in the carry (`SharedKV`).
           The candidate source also ranks blocks of `candidate_block_size` positions and publishes
           the best `candidate_topk_blocks` as block indices ([S, n_cand], not an [S, S/8] mask).
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

Quantisation-aware training (`model.qat`, off by default): the window KV, the compressed KV and the
indexer's q / k are fake-quantised after RoPE into the formats the public inference kernels store them
in (model/quant.py), with straight-through gradients; every weight enters as its release format says
(model/formats.py: `wq_a`, `wq_b`, `wkv`, `wo_b` and the indexer's `wq_b` are the FP8 Linears, whose GEMMs
`model.fp8.enabled` runs in FP8).

`model.attention: dense` (the CSA2 ablation, docs/training.md) makes every layer a sliding-window layer
whose window is the whole prefix: causal attention over every earlier position, uncompressed, with the same
projections, sink and output; no compressor, indexer, top-k or KV sharing (model/layer_plan.py: all SWA).

The attention core (window + selected slots + sink) is model/sparse_attention.py: a reference and the
memory-lean training path (saves q, output, log-sum-exp and indices; recomputes the rest in backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashtrain.model.aux import StepStats, attach_aux_loss
from flashtrain.model.carry import SharedKV
from flashtrain.model.chunks import query_chunks
from flashtrain.model.config import ModelConfig, QATConfig
from flashtrain.model.formats import Linear, Stored
from flashtrain.model.index_logits import index_logits_lean
from flashtrain.model.kernels.index_topk import index_topk_op, top_indices
from flashtrain.model.kernels.select import use_triton
from flashtrain.model.layer_plan import LayerRole, Role
from flashtrain.model.norm import RMSNorm
from flashtrain.model.quant import fake_quant_fp4, fake_quant_fp8
from flashtrain.model.rope import apply_rope, rope_angles, rope_frequencies
from flashtrain.model.sequence_split import SequenceSplit
from flashtrain.model.sparse_attention import sparse_attention_lean


def visible_compressed_at(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """n_vis[t] = number of compressed groups visible to the query at (global) position t: group j is
    visible once t >= (j+1)m - 1."""
    return (positions + 1) // ratio


class Compressor(nn.Module):
    """Ratio 1: RMSNorm(wkv(x)). Ratio m > 1: per channel softmax-weighted pooling of each complete,
    non-overlapping group of m tokens (kv = wkv(x), score = wgate(x), both fp32), then RMSNorm.
    Returns the pre-RoPE latent [B, S // m, head_dim].

    In two steps for context parallelism: `project` (per token) and `pool` (per group, on projections
    that start at a group boundary), so a group straddling a slice boundary is pooled by its owner from
    the neighbour's projected tail (model/sequence_split.py)."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(cfg.dim, cfg.head_dim, cfg)
        if ratio > 1:
            self.wgate = Linear(cfg.dim, cfg.head_dim, cfg)
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.qat)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Ratio m > 1: [B, S, 2 head_dim] fp32 = (kv, score) of every token."""
        xf = x.float()
        return torch.cat([F.linear(xf, self.wkv.value().float()), F.linear(xf, self.wgate.value().float())], dim=-1)

    def pool(self, proj: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """proj [B, n m, 2 head_dim] (from a group boundary) -> the latent of its n groups [B, n, head_dim]."""
        m = self.ratio
        kv, score = proj.unflatten(1, (-1, m)).chunk(2, dim=-1)
        pooled = (kv * score.softmax(dim=2)).sum(dim=2)
        return self.norm(pooled.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.ratio
        if m == 1:
            return self.norm(self.wkv(x))
        n = x.shape[1] // m
        return self.pool(self.project(x[:, : n * m]), x.dtype)


class Indexer(nn.Module):
    """Lightning indexer: score(t, j) = sum_h ReLU(q_th . k_j) * w_th, w = weights_proj(x) (H d)^-1/2.
    Only the kv-source (FULL) layer owns `wk`/`k_norm` (index-K from the compressed latent)."""

    def __init__(self, cfg: ModelConfig, owns_k: bool):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.qat = cfg.qat.indexer_fp4  # q and k after RoPE in MXFP4, as the public indexer stores them
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, cfg, Stored.FP8)
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads, cfg)
        if owns_k:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim, cfg)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.norm_eps, cfg.qat)

    def _quant(self, t: torch.Tensor) -> torch.Tensor:
        return fake_quant_fp4(t, QATConfig.INDEXER_BLOCK, torch.float8_e8m0fnu) if self.qat else t

    def index_keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._quant(apply_rope(self.k_norm(self.wk(stop_gradient_connected(latent))), cos, sin))

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q [B, S, H, d] RoPE'd, w [B, S, H]) from detached inputs."""
        q = self.wq_b(qr.detach()).unflatten(-1, (self.n_heads, self.head_dim))
        w = self.weights_proj(x.detach()).float() * (self.n_heads * self.head_dim) ** -0.5
        return self._quant(apply_rope(q, cos, sin)), w


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
    Returns the kept block indices [B, C, min(topk_blocks, ceil(N / block))] int32, -1 for an empty slot
    (fewer visible blocks than slots) -- not a [B, C, ceil(N / block)] mask, which grows with S^2."""
    N = scores.shape[-1]
    padded = F.pad(scores, (0, -N % block), value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block)).amax(dim=-1)
    nb = blocks.shape[-1]
    newest = ((n_vis - 1) // block).unsqueeze(-1)  # -1 when nothing is visible: pins nothing
    blocks = blocks.masked_fill(torch.arange(nb, device=scores.device) == newest, float("inf"))
    return top_indices(blocks, min(topk_blocks, nb)).to(torch.int32)


def candidate_mask(candidates: torch.Tensor, n_entries: int, block: int) -> torch.Tensor:
    """Block indices [B, C, n] (-1 = empty) -> [B, C, n_entries] bool: entry j is in the pool iff its
    block j // block is."""
    nb = -(-n_entries // block)
    idx = candidates.long()
    hit = torch.zeros(*idx.shape[:-1], nb + 1, dtype=torch.bool, device=idx.device)
    hit.scatter_(-1, torch.where(idx >= 0, idx, nb), True)  # empty slots land in the spare column nb
    return hit[..., :nb].repeat_interleave(block, dim=-1)[..., :n_entries]


def keep_visible_outside_pool(topk: torch.Tensor, n_vis: torch.Tensor, candidates: torch.Tensor,
                              block: int) -> torch.Tensor:
    """Top-k under the candidate restriction, completed as the public inference code completes it.

    The public indexer masks entries outside the pool to -inf, takes `torch.topk` and then keeps every pick
    whose index is visible, -inf or not. When the pool holds fewer visible entries than k, its picks are
    therefore topped up with visible entries from outside the pool. Which ones is torch.topk's choice among
    equal -inf scores, which torch leaves unspecified (CPU and CUDA differ); flashtrain breaks ties toward
    the lower index everywhere, so here: the lowest-index visible entries outside the pool, up to
    min(k, n_vis[t]) picks in all. (When k covers every entry, the sets are identical to the public code's.)

    topk [B, S, k] with its valid picks first and -1 after them (both selection paths return it so);
    n_vis [S]; candidates [B, S, n] pool block ids (-1 empty). Every top-up entry lies below k: among the
    first min(k, n_vis) entries at most as many are in the pool as were picked."""
    B, S, k = topk.shape
    nb = -(-k // block)
    c = candidates.long()
    hit = torch.zeros(B, S, nb + 1, dtype=torch.bool, device=topk.device)
    hit.scatter_(-1, torch.where((c >= 0) & (c < nb), c, nb), True)  # blocks past the first k entries: spare column
    in_pool = hit[..., :nb].repeat_interleave(block, dim=-1)[..., :k]
    pos = torch.arange(k, device=topk.device)
    vis = n_vis.to(topk.device).unsqueeze(-1)
    free = ~in_pool & (pos < vis)
    picked = (topk >= 0).sum(-1, keepdim=True)
    need = (torch.clamp(vis, max=k) - picked).clamp_min(0)
    rank = free.cumsum(-1)
    take = free & (rank <= need)
    out = torch.cat([topk, topk.new_full((B, S, 1), -1)], dim=-1)  # column k absorbs the entries not taken
    out.scatter_(-1, torch.where(take, picked + rank - 1, k), torch.where(take, pos, -1).to(topk.dtype))
    return out[..., :k]


def index_select(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, n_vis: torch.Tensor, topk: int, chunk: int,
                 candidates: torch.Tensor | None, block: int, source_blocks: int):
    """The indexer's selection, reference path, chunk by chunk: q [B, S, H, d], w [B, S, H], index keys
    k [B, N, d], n_vis [S] (entries j < n_vis[t] are visible to query t). Scores only inside the
    candidate pool when `candidates` [B, S, n] (block indices, -1 empty) is given. Returns (top-k
    indices [B, S, topk] int64, -1 = empty; with `source_blocks` > 0 (the candidate source) the best
    `source_blocks` blocks of `block` entries per query [B, S, n_cand] int32, else None)."""
    B, S = q.shape[:2]
    N = k.shape[1]
    out = torch.empty(B, S, topk, dtype=torch.long, device=q.device)
    cands = None
    pos = torch.arange(N, device=q.device)
    for t0, t1 in query_chunks(S, chunk, q):
        sc = index_scores(q[:, t0:t1], w[:, t0:t1], k)
        sc = sc.masked_fill(pos >= n_vis[t0:t1].unsqueeze(-1), float("-inf"))
        if source_blocks:
            c = select_candidate_blocks(sc, n_vis[t0:t1], source_blocks, block)
            if cands is None:
                cands = torch.empty(B, S, c.shape[-1], dtype=c.dtype, device=c.device)
            cands[:, t0:t1] = c
        if candidates is not None:
            sc = sc.masked_fill(~candidate_mask(candidates[:, t0:t1], N, block), float("-inf"))
        out[:, t0:t1] = top_indices(sc, topk)
    return out, cands


def indexer_kl(target_probs: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor,
               split: SequenceSplit | None = None) -> torch.Tensor:
    """sum over queries of KL(p || softmax(logits)) over each query's valid selected entries, divided by
    the number of queries that have any. target_probs [B, S, k]: the main attention's probabilities of
    the selected entries summed over heads (no gradient); logits/valid [B, S, k]. Under context
    parallelism the queries are this rank's and the count is the whole sequence's: the ranks' values sum
    to the loss."""
    p = target_probs.masked_fill(~valid, 0.0)
    has = valid.any(-1)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    logq = logits.masked_fill(~valid, float("-inf")).log_softmax(-1)
    terms = torch.where(valid, p * (p.clamp_min(1e-30).log() - logq), torch.zeros_like(p))
    count = has.sum() if split is None else split.sum(has.sum())
    return terms.sum() / count.clamp_min(1)  # queries without a valid entry contribute 0 terms


class Attention(nn.Module):
    STORED = {"attn_sink": Stored.FP32}

    def __init__(self, cfg: ModelConfig, role: LayerRole):
        super().__init__()
        self.role = role
        self.ratio = role.compress_ratio
        self.n_heads, self.head_dim, self.rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.n_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.window = cfg.window_size if cfg.attention == "csa2" else None  # None: the whole prefix (dense)
        self.index_topk = cfg.index_topk
        self.cand_blocks, self.cand_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.chunk = cfg.attn_chunk_size
        # a restricted pool of topk_blocks blocks holds at least (topk_blocks - 1) * block + 1 visible entries
        # once the query sees more blocks than that; only below index_topk can it hold fewer than k
        self.pool_may_fall_short = (cfg.candidate_topk_blocks - 1) * cfg.candidate_block_size + 1 < cfg.index_topk
        self.kl_weight = cfg.indexer_loss_weight
        self.scale = cfg.head_dim ** -0.5
        self.use_triton = cfg.use_triton
        self.qat = cfg.qat

        self.attn_sink = nn.Parameter(torch.zeros(cfg.n_heads, dtype=torch.float32))
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, cfg, Stored.FP8)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, cfg.qat)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim, cfg, Stored.FP8)
        self.wkv = Linear(cfg.dim, cfg.head_dim, cfg, Stored.FP8)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.qat)
        self.wo_a = Linear(cfg.n_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, cfg, Stored.FP8)
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
    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(the q latent qr [B, L, q_lora_rank], the RoPE'd queries [B, L, H, head_dim]) of x [B, L, dim]."""
        qr = self.q_norm(self.wq_a(x))
        return qr, apply_rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)

    def window_keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The RoPE'd sliding-window K = V latent [B, L, head_dim] of x (fake-quantised with QAT)."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        if self.qat.window_kv_fp8:  # the public code keeps the window KV in FP8, the whole vector after RoPE
            kv = fake_quant_fp8(kv, QATConfig.WINDOW_KV_BLOCK)
        return kv

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention core's output o [B, L, H, head_dim] -> [B, L, dim]: inverse RoPE at the query
        positions, then `wo_a` block-diagonal over the `o_groups` groups and `wo_b`."""
        B, L = o.shape[:2]
        o = apply_rope(o, cos, sin, inverse=True).reshape(B, L, self.n_groups, -1)
        wo_a = self.wo_a.value().view(self.n_groups, self.o_lora_rank, -1)
        return self.wo_b(torch.einsum("bsgd,grd->bsgr", o, wo_a).flatten(2))

    def _select(self, x, qr, k_i, candidates, cos, sin, n_vis, made: dict):
        """Run this layer's indexer over index-K `k_i` (inside the pool `candidates` when restricted):
        top-k indices [B, S, k], grad-carrying logits of the selected entries and their validity (for the
        KL loss); candidates go into `made` when this is the source."""
        q_i, w_i = self.indexer.queries(x, qr, cos, sin)
        restrict = self.role.uses_candidates and candidates is not None
        args = (q_i, w_i, k_i, n_vis, min(self.index_topk, k_i.shape[1]), self.chunk,
                candidates if restrict else None, self.cand_block_size,
                self.cand_blocks if self.role.is_candidate_source else 0)
        with torch.no_grad():
            if use_triton(q_i, self.use_triton):
                topk, values, cands = index_topk_op(*args)
                cands = cands if self.role.is_candidate_source else None
            else:
                (topk, cands), values = index_select(*args), None
            if restrict and self.pool_may_fall_short:
                topk, values = keep_visible_outside_pool(topk, n_vis, candidates, self.cand_block_size), None
        if self.role.is_candidate_source:
            made["candidates"] = cands
        # grad-carrying logits of the selected entries only (for the KL loss), memory-lean; the forward
        # values come from the selection pass when the kernel computed them
        return topk, index_logits_lean(q_i, w_i, k_i, topk, self.chunk, values), topk >= 0

    def forward(self, x: torch.Tensor, shared: SharedKV, stats: StepStats | None = None,
                aux_grad_scale: float = 1.0, split: SequenceSplit | None = None) -> torch.Tensor:
        """x [B, L, dim] (already attn_norm'ed) -> [B, L, dim]; reads/writes `shared` per the role.

        `split` (model/sequence_split.py): under context parallelism x holds this rank's positions of
        each sequence; the window keys/values and the compressor's projections of the positions just
        before each local chunk come from their owners (`halo`), the compressed KV / index-K are
        gathered whole, queries, top-k and candidates stay local. None: the whole sequence is here."""
        B, L, _ = x.shape
        split = split or SequenceSplit.whole(L)
        pos = split.positions(x.device)
        cos, sin = rope_angles(self.rope_freqs, pos)
        qr, q = self.queries(x, cos, sin)
        window_kv = self.window_keys(x, cos, sin)
        pooled = self.role.role is Role.FULL and self.ratio > 1
        proj = self.compressor.project(x) if pooled else None
        halos = self._halos(split, window_kv, proj)

        comp_kv = topk = sel_logits = sel_valid = None
        if self.ratio:
            n_vis = visible_compressed_at(pos, self.ratio)
            given, made = shared.read(self.role), {}  # what the carry contract lets this role read / write
            if self.role.role is Role.FULL:
                latent = self._compress(x, split, proj, halos)
                ccos, csin = rope_angles(self.rope_freqs, torch.arange(latent.shape[1], device=x.device) * self.ratio)
                made["kv"] = apply_rope(latent, ccos, csin)
                if self.qat.compressed_kv_fp4:  # the public code's FP4 compressed KV (report §2.4.4)
                    made["kv"] = fake_quant_fp4(made["kv"], QATConfig.COMPRESSED_KV_BLOCK, torch.float8_e4m3fn)
                made["index_k"] = self.indexer.index_keys(latent, ccos, csin)
            comp_kv = made.get("kv", given.get("kv"))
            if comp_kv is None:
                raise RuntimeError(f"layer {self.role.id} ({self.role.role.value}) needs the compressed KV of "
                                   f"layer {self.role.kv_source}, but the carry has none")
            if self.role.has_indexer:
                if comp_kv.shape[1] == 0:
                    topk = torch.full((B, L, 0), -1, dtype=torch.long, device=x.device)
                else:
                    topk, sel_logits, sel_valid = self._select(x, qr, made.get("index_k", given.get("index_k")),
                                                               given.get("candidates"), cos, sin, n_vis, made)
                made["topk"] = topk
            else:
                topk = given["topk"]
            shared.write(self.role, made)

        outs, targets = [], []
        for (a, b), o, (halo_kv, _) in zip(split.chunks, split.offsets, halos):
            # under a split, always through the halo (even an empty one): every rank's graph then has the same
            # nodes, so the exchanges' backward collectives run on every rank, in the same order
            keys = window_kv[:, o:o + b - a] if split.size == 1 else torch.cat(
                [halo_kv.to(window_kv.dtype), window_kv[:, o:o + b - a]], dim=1)
            out_c, target_c = sparse_attention_lean(q[:, o:o + b - a], keys, comp_kv,
                                                    None if topk is None else topk[:, o:o + b - a], self.attn_sink,
                                                    self.window or keys.shape[1], self.scale, self.chunk,
                                                    halo_kv.shape[1], self.use_triton)
            outs.append(out_c)
            targets.append(target_c)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        kl_target = targets[0] if len(targets) == 1 else torch.cat(targets, dim=1)
        out = self.output(o, cos, sin)

        if sel_logits is not None and kl_target.shape[-1] and self.kl_weight > 0 and torch.is_grad_enabled():
            loss = self.kl_weight * indexer_kl(kl_target, sel_logits, sel_valid, split)
            if stats is not None:
                stats.indexer_loss[self.role.id] = loss.detach()
            out = attach_aux_loss(out, loss, aux_grad_scale)
        return out

    def _halos(self, split: SequenceSplit, window_kv: torch.Tensor, proj: torch.Tensor | None):
        """Per local chunk, (window keys/values, compressor projections) of the positions before it that
        this layer reads: window - 1 for the band, m - 1 for a group straddling the chunk start."""
        if split.size == 1:
            return [(window_kv[:, :0], None if proj is None else proj[:, :0])]
        if self.window is None:
            raise ValueError("model.attention=dense attends over the whole prefix, which a context-parallel split "
                             "does not hold; set parallel.cp=1")
        width = max(self.window - 1, self.ratio - 1 if proj is not None else 0)
        feats = window_kv.float() if proj is None else torch.cat([window_kv.float(), proj], dim=-1)
        d = window_kv.shape[-1]
        return [(h[..., :d], None if proj is None else h[..., d:]) for h in split.halo(feats, width)]

    def _compress(self, x: torch.Tensor, split: SequenceSplit, proj: torch.Tensor | None, halos) -> torch.Tensor:
        """The compressed latent of the whole sequence [B, S // m, head_dim]: each local chunk [g0, g1)
        pools the groups that end inside it (g0 // m .. g1 // m - 1), the part before g0 from the halo."""
        m = self.ratio
        if proj is None:  # ratio 1: one entry per token, nothing straddles a boundary
            return split.gather_entries([self.compressor(x[:, o:o + b - a])
                                         for (a, b), o in zip(split.chunks, split.offsets)], m)
        parts = []
        for (a, b), o, (_, halo_proj) in zip(split.chunks, split.offsets, halos):
            j0, j1 = a // m, b // m
            before = a - j0 * m if j1 > j0 else 0  # tokens of the first group that precede the chunk
            rows = proj[:, o:o + max(0, j1 * m - a)]
            if split.size > 1:  # through the halo even when empty: the same nodes on every rank (see forward)
                rows = torch.cat([halo_proj[:, halo_proj.shape[1] - before:], rows], dim=1)
            parts.append(self.compressor.pool(rows, x.dtype))
        return split.gather_entries(parts, m)
