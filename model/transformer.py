"""The V4.1-Flash text model: embedding -> 4 mHC streams -> 40 blocks -> collapse -> norm -> head.

The block stack passes an explicit carry (DESIGN.md "The model"), so any contiguous range of blocks
is a pipeline stage:

  Carry.h        [B, S, 4, D]   residual streams          (every block)
  Carry.pre_mix  [B, S, 4]      pending single-pass `pre`  (every sublayer writes the next one's)
  Carry.shared   SharedKV       compressed KV, index-K, top-k, candidate pool (CSA2 sharing)

(model/carry.py declares the fields, their shapes and which layer role reads and writes each.)

`ForwardContext` is computed once per batch from the batch alone: token types, image mask, Engram
hash ids, and the side channel for aux-loss values and expert loads.

Parameter names follow the public V4.1 checkpoint (`embed.weight`, `layers.{i}.attn.wq_a.weight`,
`layers.{i}.ffn.gate.bias_vl`, `layers.{i}.hc_attn_fn`, `layers.{i}.engram.embed.weight`,
`norm.weight`, `head.weight`, `vision.*`, `aligner.*`, `image_start`); routed experts are stacked
(`layers.{i}.ffn.experts.w1` [E, ...]).

Every weight enters the forward as the format the release stores it in says (model/formats.py: on its
grid under `model.qat.experts_fp4` / `weights_fp8` / `weights_bf16`; the FP8 Linears' GEMMs in FP8 under
`model.fp8.enabled`).

Images (V41_SPEC §6): a batch carries `token_types` and, per sample, the processed pixel tensors of
its images in order of appearance; `embed_inputs` writes their aligner rows and the learned
START / NEWLINE / END vectors into the image spans before the first block, and image positions
(token_types >= 0) route with `bias_vl` and get Engram gate 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from flashtrain.model.attention import Attention
from flashtrain.model.aux import StepStats
from flashtrain.model.carry import Carry
from flashtrain.model.config import ModelConfig
from flashtrain.model.engram import Engram, NgramHasher, engram_table_rows
from flashtrain.model.formats import Embedding, Linear, Stored, as_trained
from flashtrain.model.init import init_weights, reset_buffers
from flashtrain.model.layer_plan import LayerRole, layer_plan
from flashtrain.model.mhc import hc_collapse, hc_expand, hc_mixes, one_hot_pre
from flashtrain.model.moe import DenseFFN, MoE
from flashtrain.model.norm import RMSNorm
from flashtrain.model.recompute import recompute_block, validate_recompute
from flashtrain.model.sequence_split import SequenceSplit
from flashtrain.model.simulation import simulated
from flashtrain.model.vision import Aligner, ViT, aligner_rows, encode_images, merge_images


@dataclass
class ForwardContext:
    token_types: torch.Tensor | None  # [B, S] int, TEXT(-1) / START / IMAGE / NEWLINE / END
    image_mask: torch.Tensor | None  # [B, S] bool = token_types >= 0
    engram_ids: torch.Tensor | None  # [B, S, n_engram_layers, n_cols]
    stats: StepStats = field(default_factory=StepStats)
    aux_grad_scale: float = 1.0
    engram_requests: dict = field(default_factory=dict)  # layer id -> a row-sharded table's lookup in flight
    split: SequenceSplit | None = None  # context parallelism: this rank's positions (model/sequence_split.py)
    # Anticipatory Routing (train/stability/anticipatory.py): routing indices to use, by layer id; a dict to record into
    routes: dict[int, torch.Tensor] | None = None
    recorded: dict[int, torch.Tensor] | None = None
    # DSpark (model/dspark.py): layer id -> the layer's attention input averaged over the hc streams, filled
    # for the ids present (the drafter's target layers); and the drafter's own inputs in its blocks
    captures: dict[int, torch.Tensor | None] | None = None
    draft: object | None = None  # model/dspark.py DraftInputs


class Block(nn.Module):
    """Engram (if any) -> attention site -> FFN site, each with single-pass mHC (V41_SPEC §3). The DSpark
    drafter's block (model/dspark.py) is this block with another attention (`attention_cls`, `_attend`)."""

    attention_cls = Attention

    STORED = {f"hc_{site}_{part}": Stored.FP32 for site in ("attn", "ffn") for part in ("fn", "base", "scale")}

    def __init__(self, cfg: ModelConfig, role: LayerRole, engram_rows: int | None):
        super().__init__()
        self.layer_id = role.id
        self.role = role
        self.norm_eps, self.hc_eps, self.iters = cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        self.use_triton = cfg.use_triton
        n, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        self.mhc = cfg.residual == "mhc"  # "plain": one stream, x + F(norm(x)) (the mHC ablation)
        self.engram = Engram(cfg, role.id, engram_rows) if role.engram else None
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.qat)
        self.attn = self.attention_cls(cfg, role)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.qat)
        self.ffn = MoE(cfg, role.id) if cfg.ffn == "moe" else DenseFFN(cfg, role.id)
        self.recompute = "none"  # train.recompute (model/recompute.py); set by Transformer.set_recompute
        for site in ("attn", "ffn") if self.mhc else ():
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty(mix, n * cfg.dim, dtype=torch.float32)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.empty(mix, dtype=torch.float32)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))

    def _mixes(self, h, site: str):
        return hc_mixes(h, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_scale"),
                        getattr(self, f"hc_{site}_base"), self.norm_eps, self.hc_eps, self.iters, self.use_triton)

    def forward(self, carry: Carry, ctx: ForwardContext) -> Carry:
        if self.recompute != "none" and torch.is_grad_enabled():
            return recompute_block(self._forward, carry, ctx, self.recompute)
        return self._forward(carry, ctx)

    def _forward(self, carry: Carry, ctx: ForwardContext) -> Carry:
        h = carry.h
        if self.engram is not None:
            h = self.engram(h, ctx.engram_ids[:, :, self.engram.index], ctx.image_mask,
                            ctx.engram_requests.get(self.engram.layer_id))
        if ctx.captures is not None and self.layer_id in ctx.captures:  # the public forward's main_hiddens
            ctx.captures[self.layer_id] = h.mean(dim=2)
        h, attn_pre = self._site(h, carry.pre_mix, "attn", lambda x: self._attend(self.attn_norm(x), carry, ctx))
        h, ffn_pre = self._site(h, attn_pre, "ffn", lambda x: self.ffn(
            self.ffn_norm(x), ctx.image_mask, ctx.stats, ctx.aux_grad_scale, ctx.split, ctx.routes, ctx.recorded))
        return Carry(h, ffn_pre, carry.shared)

    def _site(self, h: torch.Tensor, pre: torch.Tensor, site: str, sublayer) -> tuple[torch.Tensor, torch.Tensor]:
        """One sublayer on the residual streams h [B, S, n, D] with the pending `pre`: (new h, the `pre` the
        next sublayer collapses with). mHC: collapse with `pre`, then X'_j = C_j F(x) + sum_i B_ij X_i, the
        site's own pre pending. `residual: plain` (n = 1): h + F(h), `pre` (ones) passed on."""
        if not self.mhc:
            return (h.float() + sublayer(h[:, :, 0]).float().unsqueeze(2)).to(h.dtype), pre
        nxt, post, comb = self._mixes(h, site)
        x = sublayer(hc_collapse(h, pre, self.use_triton))
        return hc_expand(x, h, post, comb, self.use_triton), nxt

    def _attend(self, x: torch.Tensor, carry: Carry, ctx: ForwardContext) -> torch.Tensor:
        return self.attn(x, carry.shared, ctx.stats, ctx.aux_grad_scale, ctx.split)


