"""The DSpark drafter of V4.1-Flash (V41_SPEC §8b; report §2.4.3; the public `inference/model.py`:
`DSparkBlock`, `DSparkAttention`, `DSparkMarkovHead`, `DSparkConfidenceHead`, `Transformer.forward_spec`).

`n_mtp_layers` blocks stored as `mtp.{i}.*`, each the backbone's block (model/transformer.py `Block`: mHC
sites, attention, DeepSeekMoE with its own `dspark_n_routed_experts` top-`dspark_n_activated_experts`
experts and their selection biases) with a sliding-window-only attention (`compress_ratios` entry 0, plain
RoPE theta). It shares the backbone's embedding and head (frozen in the DSpark stage).

Inputs, per anchor t (a position whose token the backbone has consumed; at decoding, the newest one):
- the context: the attention inputs of the backbone's `dspark_target_layer_ids`, each averaged over the 4 hc
  streams (the public `Transformer.forward` collects them as `main_hiddens`; model/transformer.py `Block`
  fills `ForwardContext.captures`), concatenated, then `mtp.0.main_proj` and `mtp.0.main_norm`: `main_x`.
  Every drafter layer's attention turns `main_x` into window keys with its own `wkv` / `kv_norm`, RoPE'd at
  the context positions;
- the block: the token at t + 1 (the last accepted one) followed by `dspark_block_size - 1` noise tokens
  (`dspark_noise_token_id`), at positions t + 1 .. t + K, embedded by the backbone's embedding and copied
  to the 4 streams (the first block starts from the one-hot pre).
Each block query attends over the `window_size` context positions t - W + 1 .. t, the whole block (all K
positions, both directions) and the per-head sink: the public `get_dspark_topk_idxs`.

Outputs at block position k (predicting the token at t + 2 + k): base logits = head(`mtp.{-1}.norm`(x_k))
with x_k the last block's hc collapse; the low-rank Markov head (`markov_head.embed` [vocab, r],
`markov_head.head` [vocab, r]) adds head(embed(previous token)) -- the previous token is the block's first
token for k = 0, then the token drafted (at training: the true token) at k - 1; the confidence head
`confidence_head.proj` (Linear(dim + r -> 1), fp32) reads [x_k (before the norm), the Markov embedding] and
gives the logit of position k's conditional acceptance.

Training runs every anchor of a sequence in one pass (`DSpark.hidden`): the blocks process the [B, S x K]
draft tokens as a sequence whose attention is the CSA2 core (model/sparse_attention.py) with the context
window as its band -- query row t of `main_x`'s keys -- and the K positions of anchor t's block as its
"selected" slots; the K queries of an anchor share their keys, so they go in as K x H heads of one row
(MQA-like, the sink repeated per block position). Under context parallelism (`ForwardContext.split`) the
anchors are this rank's positions and the window band comes from the neighbour as the backbone's does
(`Attention._halos`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from flashtrain.model.attention import Attention
from flashtrain.model.aux import StepStats
from flashtrain.model.carry import Carry
from flashtrain.model.config import ModelConfig
from flashtrain.model.init import init_weights, reset_buffers
from flashtrain.model.layer_plan import LayerRole, Role
from flashtrain.model.mhc import hc_collapse, one_hot_pre
from flashtrain.model.norm import RMSNorm
from flashtrain.model.rope import rope_angles
from flashtrain.model.sequence_split import SequenceSplit
from flashtrain.model.sparse_attention import sparse_attention_lean
from flashtrain.model.transformer import Block, ForwardContext


@dataclass
class DraftInputs:
    """What every drafter layer's attention reads besides its block: the projected context `main_x`
    [B, L, dim] of the L anchors (this rank's under context parallelism), the block size, and the global
    position of anchor row 0 (`offset`; decoding drafts from a suffix of the sequence)."""

    main_x: torch.Tensor
    block_size: int
    offset: int = 0


def drafter_config(cfg: ModelConfig) -> ModelConfig:
    """The drafter blocks' view of the model config: their own routed experts (`get_moe_config` in the
    public code gives layers past `n_layers` `dspark_n_routed_experts` / `dspark_n_activated_experts`)."""
    return dataclasses.replace(cfg, n_routed_experts=cfg.dspark_n_routed_experts,
                               n_activated_experts=cfg.dspark_n_activated_experts)


class DSparkAttention(Attention):
    """The public `DSparkAttention`: the backbone's attention parameters (own query, own `wkv` / `kv_norm`),
    keys from the context window and the whole block, sliding window only (compress ratio 0)."""

    def forward(self, x: torch.Tensor, draft: DraftInputs, split: SequenceSplit | None = None) -> torch.Tensor:
        """x [B, L x K, dim] (attn_norm'ed; row t K + k = anchor t's block position k) -> [B, L x K, dim]."""
        B, LK, _ = x.shape
        K = draft.block_size
        L = LK // K
        split = split or SequenceSplit.whole(L)
        pos = split.positions(x.device) + draft.offset
        ccos, csin = rope_angles(self.rope_freqs, pos)
        main_kv = self.window_keys(draft.main_x, ccos, csin)  # the context's keys, at their positions
        block_pos = (pos.unsqueeze(1) + 1 + torch.arange(K, device=x.device)).reshape(-1)
        cos, sin = rope_angles(self.rope_freqs, block_pos)
        _, q = self.queries(x, cos, sin)
        block_kv = self.window_keys(x, cos, sin)  # FP8 under model.qat.window_kv_fp8, as main_kv (public act_quant)
        q = q.reshape(B, L, K * self.n_heads, self.head_dim)  # head k H + h: block position k, head h
        sink = self.attn_sink.repeat(K)
        slots = torch.arange(LK, device=x.device).view(1, L, K).expand(B, L, K)  # anchor t's block rows
        outs = []
        for (a, b), o, (halo_kv, _) in zip(split.chunks, split.offsets, self._halos(split, main_kv, None)):
            keys = main_kv[:, o:o + b - a] if split.size == 1 else torch.cat(
                [halo_kv.to(main_kv.dtype), main_kv[:, o:o + b - a]], dim=1)
            out_c, _ = sparse_attention_lean(q[:, o:o + b - a], keys, block_kv, slots[:, o:o + b - a], sink,
                                             self.window, self.scale, self.chunk, halo_kv.shape[1], self.use_triton)
            outs.append(out_c)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return self.output(o.reshape(B, LK, self.n_heads, self.head_dim), cos, sin)


class DSparkMarkovHead(nn.Module):
    """The public `DSparkMarkovHead`: logit bias head(embed(previous token)) of rank `dspark_markov_rank`
    (DeepSpec's `VanillaMarkov`: `markov_w1` embedding, `markov_w2` projection to the vocabulary)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids [...] -> (logit bias [..., vocab] fp32, the embedding [..., rank])."""
        e = self.embed(token_ids)
        return torch.nn.functional.linear(e.float(), self.head.weight.float()), e


class DSparkConfidenceHead(nn.Module):
    """The public `DSparkConfidenceHead`: Linear([hidden, Markov embedding] -> 1) in fp32, the logit of the
    position's conditional acceptance probability."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1, bias=False)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden.float(), markov_embed.float()], dim=-1)
        return torch.nn.functional.linear(x, self.proj.weight.float()).squeeze(-1)


class DSparkBlock(Block):
    """One drafter block (`mtp.{i}`): the backbone block with `DSparkAttention`; the first one also holds
    `main_proj` / `main_norm`, the last one `norm`, `markov_head` and `confidence_head`."""

    attention_cls = DSparkAttention

    def __init__(self, cfg: ModelConfig, role: LayerRole, stage: int, n_stages: int, n_targets: int):
        super().__init__(cfg, role, None)
        self.stage = stage
        if stage == 0:
            self.main_proj = nn.Linear(n_targets * cfg.dim, cfg.dim, bias=False)
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if stage == n_stages - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.markov_head = DSparkMarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = DSparkConfidenceHead(cfg.dim + cfg.dspark_markov_rank)

    def _attend(self, x: torch.Tensor, carry: Carry, ctx: ForwardContext) -> torch.Tensor:
        return self.attn(x, ctx.draft, ctx.split)


def block_tokens(first: torch.Tensor, block_size: int, noise_id: int) -> torch.Tensor:
    """The draft block of every anchor: first [B, L] (the token after the anchor; < 0 where there is none)
    -> [B, L, K] = [first, noise, ..., noise] (the public `forward_embed`; DeepSpec `create_noise_embed`)."""
    ids = first.new_full((*first.shape, block_size), noise_id)
    ids[..., 0] = torch.where(first >= 0, first, noise_id)
    return ids


def context_features(captures: dict[int, torch.Tensor], target_ids: list[int]) -> torch.Tensor:
    """The target layers' hc-means [B, L, dim] each -> [B, L, n_targets x dim] (the public `main_hidden`)."""
    return torch.cat([captures[i] for i in target_ids], dim=-1)


class DSpark(nn.Module):
    """The drafter: `mtp` = the `n_mtp_layers` DSpark blocks (state-dict names `mtp.{i}.*` as released).
    Built on the meta device with init=False it is a shape-only template (`materialize`), like the
    Transformer; initial weights are seeded by (seed, global name) (model/init.py)."""

    def __init__(self, cfg: ModelConfig, init: bool = True, seed: int = 0):
        super().__init__()
        cfg.validate_drafter()
        self.cfg = cfg
        dcfg = drafter_config(cfg)
        n = cfg.n_mtp_layers
        self.mtp = nn.ModuleList(
            DSparkBlock(dcfg, LayerRole(cfg.n_layers + i, Role.SWA, 0, None, None, False, False, False), i, n,
                        len(cfg.dspark_target_layer_ids))
            for i in range(n))
        if init:
            init_weights(self, cfg, seed)

    @property
    def block_size(self) -> int:
        return self.cfg.dspark_block_size

    @property
    def moe_layers(self) -> dict[int, nn.Module]:
        """Global layer id -> this drafter's MoE (ids n_layers .. n_layers + n_mtp_layers - 1)."""
        return {block.layer_id: block.ffn for block in self.mtp}

    def materialize(self, device: torch.device | str, seed: int = 0) -> "DSpark":
        self.to_empty(device=device)
        reset_buffers(self)
        init_weights(self, self.cfg, seed)
        return self

    def set_recompute(self, mode: str) -> None:
        for block in self.mtp:
            block.recompute = mode

    def hidden(self, main_hidden: torch.Tensor, tokens: torch.Tensor, embed: nn.Embedding,
               stats: StepStats | None = None, aux_grad_scale: float = 1.0, split: SequenceSplit | None = None,
               offset: int = 0) -> torch.Tensor:
        """Every anchor's block in one pass: main_hidden [B, L, n_targets x dim] (the context at the L anchors),
        tokens [B, L, K] (`block_tokens`) -> the last block's hc collapse x [B, L, K, dim] (before `norm`)."""
        B, L, K = tokens.shape
        first = self.mtp[0]
        main_x = first.main_norm(first.main_proj(main_hidden))
        e = embed(tokens.reshape(B, L * K))
        h = e.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        carry = Carry(h, one_hot_pre(h))
        ctx = ForwardContext(None, None, None, stats or StepStats(), aux_grad_scale, split=split,
                             draft=DraftInputs(main_x, K, offset))
        for block in self.mtp:
            carry = block(carry, ctx)
        return hc_collapse(carry.h, carry.pre_mix, self.cfg.use_triton).view(B, L, K, -1)

    def base_logits(self, x: torch.Tensor, head: nn.Linear) -> torch.Tensor:
        """head(norm(x)) in fp32 (x [..., dim] from `hidden`)."""
        return head(self.mtp[-1].norm(x)).float()

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mtp[-1].markov_head(prev)

    def confidence(self, x: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        return self.mtp[-1].confidence_head(x, markov_embed)

    @torch.no_grad()
    def draft(self, x: torch.Tensor, first: torch.Tensor, head: nn.Linear):
        """The public `forward_head` at temperature 0 (greedy), for blocks x [N, K, dim] whose first token is
        first [N]: position k's logits get the Markov bias of the token drafted at k - 1 (the block's first
        token for k = 0), its argmax is the draft. Returns (drafted tokens [N, K], logits [N, K, vocab],
        confidence logits [N, K])."""
        logits = self.base_logits(x, head)
        prev, out, embeds = first, [], []
        for k in range(x.shape[1]):
            bias, e = self.markov(prev)
            logits[:, k] += bias
            embeds.append(e)
            prev = logits[:, k].argmax(-1)
            out.append(prev)
        return torch.stack(out, 1), logits, self.confidence(x, torch.stack(embeds, 1))
