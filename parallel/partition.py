"""Cost-aware pipeline partitioning (DESIGN.md "Parallelism"): split the model into contiguous stages
minimising the largest per-stage memory, and report memory and compute per stage.

Units, in order: `embed` (token embedding + vision tower + aligner + image vectors: the first stage),
blocks 0..L-1 (Engram modules inside blocks 1 and 14), `head` (final norm + LM head: the last stage).
The embedding/vision unit is merged into block 0 and the head into the last block, so the first and last
stages always carry them.

Cost model (fast and analytic; launch/estimate.py simulates the real step and is the measurement):
- state bytes of a parameter = `bytes_per_value` x (parameter + gradient + optimizer state / the
  replicas that share it under ZeRO-1; a row-sharded Engram table all three / dp), where the optimizer state
  is `state_of[name]` values per value, as its optimizer declares it (train/optim `STATE_BUFFERS`, by the
  routing of train/optim/routing.py); under mixed precision plus one bf16 copy of the dense weights
  (autocast's cast cache, shared by every micro-batch of a step), except the weights whose copy each
  micro-batch makes itself (on a QAT grid, or FP8 codes under `model.fp8.enabled`: `weight_copy_bytes`),
  counted with its activations;
- activations, per block and micro-batch (`block_activations`): the input `carry` (the boundary tensors),
  what the forward keeps for backward (`kept`, depending on `train.recompute`) and the transient
  `work` of its backward (recomputation included). A stage holding F micro-batches in flight
  (`in_flight_microbatches`: 1F1B's warm-up, or the most torch's own action order ever leaves on it) peaks at
  state + F x sum(carry + kept) + max(work) + what it holds once (`_stage_fixed`: its last input gradients,
  the shared KV / index keys' gradients its backward accumulates, the pipeline round's inputs) -- blocks run
  their backward one at a time. A rank of two stages (interleaved, V-shaped) is priced at the point of its
  schedule where its stages hold the most together, with one backward working set (`rank_costs`).
  The per-token terms are the tensors the reference implementation keeps (bf16 autocast), term by term
  (residual streams, Sinkhorn iterates, attention, routed and shared experts, indexer, Engram);
  `tests/test_partition.py` checks them against the estimator's per-block measurement
  (`train.estimate.probe_block`) for every role and recompute mode;
- compute per token of a block = 2 x its activated parameters + attention (4 x heads x head_dim x
  (window + selected compressed entries)) + indexer scoring (Full / Reindex: 2 x index heads x index
  head_dim x visible compressed entries, on average seq_len / (2 m)).
The objective is the maximum per-stage memory (state + activations), then the slowest stage's compute
among the splits within `parallel.partition_memory_slack` of that memory, then the most even memory
(`partition`).
Works on the meta device (shapes only).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torch import nn

from flashtrain.config.errors import ConfigError
from flashtrain.model.carry import SHARED_NAMES, shared_reads, shared_writes
from flashtrain.model.config import ModelConfig
from flashtrain.model.layer_plan import LayerRole, Role
from flashtrain.model.param_kinds import ParamKind, parameter_kinds


@dataclass
class PartitionCosts:
    bytes_per_value: int = 4  # fp32 master weights, gradients and optimizer state
    recompute: str = "none"  # train.recompute
    mixed_precision: bool = True  # bf16 autocast (CUDA); False: fp32 activations (the CPU runs)
    ep: int = 1  # parallel.ep: routed experts per rank = n_routed_experts / ep
    dp: int = 1  # data-parallel ranks per stage
    zero: bool = False  # ZeRO-1: optimizer state / its replica group (dp, or dp / ep for routed experts)
    engram_shard: bool = False  # Engram tables (and their gradient and state) row-sharded over dp
    round_microbatches: int = 0  # pipeline: micro-batches per round, whose inputs the device holds (0: no pipeline)
    kv_segments: int = 1  # query segments per rank (2: context parallelism with cp_balance=zigzag)

    def param_state_bytes(self, kind: ParamKind, numel: int, n_state: int) -> float:
        """Parameter + gradient + `n_state` optimizer values of one parameter of `kind` (its local share)."""
        expert = kind is ParamKind.ROUTED_EXPERT
        local = numel / (self.ep if expert else 1)
        if self.engram_shard and self.dp > 1 and kind is ParamKind.ENGRAM_TABLE:
            return local / self.dp * self.bytes_per_value * (2 + n_state)
        replicas = (self.dp // self.ep if expert else self.dp) if self.zero else 1
        return local * self.bytes_per_value * (2 + n_state / max(1, replicas))


INDEX_SCORE_BYTES = 6  # the indexer's chunk scores under context parallelism, per score (block_activations)
FP8_SAVED_BYTES = 1 + 4 / 32  # an FP8 Linear's saved input: an E4M3 code + an fp32 scale per 32 values


def _nbytes(spec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def _engram_cols(cfg: ModelConfig) -> int:
    return (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads if cfg.engram_layer_ids else 0


def block_activations(cfg: ModelConfig, role: LayerRole, routed_params: int, engram_rows: int, carry_bytes: int,
                      tokens: int, micro_batch: int, costs: PartitionCosts, seq_tokens: int | None = None,
                      weight_copies: int = 0, shared_grads: int = 0, kv_grad: int = 0) -> dict:
    """Per micro-batch of `tokens` tokens: the block's input `carry` (bytes), what its forward `kept`
    for backward under `costs.recompute`, and the transient `work` of its backward. Per token, the
    tensors of the reference implementation under bf16 autocast (fp32 master data), term by term:

      residual streams  20 hc D      the [hc, D] carry in fp32 (3x) and its bf16 / flattened copies
      dense             34 D         norms, sublayer in/outputs, attention output, MoE output
      Sinkhorn          16 R hc (hc + 1)   R iterations of the two mHC mixes' [hc, hc] and row/column sums
      attention         6 H hd + 2 og olr + 10 q_lora
      routed experts    4 k D + 24 k I     the gathered inputs (fp32) and each pick's intermediates
      shared experts    22 ns I
      indexer           6 D + 18 topk + 2 Hi dhi + 22 hd / m        (Full / Reindex layers)
      Engram            12 hc D + 4 D + (2 hd_e + 8) cols           (Engram layers)
    plus the bf16 copies of the local routed experts' weights (autocast casts each expert slice per
    micro-batch), and `weight_copies`, the bytes of the weight copies each micro-batch's forward saves for
    its backward (`weight_copy_bytes`: the weights on a QAT grid, the FP8 Linears' codes). With FP8 GEMMs
    (`model.fp8.enabled`) the FP8 Linears keep their inputs as E4M3 codes with a scale per 32 (1 + 1/8 bytes
    a value, model/fp8_linear.py) instead of `act` bytes. Measured against `train.estimate.probe_block`
    (tests/test_partition.py): kept within a
    few percent from flash_tiny to exp=flash, work within about 30% (a transient peak). `selective`
    keeps the matmul outputs (bf16: projections, gate scores in fp32, expert intermediates) and the
    Engram hash ids; `full` the hash ids only. Backward work: the routed experts' gradients (28 k D per
    token, plus a dense gradient the size of one stacked local expert weight per slice: 2 of them live),
    or the chunked sparse attention's gathered-KV gradients (17 topk hd per query of a chunk), or the
    Engram table's dense gradient (in the activation dtype), whichever is largest (they do not overlap);
    recomputation adds the activations it rebuilds (what `none` keeps minus what the mode kept).

    Expert parallelism (`costs.ep` > 1) under `selective`: the all-to-all's outputs, which the recomputation
    policy keeps (4 D + act (D + 1) bytes per received (token, expert) pair, k per token: the fp32 MoE input as
    sent, the expert outputs sent back, the routing weight; measured on exp=flash at ep=128 with
    `launch/estimate.py --phases`, the per-block records).

    Context parallelism: `tokens` are this rank's, `seq_tokens` the whole sequences' (default: the
    same). The compressed entries (22 hd / m per token above) are this rank's positions' (the gathered whole
    is the carry's shared KV), and the indexer scores a chunk of queries against all of them: [chunk, index
    heads, S / m] scores per chunk in the forward and again in a recomputing backward, 6 bytes a score
    (measured: the forward transient of a block in `launch/estimate.py --phases`, 12.9 GB for a ratio-1 layer
    of exp=flash at 64K, cp=64, chunk 1024, 32 index heads; 6.4 GB at ratio 2). The scores are a transient of
    the indexer's (re)computation, before the rest of the block is rebuilt: the work is the larger of the two,
    not their sum (a ratio-1 Reindex layer at 1M / cp=512 under full recomputation adds 6.93 GB in its
    backward: the 6.44 GB of scores and 0.5 GB).

    `shared_grads`: the bytes of the differentiable shared fields (compressed KV, index keys) the block reads
    from its carry or writes -- their gradients arrive whole in its backward (at 1M / cp=512 a Reuse layer's
    backward adds 6.84 GB, the whole sequence's KV gradient, 2.15 GB, included). `kv_grad`: the bytes of the
    whole-sequence compressed KV the block's attention reads (the carry's `kv`): each query segment of the
    rank (`costs.kv_segments`: two under zigzag context parallelism) runs the sparse attention once, and each
    run's backward makes a whole-sequence KV gradient before the two are summed -- three at once, two more
    than `shared_grads` counts (measured at 1M / cp=256: zeros, zeros, their sum, 2.15 GB each).

    Full recomputation (measured per operator at 1M / cp=256 and cp=128, `launch/estimate.py --phases`):
    the backward's peak is the largest of three moments that do not overlap -- the rebuild, at the MoE,
    when the block's rebuilt tensors are all live with its fp32 expert outputs (4 k D bytes a token; the
    MoE's backward then runs inside what the rebuild frees); the attention's backward, when the shared
    fields' gradients form beside the fp32 query gradient (4 H hd bytes a token); and the indexer's chunk
    scores. (Without recomputation or under `selective` the kept tensors are not rebuilt, and the model
    above stacks the backward's gradients on what is rebuilt.)"""
    D, hc, k, I = cfg.dim, cfg.n_streams, cfg.n_activated_experts, cfg.moe_inter_dim
    seq_tokens = seq_tokens or tokens
    H, hd, ns, R = cfg.n_heads, cfg.head_dim, cfg.n_shared_experts, cfg.hc_sinkhorn_iters
    if cfg.ffn == "dense":  # the MoE ablation's SwiGLU of (k + ns) I: a shared expert that wide, nothing routed
        k, ns = 0, k + ns
    act = 2 if costs.mixed_precision else 4  # bytes of a value autocast computes in bf16
    engram = role.id in cfg.engram_layer_ids
    cols = _engram_cols(cfg)
    ids = 8 * cols * len(cfg.engram_layer_ids)  # the hash ids of every Engram layer (ForwardContext)
    local_routed = routed_params // costs.ep
    experts = 4 * k * D + 24 * k * I + 22 * ns * I  # the routed and shared experts' part, per token
    per_token = (20 * hc * D + 34 * D + 16 * R * hc * (hc + 1) + 6 * H * hd + 2 * cfg.o_groups * cfg.o_lora_rank
                 + 10 * cfg.q_lora_rank + experts)
    selective = (act * (cfg.q_lora_rank + H * hd + hd + D + 2 * k * I + k * D + ns * (2 * I + D))
                 + 4 * cfg.n_routed_experts + 8 * 2 * (2 + hc) * hc)
    compressed = 0
    if role.has_indexer:
        per_token += 6 * D + 18 * cfg.index_topk + 2 * cfg.index_n_heads * cfg.index_head_dim
        # one rank: the whole sequence's; under context parallelism its own positions' (the gathered whole
        # is the carry's shared KV)
        compressed = tokens * (22 * hd // role.compress_ratio)
        selective += act * cfg.index_n_heads * cfg.index_head_dim + 4 * cfg.index_n_heads
        if role.role is Role.FULL:  # the compressor's projections
            selective += act * 2 * hd
    if engram:
        per_token += 12 * hc * D + 4 * D + (2 * cfg.engram_head_dim + 8) * cols
        selective += act * (hc + 1) * D
    if not costs.mixed_precision:  # fp32 throughout: no bf16 duplicates, the rest twice as large (measured)
        per_token = int(per_token * 0.85)
    if cfg.fp8.enabled:
        per_token -= int((act - FP8_SAVED_BYTES) * fp8_input_width(cfg, role))
    # expert parallelism: selective recomputation keeps the all-to-all's outputs (model/recompute.py saves the
    # exchange, so backward does not repeat it), per received (token, expert) pair -- k per token, balanced --
    # the MoE input as sent (fp32: the norm's output), the expert outputs sent back and the routing weight
    exchanged = k * (4 * D + act * (D + 1)) if costs.ep > 1 else 0
    none_kept = (tokens * per_token + compressed + (act * local_routed if costs.mixed_precision else 0)
                 + weight_copies)
    work = tokens * 28 * k * D + 8 * local_routed // 3
    if role.compress_ratio:
        work = max(work, 17 * cfg.index_topk * hd * micro_batch * min(cfg.attn_chunk_size, tokens // micro_batch))
    scores = 0
    if role.has_indexer and seq_tokens > tokens:  # long sequences split over ranks: the indexer's chunk scores
        chunk = min(cfg.attn_chunk_size, tokens // micro_batch)
        scores = INDEX_SCORE_BYTES * chunk * cfg.index_n_heads * seq_tokens // role.compress_ratio
    if engram:  # the table's dense gradient, last in the block's backward
        work = max(work, act * engram_rows * cfg.engram_head_dim)
    if costs.recompute == "none":
        kept = none_kept
    elif costs.recompute == "selective":
        kept = tokens * (selective + ids + exchanged)
    else:
        kept = tokens * ids
    # the chunk scores are a transient of the indexer's (re)computation, before the rest of the block is rebuilt;
    # the gradients of the shared fields the block reads (`shared_grads`, their size) arrive in its backward,
    # the KV's once per query segment before they are summed
    grads = shared_grads + 2 * (costs.kv_segments - 1) * kv_grad
    if costs.recompute == "full":
        rebuild = none_kept - kept + tokens * 4 * k * D + 8 * local_routed // 3
        if role.role is Role.FULL and scores:
            # a Full layer's indexer scores the whole-sequence index keys its compressor has just built: its rebuild
            # so far (all but the experts) and the shared fields it writes are live beside the scores
            scores += tokens * (per_token - experts) + shared_grads
        work = max(rebuild, grads + tokens * 4 * H * hd, work, scores)
    else:
        work = max(work + none_kept - min(kept, none_kept) + grads, scores)
    return {"carry": carry_bytes, "kept": kept, "work": work}


def fp8_input_width(cfg: ModelConfig, role: LayerRole) -> int:
    """Per token, the input channels of a block's FP8 Linears (model/formats.py): attention wq_a, wkv (dim),
    wq_b (q_lora_rank), wo_b (o_groups x o_lora_rank); the indexer's wq_b; the shared expert (w1, w3: dim;
    w2: moe_inter_dim); Engram's wkv."""
    width = 2 * cfg.dim + cfg.q_lora_rank + cfg.o_groups * cfg.o_lora_rank
    width += cfg.n_shared_experts * (2 * cfg.dim + cfg.moe_inter_dim)
    if role.has_indexer:
        width += cfg.q_lora_rank
    if role.id in cfg.engram_layer_ids:
        width += _engram_cols(cfg) * cfg.engram_head_dim
    return width


def weight_copies(block: nn.Module, cfg: ModelConfig) -> tuple[int, int, int]:
    """The values of a block's dense weights (the routed experts and the Engram table aside) by the copy its
    forward computes with (model/formats.py): (FP8 codes, made by each micro-batch's forward: the FP8 Linears
    under `model.fp8.enabled`, model/fp8_linear.py; quantised copies in the matmul's dtype, made by each
    forward from the master: the weights on a QAT grid, `model.qat.weights_fp8` / `weights_bf16`; the rest,
    which autocast copies to bf16 once per step)."""
    from flashtrain.model.formats import Stored, on_grid, weight_formats

    formats, kinds = weight_formats(block), parameter_kinds(block)
    fp8 = quantised = rest = 0
    for name, p in block.named_parameters():
        if kinds[name] in (ParamKind.ROUTED_EXPERT, ParamKind.ENGRAM_TABLE):
            continue
        fmt = formats[name]
        if cfg.fp8.enabled and fmt is Stored.FP8:
            fp8 += p.numel()
        elif fmt is not None and on_grid(fmt, cfg.qat):
            quantised += p.numel()
        else:
            rest += p.numel()
    return fp8, quantised, rest


def copy_bytes(copies: tuple[int, int, int], costs: PartitionCosts) -> tuple[int, int]:
    """`weight_copies` in bytes: (cached once per step: autocast's bf16 copies under mixed precision; saved by
    each micro-batch: the FP8 codes with their tile scales, the quantised copies in the activation dtype)."""
    fp8, quantised, rest = copies
    act = 2 if costs.mixed_precision else 4
    return (2 * rest if costs.mixed_precision else 0), int(fp8 * (1 + 1 / (32 * 32)) + act * quantised)


def weight_copy_bytes(block: nn.Module, cfg: ModelConfig, costs: PartitionCosts) -> tuple[int, int]:
    """`copy_bytes(weight_copies(block, cfg), costs)`."""
    return copy_bytes(weight_copies(block, cfg), costs)


def unit_costs(model: nn.Module, cfg: ModelConfig, state_of: dict[str, int], seq_len: int,
               micro_batch: int, costs: PartitionCosts, local_len: int | None = None) -> list[dict]:
    """Per block: state bytes, activations of one micro-batch (`carry`, `kept`, `work`, and
    `activation_bytes` = carry + kept, what each micro-batch in flight holds; `new_carry_bytes`, the
    part of the carry the previous block wrote -- all a block after a stage's first adds), forward
    FLOPs per token and the part of them in the attention core and the indexer
    (`attention_flops_per_token`: what `train.recompute=selective` runs again in backward), with the
    embedding/vision unit folded into block 0 and the head into the last block. `local_len`: this
    rank's positions of each sequence under context parallelism. (`UnitInventory` once, then its
    `costs` for many layouts: the layout search of train/plan/layouts.py.)"""
    return UnitInventory(model, cfg, state_of).costs(seq_len, micro_batch, costs, local_len)


class UnitInventory:
    """What `unit_costs` reads from the model, read once: per block its parameters (kind, size,
    optimizer buffers), activated parameters, routed-expert and Engram sizes, its forward FLOPs per token
    at a sequence length, and the boundary tensors before it; the parameters outside the blocks. `costs`
    then prices one layout (sharing, recompute, micro-batch shape) with the arithmetic of `unit_costs`."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, state_of: dict[str, int]):
        from flashtrain.parallel.pipeline import live_shared_fields

        self.cfg, self.plan = cfg, model.plan
        kinds = parameter_kinds(model)
        experts = [b.ffn.experts for b in model.layers if hasattr(b.ffn, "experts")]  # none with `ffn: dense`
        per_expert = sum(p.numel() for p in experts[0].parameters()) // cfg.n_routed_experts if experts else 0
        self.blocks = []
        for role, block in zip(model.plan, model.layers):
            prefix = f"layers.{role.id}."
            params = sum(p.numel() for p in block.parameters())
            engram = 0 if block.engram is None else block.engram.embed.weight.numel()
            routed = sum(p.numel() for p in block.ffn.experts.parameters()) if hasattr(block.ffn, "experts") else 0
            self.blocks.append({
                "role": role, "params": params, "engram": engram, "routed": routed,
                "activated": params - engram - routed + cfg.n_activated_experts * per_expert,
                "rows": 0 if block.engram is None else block.engram.embed.weight.shape[0],
                "state": [(kinds[prefix + n], p.numel(), state_of[prefix + n])
                          for n, p in block.named_parameters()],
                "written": live_shared_fields(model.plan, role.id), "copies": weight_copies(block, cfg),
                "reads": shared_reads(role), "writes": shared_writes(role)})
        self.outside = [(n, kinds[n], p.numel(), state_of[n]) for n, p in model.named_parameters()
                        if not n.startswith("layers.")]
        self._specs: dict = {}

    def _boundary(self, layer: int, micro_batch: int, seq_len: int, local_len: int):
        from flashtrain.parallel.pipeline import boundary_specs

        key = (layer, micro_batch, seq_len, local_len)
        if key not in self._specs:
            self._specs[key] = boundary_specs(self.cfg, self.plan, layer, micro_batch, seq_len, local_len)
        return self._specs[key]

    def costs(self, seq_len: int, micro_batch: int, costs: PartitionCosts, local_len: int | None = None
              ) -> list[dict]:
        """`unit_costs` of this model for one layout."""
        cfg = self.cfg
        units = []
        local_len = local_len or seq_len
        tokens = local_len * micro_batch
        # a pipeline step holds its round's inputs on the device (tokens, token types, labels: int64)
        round_inputs = 3 * 8 * seq_len * micro_batch * costs.round_microbatches
        for blk in self.blocks:
            role = blk["role"]
            selected = cfg.index_topk if role.compress_ratio else 0
            attention = 4 * cfg.n_heads * cfg.head_dim * (cfg.window_size + selected)
            flops = 2 * blk["activated"] + attention
            if role.has_indexer:
                visible = seq_len / (2 * role.compress_ratio)
                flops += 2 * cfg.index_n_heads * cfg.index_head_dim * visible
                attention += 2 * cfg.index_n_heads * cfg.index_head_dim * visible
            specs = self._boundary(role.id, micro_batch, seq_len, local_len)
            carry = sum(_nbytes(s) for s in specs)
            written = blk["written"]  # inside a stage, only what the previous block wrote is new;
            new_carry = sum(_nbytes(s) for s in specs  # the rest are the same tensors
                            if s.name in ("h", "pre_mix") or (s.name in written and written[s.name].id == role.id - 1))
            rows = blk["rows"]
            if rows and costs.engram_shard and costs.dp > 1:  # the local row block's dense gradient only
                rows = -(-rows // costs.dp)
            cached, per_microbatch = copy_bytes(blk["copies"], costs)
            # the differentiable shared fields (compressed KV, index keys) the block reads from its carry or writes:
            # their gradients arrive whole in its backward
            shared = [s for s in specs if s.differentiable and s.name in SHARED_NAMES]
            read = sum(_nbytes(s) for s in shared if s.name in blk["reads"])
            after = (self._boundary(role.id + 1, micro_batch, seq_len, local_len)
                     if blk["writes"] and role.id + 1 < len(self.blocks) else ())
            read += sum(_nbytes(s) for s in after if s.differentiable and s.name in blk["writes"])
            # the whole-sequence compressed KV the attention reads (a Full layer: the one it writes)
            kv = sum(_nbytes(s) for s in (specs if "kv" in blk["reads"] else after) if s.name == "kv") \
                if role.compress_ratio else 0
            acts = block_activations(cfg, role, blk["routed"], rows, carry, tokens, micro_batch, costs,
                                     seq_len * micro_batch, per_microbatch, read, kv)
            # this rank's share of the block's state (experts, ZeRO-1, Engram rows) + autocast's bf16 copies of
            # the dense weights, once per step
            state = int(sum(costs.param_state_bytes(kind, numel, n_state) for kind, numel, n_state in blk["state"]))
            state += cached
            units.append({"name": f"layers.{role.id}", "state_bytes": state, "carry_bytes": acts["carry"],
                          "new_carry_bytes": new_carry, "kept_bytes": acts["kept"], "work_bytes": acts["work"],
                          "activation_bytes": acts["carry"] + acts["kept"], "flops_per_token": flops,
                          "attention_flops_per_token": attention,
                          "input_grad_bytes": sum(_nbytes(s) for s in specs if s.differentiable),
                          "shared_grad_bytes": sum(_nbytes(s) for s in shared), "round_input_bytes": round_inputs})
        first, last = units[0], units[-1]
        for n, kind, numel, n_state in self.outside:
            unit = last if n.startswith(("head.", "norm.")) else first
            unit["state_bytes"] += int(costs.param_state_bytes(kind, numel, n_state))
            if kind is ParamKind.HEAD:
                unit["flops_per_token"] += 2 * numel
        return units


def bounds_from_counts(counts: list[int]) -> list[tuple[int, int]]:
    """Layer counts per stage -> contiguous [start, end) ranges."""
    bounds, at = [], 0
    for k in counts:
        bounds.append((at, at + k))
        at += k
    return bounds


def in_flight_microbatches(pp: int, schedule: str = "1f1b", microbatches: int | None = None) -> list[int]:
    """Micro-batches whose activations each stage holds at its peak: 1F1B's stage s of P holds P - s (its
    warm-up); with two stages per rank, the most a stage holds at any point of its rank's schedule
    (`in_flight_states`) -- a bound for the partitioner's per-stage table; a rank's memory is priced by
    `rank_costs` at the points where its two stages hold the most together."""
    if schedule == "1f1b" or pp == 1:
        return [pp - s for s in range(pp)]
    out = [0] * (2 * pp)
    for rank, points in enumerate(in_flight_states(pp, schedule, microbatches)):
        for k, stage in enumerate(_rank_stages(pp, schedule, rank)):
            out[stage] = max(point[k] for point in points)
    return out


def _rank_stages(pp: int, schedule: str, rank: int) -> list[int]:
    """The stages pipeline rank `rank` holds, in increasing order (parallel/pipeline.py `stage_ids`)."""
    from flashtrain.parallel.config import ParallelConfig
    from flashtrain.parallel.pipeline import stage_ids

    return stage_ids(ParallelConfig(pp=pp, pipeline_schedule=schedule), rank)


@functools.lru_cache(maxsize=64)
def in_flight_states(pp: int, schedule: str = "1f1b", microbatches: int | None = None) -> list[list[tuple[int, ...]]]:
    """Per pipeline rank, the micro-batches in flight on each of its stages (in increasing stage order) at the
    points of its schedule where no other point holds as many or more on every stage: its activations peak
    at one of them. 1F1B: [(P - r,)]. Two stages per rank: torch.distributed.pipelining's own order of the
    rank's actions (`_schedule_actions`), a forward adding a micro-batch to its stage and a backward (full, or
    the input half of a split one) taking one away; `microbatches` per round (default 2 P), which sets
    interleaved 1F1B's warm-up (rounds of M / max(1, M // P)). E.g. interleaved 1F1B, P = 4, rank 3 (stages 3
    and 7): 4 forwards of stage 3, then stage 7's forwards and backwards alternate while stage 3's go on:
    (5, 0) and (4, 1)."""
    if schedule == "1f1b" or pp == 1:
        return [[(pp - r,)] for r in range(pp)]
    m = microbatches or 2 * pp
    out = []
    for rank in range(pp):
        stages = _rank_stages(pp, schedule, rank)
        count, points = dict.fromkeys(stages, 0), set()
        for action in _schedule_actions(pp, schedule, m, rank):
            for a in action.sub_actions or (action,):
                kind = a.computation_type.name
                if kind == "FORWARD":
                    count[a.stage_index] += 1
                elif kind in ("FULL_BACKWARD", "BACKWARD_INPUT"):
                    count[a.stage_index] -= 1
                points.add(tuple(count[st] for st in stages))
        out.append(sorted(p for p in points if not any(q != p and all(x >= y for x, y in zip(q, p)) for q in points)))
    return out


def _schedule_actions(pp: int, schedule: str, microbatches: int, rank: int) -> list:
    """The actions of pipeline rank `rank` in the order torch.distributed.pipelining runs them: the schedule
    class's own `_calculate_single_rank_operations` (private) on an instance given only the attributes it
    reads -- the schedule is not built, which needs its stages and process group."""
    from torch.distributed.pipelining import schedules

    cls = {"interleaved_1f1b": schedules.ScheduleInterleaved1F1B, "zbv": schedules.ScheduleZBVZeroBubble,
           "dualpipev": schedules.ScheduleDualPipeV}[schedule]
    sched = cls.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, 2, microbatches
    sched.num_stages = 2 * pp
    sched.microbatches_per_round = microbatches // max(1, microbatches // pp)
    return [a for a in sched._calculate_single_rank_operations(rank) if a is not None]


def rank_costs(units: list[dict], bounds: list[tuple[int, int]], stages_of_rank: list[list[int]],
               states: list[list[tuple[int, ...]]]) -> list[float]:
    """Each pipeline rank's cost-model peak: the state of its stages, the activations its stages hold together
    at the schedule's worst point (`in_flight_states`: micro-batches in flight per stage x what one holds), and
    the largest backward working set of its blocks, once -- a rank runs one backward at a time. With one stage
    per rank, `_stage_cost`."""
    out = []
    for stages, points in zip(stages_of_rank, states):
        blocks = [u for s in stages for u in units[bounds[s][0]:bounds[s][1]]]
        held = [sum(_held(u, i == bounds[s][0]) for i, u in enumerate(units[bounds[s][0]:bounds[s][1]], bounds[s][0]))
                for s in stages]
        acts = max(sum(c * h for c, h in zip(point, held)) for point in points)
        # each stage's input gradients; the received output gradients of the stage whose backward runs (the
        # largest), the accumulating shared-field gradients and the round's inputs once
        fixed = sum(units[bounds[s][0]].get("input_grad_bytes", 0) for s in stages if bounds[s][0] > 0)
        fixed += max(_output_grads(units, bounds[s][1]) for s in stages)
        fixed += max(u.get("shared_grad_bytes", 0) for u in blocks)
        fixed += units[bounds[stages[0]][0]].get("round_input_bytes", 0)
        out.append(sum(u["state_bytes"] for u in blocks) + acts + max(u["work_bytes"] for u in blocks) + fixed)
    return out


def _held(unit: dict, first: bool) -> float:
    """What one micro-batch in flight holds for this block: its input carry and what its forward kept.
    A block after the stage's first receives the previous block's outputs: the residual and the
    shared fields that block wrote (`new_carry_bytes`); the other shared fields are the tensors the
    stage received, counted once."""
    if first or "new_carry_bytes" not in unit:
        return unit["activation_bytes"]
    return unit["activation_bytes"] - unit["carry_bytes"] + unit["new_carry_bytes"]


def _stage_fixed(units: list[dict], a: int, b: int) -> int:
    """What the stage of blocks [a, b) holds once, whatever its micro-batches in flight: the gradients of its
    inputs (the differentiable carry: the residual and the shared KV / index keys), which the stage keeps from
    one backward to the next (torch's stage holds its last input gradients until the next backward replaces
    them), the gradient of its outputs that its backward received (the next stage's input gradients: measured
    at 1M / cp=256, stage 2 of pp=4, whose layer 20 writes the whole-sequence KV and index keys stage 3 reads,
    holds their 3.0 GB of gradients through its backward), the shared fields' gradients its running backward
    accumulates (the largest set of shared fields in its blocks' carries), and the pipeline round's inputs on
    the device."""
    inputs = units[a].get("input_grad_bytes", 0) if a > 0 else 0
    shared = max(u.get("shared_grad_bytes", 0) for u in units[a:b])
    return inputs + _output_grads(units, b) + shared + units[a].get("round_input_bytes", 0)


def _output_grads(units: list[dict], b: int) -> int:
    """The gradient a stage ending before unit `b` receives for its outputs: the next stage's input gradients
    (none for the last stage)."""
    return units[b].get("input_grad_bytes", 0) if b < len(units) else 0


def _stage_activations(units: list[dict], a: int, b: int, in_flight: int) -> float:
    held = sum(_held(u, i == a) for i, u in enumerate(units[a:b], a))
    return in_flight * held + max(u["work_bytes"] for u in units[a:b]) + _stage_fixed(units, a, b)


def _stage_cost(units: list[dict], a: int, b: int, in_flight: int) -> float:
    return sum(u["state_bytes"] for u in units[a:b]) + _stage_activations(units, a, b, in_flight)


def _cost_table(units: list[dict], pp: int, in_flight: list[int]) -> dict:
    """`_stage_cost` of every (stage s, first unit i, end j) a split of the units into `pp` stages can
    use. Integer costs (the cost model's) come from prefix sums -- the same integers, O(1) each, which is
    what makes the layout search (train/plan/layouts.py) affordable; other values are summed directly."""
    n = len(units)
    keys = [(s, i, j) for s in range(1, pp + 1) for j in range(s, n - (pp - s) + 1) for i in range(s - 1, j)]
    first = [_held(u, True) for u in units]
    rest = [_held(u, False) for u in units]
    shared = [u.get("shared_grad_bytes", 0) for u in units]
    inputs = [u.get("input_grad_bytes", 0) if i > 0 else 0 for i, u in enumerate(units)]
    rounds = [u.get("round_input_bytes", 0) for u in units]
    if not all(type(v) is int for u, f, r, x, y, z in zip(units, first, rest, shared, inputs, rounds)
               for v in (u["state_bytes"], u["work_bytes"], f, r, x, y, z)):
        return {(s, i, j): _stage_cost(units, i, j, in_flight[s - 1]) for s, i, j in keys}
    state, held = [0], [0]
    for u, r in zip(units, rest):
        state.append(state[-1] + u["state_bytes"])
        held.append(held[-1] + r)
    work, fixed = {}, {}
    for i in range(n):
        top = most = 0
        for j in range(i + 1, n + 1):
            top = max(top, units[j - 1]["work_bytes"])
            most = max(most, shared[j - 1])
            work[i, j] = top
            fixed[i, j] = inputs[i] + (inputs[j] if j < n else 0) + most + rounds[i]
    return {(s, i, j): state[j] - state[i] + (in_flight[s - 1] * (first[i] + held[j] - held[i + 1]) + work[i, j]
                                              + fixed[i, j]) for s, i, j in keys}


def partition(units: list[dict], pp: int, stage_layers: list[int] | None = None,
              in_flight: list[int] | None = None, memory_slack: float = 0.0, budget: float | None = None,
              stages_of_rank: list[list[int]] | None = None,
              states: list[list[tuple[int, ...]]] | None = None) -> list[tuple[int, int]]:
    """Contiguous [start, end) unit ranges for `pp` stages (virtual stages included), or the ranges
    given by `stage_layers` (layer counts per stage). Lexicographic, each an exact dynamic programme:
    1. the smallest possible largest stage memory M (state + activations, `_stage_cost`);
    2. among splits whose every stage stays within M x (1 + `memory_slack`), the smallest largest
       stage compute (`flops_per_token`): a pipeline runs at the pace of its slowest stage, and the
       memory-optimal splits differ a lot in it -- a stage holding an Engram table often sets M
       alone, and the last stage, with one micro-batch in flight, would otherwise take the most
       layers (exp=flash: 10 of 40 layers, 4.4x the mean compute);
    3. among those, the most even memory (smallest sum of squared stage costs).
    `in_flight`: micro-batches in flight per stage (default: 1F1B's).

    With a memory `budget` (bytes per rank, `parallel.gpu_memory_gb`) throughput comes first instead:
    1. the smallest largest stage compute among splits whose every stage fits the budget (exact);
    2. among those, the most even memory.
    A rank holding several stages (`stages_of_rank`, e.g. V-shaped ZBV / DualPipeV) runs them all: from
    that split, boundaries then move one block at a time while the largest per-rank compute (the sum of a
    rank's stages) falls and every rank's memory (`rank_costs` at the schedule's in-flight `states`) fits (a
    local search, not exact). No split that fits: a ConfigError naming the smallest largest stage memory
    possible."""
    n = len(units)
    in_flight = in_flight or in_flight_microbatches(pp)
    if not 1 <= pp <= n:
        raise ConfigError(f"parallel.pp={pp}: a stage needs at least one of the {n} blocks")
    if stage_layers is not None:
        if len(stage_layers) != pp or sum(stage_layers) != n or min(stage_layers) < 1:
            raise ConfigError(f"parallel.stage_layers={stage_layers}: needs {pp} positive counts summing to {n}")
        return bounds_from_counts(stage_layers)
    INF = float("inf")
    cost = _cost_table(units, pp, in_flight)
    prefix = [0.0]
    for u in units:
        prefix.append(prefix[-1] + u.get("flops_per_token", 0))

    def solve(objective, allowed=lambda s, i, j: True):
        best = [[INF] * (n + 1) for _ in range(pp + 1)]  # best[s][j]: first j units in s stages
        cut = [[0] * (n + 1) for _ in range(pp + 1)]
        best[0][0] = 0.0
        for s in range(1, pp + 1):
            for j in range(s, n - (pp - s) + 1):
                for i in range(s - 1, j):
                    if best[s - 1][i] == INF or not allowed(s, i, j):
                        continue
                    v = objective(best[s - 1][i], s, i, j)
                    if v < best[s][j]:
                        best[s][j], cut[s][j] = v, i
        return best[pp][n], cut

    tol = 1 + 1e-9
    peak, _ = solve(lambda acc, s, i, j: max(acc, cost[s, i, j]))  # 1.
    if budget is not None and peak > budget * tol:
        raise ConfigError(f"no split of the {n} layers into {pp} pipeline stages fits parallel.gpu_memory_gb="
                          f"{budget / 1e9:g}: the smallest largest stage needs {peak / 1e9:.1f} GB (cost model); raise "
                          f"parallel.pp, parallel.cp or parallel.ep, set train.recompute, or raise the budget")
    limit = (budget if budget is not None else peak * (1 + memory_slack)) * tol

    def fits(s, i, j):
        return cost[s, i, j] <= limit

    compute, _ = solve(lambda acc, s, i, j: max(acc, prefix[j] - prefix[i]), fits)  # 2.

    def fits_and_fast(s, i, j):
        return fits(s, i, j) and prefix[j] - prefix[i] <= compute * tol

    _, cut = solve(lambda acc, s, i, j: acc + (cost[s, i, j] / peak) ** 2, fits_and_fast)  # 3.
    bounds, j = [], n
    for s in range(pp, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    bounds = bounds[::-1]
    if budget is not None and stages_of_rank and any(len(r) > 1 for r in stages_of_rank):
        if states is None:
            raise ValueError("partition: ranks of several stages need the schedule's in-flight states")
        bounds = _balance_ranks(bounds, stages_of_rank, lambda b: rank_costs(units, b, stages_of_rank, states),
                                lambda i, j: prefix[j] - prefix[i], budget * tol)
    return bounds


def _balance_ranks(bounds, stages_of_rank, rank_memory, stage_compute, budget):
    """Local search over stage boundaries: lower the largest per-rank compute (then the sum of squared
    rank computes) while every rank's memory (`rank_memory(bounds)`, per rank) stays within `budget`."""
    def score(b):
        mem = rank_memory(b)
        comp = [sum(stage_compute(*b[s]) for s in r) for r in stages_of_rank]
        ok = max(mem) <= budget
        return (not ok, max(comp), sum(c * c for c in comp)) if ok else (True, max(mem), 0.0)

    best, best_score = list(bounds), score(bounds)
    improved = True
    while improved:
        improved = False
        for k in range(1, len(best)):  # boundary between stage k - 1 and k
            for step in (-1, 1):
                cut = best[k][0] + step
                if not best[k - 1][0] < cut < best[k][1]:
                    continue
                trial = list(best)
                trial[k - 1], trial[k] = (best[k - 1][0], cut), (cut, best[k][1])
                sc = score(trial)
                if sc < best_score:
                    best, best_score, improved = trial, sc, True
    return best


def partition_report(units: list[dict], bounds: list[tuple[int, int]], in_flight: list[int] | None = None) -> dict:
    pp = len(bounds)
    in_flight = in_flight or in_flight_microbatches(pp)
    stages = []
    for s, (a, b) in enumerate(bounds):
        stages.append({"stage": s, "layers": [a, b - 1], "n_layers": b - a,
                       "state_bytes": sum(u["state_bytes"] for u in units[a:b]),
                       "in_flight": in_flight[s],
                       "activation_bytes": _stage_activations(units, a, b, in_flight[s]),
                       "bytes": _stage_cost(units, a, b, in_flight[s]),
                       "flops_per_token": sum(u["flops_per_token"] for u in units[a:b])})

    def imbalance(key):
        vals = [st[key] for st in stages]
        return max(vals) / (sum(vals) / len(vals))

    return {"pp": pp, "stages": stages, "imbalance_bytes": imbalance("bytes"),
            "imbalance_compute": imbalance("flops_per_token")}