class Transformer(nn.Module):
    STORED = {name: Stored.BF16 for name in ("image_start", "image_newline", "image_end")}

    def __init__(self, cfg: ModelConfig, token_map: list[int] | torch.Tensor | None = None,
                 init: bool = True, seed: int = 0):
        """`init`: initialise the weights now (model/init.py, seeded by `seed` and each parameter's
        name, so any layout gets the same values). Built under `torch.device("meta")` with init=False,
        the model is a shape-only template: prune it, `to_empty(device=...)`, then `materialize`."""
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.plan = layer_plan(cfg)
        rows = engram_table_rows(cfg) if cfg.engram_layer_ids else []
        self.embed = Embedding(cfg.vocab_size, cfg.dim, cfg)
        self.layers = nn.ModuleList(
            Block(cfg, role, rows[cfg.engram_layer_ids.index(role.id)] if role.engram else None)
            for role in self.plan
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.qat)
        self.head = Linear(cfg.dim, cfg.vocab_size, cfg)
        self.engram_hasher = NgramHasher(cfg, token_map) if cfg.engram_layer_ids else None
        if cfg.vision_n_layers:
            self.vision = ViT(cfg)
            self.aligner = Aligner(cfg)
            self.image_start = nn.Parameter(torch.empty(cfg.dim))
            self.image_newline = nn.Parameter(torch.empty(cfg.dim))
            self.image_end = nn.Parameter(torch.empty(cfg.dim))
        self.context_parallel: tuple | None = None  # (size, rank, balance, comm): set_context_parallel
        if init:
            init_weights(self, cfg, seed)

    def materialize(self, device: torch.device | str, seed: int = 0) -> "Transformer":
        """A meta-device template (possibly pruned to some stages / sharded to some experts) made real
        on `device`: storage for the parameters it still holds, buffers recomputed, weights initialised
        exactly as the whole model built with the same seed would have them."""
        self.to_empty(device=device)
        reset_buffers(self)
        init_weights(self, self.cfg, seed)
        return self

    def set_recompute(self, mode: str) -> None:
        """Activation recomputation of every block: 'none' | 'selective' | 'full' (model/recompute.py)."""
        validate_recompute(mode)
        for block in self.layers:
            if isinstance(block, Block):
                block.recompute = mode

    def set_context_parallel(self, size: int, rank: int = 0, balance: str = "zigzag", comm=None) -> None:
        """Context parallelism (model/sequence_split.py): every forward then takes whole sequences of
        tokens and runs this rank's positions of them; `comm` does the exchanges (parallel/context.py)."""
        self.context_parallel = None if size == 1 else (size, rank, balance, comm)

    def sequence_split(self, seq_len: int) -> SequenceSplit | None:
        if self.context_parallel is None:
            return None
        size, rank, balance, comm = self.context_parallel
        return SequenceSplit(seq_len, size, rank, balance, comm)

    # --- the three stage pieces --------------------------------------------------------------
    def context(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None,
                stats: StepStats | None = None, aux_grad_scale: float = 1.0) -> ForwardContext:
        """From whole sequences (tokens [B, S]): under context parallelism the Engram n-grams are hashed
        over the whole sequence (so they look back across slice boundaries) and every field is then cut
        to this rank's positions."""
        image_mask = None if token_types is None else token_types >= 0
        engram_ids = None if self.engram_hasher is None else self.engram_hasher(tokens, image_mask)
        split = self.sequence_split(tokens.shape[1])
        if split is not None:
            token_types, image_mask, engram_ids = (None if t is None else split.local(t)
                                                   for t in (token_types, image_mask, engram_ids))
        return ForwardContext(token_types, image_mask, engram_ids, stats or StepStats(), aux_grad_scale, split=split)

    def embed_inputs(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None,
                     images: list[list[torch.Tensor]] | None = None) -> Carry:
        """Token embeddings, with image spans filled when the batch has images, copied to all 4
        streams; the first block's pending pre is one-hot on stream 0.

        images: per sample, the pixel tensors [3, H, W] of its images in order of appearance.
        Under context parallelism tokens are whole sequences and the carry holds this rank's positions;
        each image is encoded once (rank i mod C encodes image i) and its rows reach every rank."""
        split = self.sequence_split(tokens.shape[1])
        if images is not None and any(images):
            if not self.cfg.vision_n_layers:
                raise ValueError("the batch has images but model.vision_n_layers=0 (no vision tower)")
            if token_types is None:
                raise ValueError("a batch with images needs token_types to place them")
            flat = [img for sample in images for img in sample]
            rows_flat = self._encode(flat, split)
            rows, k = [], 0
            for sample in images:
                rows.append(rows_flat[k:k + len(sample)])
                k += len(sample)
            vectors = (as_trained(getattr(self, n), self.STORED[n], self.cfg.qat)
                       for n in ("image_start", "image_newline", "image_end"))
            e = merge_images(self.embed(tokens if split is None else split.local(tokens)), token_types, rows,
                             *vectors, None if split is None else split.positions(tokens.device))
        else:
            if token_types is not None and not simulated(token_types):  # checked on the device, no host read
                torch._assert_async((token_types < 0).all(), "token_types marks image positions but the batch "
                                                               "carries no images")
            e = self.embed(tokens if split is None else split.local(tokens))
        h = e.unsqueeze(2).expand(-1, -1, self.cfg.n_streams, -1).contiguous()
        return Carry(h, one_hot_pre(h))

    def _encode(self, images: list[torch.Tensor], split: SequenceSplit | None) -> list[torch.Tensor]:
        """Aligner rows of every image; split over the context-parallel ranks, then gathered (autograd)."""
        if split is None:
            return encode_images(self.vision, self.aligner, images)
        mine = list(range(split.rank, len(images), split.size))
        counts = [aligner_rows(self.cfg, img) for img in images]
        rows = encode_images(self.vision, self.aligner, [images[i] for i in mine])
        local = (torch.cat(rows) if rows else self.image_start.new_zeros(0, self.cfg.dim)).float()  # one dtype on all
        if torch.is_grad_enabled() and not local.requires_grad:
            local = local.detach().requires_grad_()  # every rank's gather then takes part in backward
        order = [i for r in range(split.size) for i in range(r, len(images), split.size)]
        per_rank = [sum(counts[i] for i in range(r, len(images), split.size)) for r in range(split.size)]
        flat = split.gather_ranks(local, per_rank).split([counts[i] for i in order])
        out: list[torch.Tensor] = [None] * len(images)  # type: ignore[list-item]
        for i, t in zip(order, flat):
            out[i] = t
        return out

    def run_blocks(self, carry: Carry, ctx: ForwardContext, start: int = 0, end: int | None = None) -> Carry:
        for block in self.layers[start:end]:  # Engram lookups of row-sharded tables start before any block
            if block.engram is not None and block.engram.layer_id not in ctx.engram_requests:
                request = block.engram.request(ctx.engram_ids[:, :, block.engram.index])
                if request is not None:
                    ctx.engram_requests[block.engram.layer_id] = request
        for block in self.layers[start:end]:
            if block.engram is not None and block.engram.layer_id in ctx.engram_requests:
                ctx.engram_requests[block.engram.layer_id].wait()
            carry = block(carry, ctx)
        return carry

    def engram_round_requests(self, tokens: torch.Tensor, token_types: torch.Tensor | None, n_microbatches: int,
                              start: int = 0, end: int | None = None) -> list[dict]:
        """The lookups of the row-sharded Engram tables among blocks [start, end) for every micro-batch of
        a round (`tokens` [M x b, S]), counts exchanged (parallel/engram_shard.py `request_round`), id
        exchanges not yet started: per micro-batch, {layer id: request} for `ForwardContext`."""
        out: list[dict] = [{} for _ in range(n_microbatches)]
        blocks = [b for b in self.layers[start:end] if b.engram is not None and b.engram.rows_of is not None]
        if not blocks:
            return out
        ids = self.context(tokens, token_types).engram_ids.chunk(n_microbatches)
        for block in blocks:
            e = block.engram
            for k, request in enumerate(e.rows_of.request_round([t[:, :, e.index] for t in ids])):
                out[k][e.layer_id] = request
        return out

    def final_hidden(self, carry: Carry) -> torch.Tensor:
        """Collapse with the last pending pre, then the final RMSNorm: the head's input [B, S, D]."""
        if self.cfg.residual == "plain":
            return self.norm(carry.h[:, :, 0])
        return self.norm(hc_collapse(carry.h, carry.pre_mix, self.cfg.use_triton))

    def logits(self, carry: Carry) -> torch.Tensor:
        """The head on the final hidden states (fp32 logits [B, S, vocab]; training never builds them
        whole, it runs the head inside the tiled loss, train/loss.py)."""
        return self.head(self.final_hidden(carry)).float()

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None,
                images: list[list[torch.Tensor]] | None = None, stats: StepStats | None = None,
                aux_grad_scale: float = 1.0) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab]. Aux losses ride on the backward pass; their values
        and the expert loads land in `stats`."""
        return self.logits(self.run(tokens, token_types, images, stats, aux_grad_scale))

    def run(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None,
            images: list[list[torch.Tensor]] | None = None, stats: StepStats | None = None,
            aux_grad_scale: float = 1.0, routes: dict[int, torch.Tensor] | None = None,
            recorded: dict[int, torch.Tensor] | None = None) -> Carry:
        """Embedding and every block: the carry the head reads (`final_hidden`, `logits`). `routes` /
        `recorded`: cached MoE routing indices to follow / a dict to record them in, by layer id."""
        ctx = self.context(tokens, token_types, stats, aux_grad_scale)
        ctx.routes, ctx.recorded = routes, recorded
        return self.run_blocks(self.embed_inputs(tokens, token_types, images), ctx)
