"""Pipeline stages on torch.distributed.pipelining (DESIGN.md "Parallelism"; V41_SPEC §2, §5).

A stage is a contiguous range of blocks that takes and returns the model's carry as a flat tuple of
tensors. What crosses a boundary:

  tokens, token_types   [b, S] int64        every boundary (each stage rebuilds its ForwardContext:
                                            image mask, Engram hash ids -- they depend on tokens only)
  h, pre_mix            every boundary      } shapes and dtypes from the carry table (model/carry.py);
  kv, index_k, topk,    only when a later   } the float fields fp32, with gradients
  candidates            layer reads them    }

Under context parallelism (parallel.cp) S is the whole sequence for tokens / token_types and for the
compressed fields (gathered whole on every rank), and this rank's positions (S / cp) for h, pre_mix,
topk and candidates (model/sequence_split.py).
So when a Full layer and its Reuse / Reindex layers sit on different stages, the compressed KV,
index-K, top-k and candidate pool travel with the activations, and the gradients of kv / index_k flow
back to the owner's compressor over the boundary. Which fields are live at a boundary is derived from
the LayerPlan and the carry table's reads / writes (`live_shared_fields`), so shapes are known up front
and every stage is built in the pipelining library's static mode (no shape inference that would have to
run the model on empty integer tensors).

The first stage additionally takes `rows` [b] int64 (row indices into the round's batch) and looks the
images of its rows up in a per-round side table: images are lists of variable-size tensors that cannot
be chunked into micro-batches by the schedule. The last stage returns the final hidden states [b, S, D]
(fp32), never logits: the schedule's loss function runs the head and the cross-entropy tiled over the
sequence (train/loss.py), so no [b, S, vocab] tensor exists on any rank.

Placement (SCHEDULES in parallel/config.py): `1f1b` one stage per rank; `interleaved_1f1b` two stages
per rank, looped (rank r holds r and r + pp); `zbv` and `dualpipev` two per rank, V-shaped (rank r holds
r and 2 pp - 1 - r, so rank 0 holds the embedding and the head).

Each rank builds a meta-device template of the model, drops what it does not own (`prune_to_stages`)
and only then materialises the rest (parallel/construct.py), seeded by parameter name so every layout
starts from the same weights; parameter names are unchanged, so checkpoints, optimizer routing and
the MoE bias update see the same FQNs under any layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
    _PipelineScheduleRuntime,
)

from flashtrain.config.errors import ConfigError
from flashtrain.model.aux import StepStats
from flashtrain.model.carry import (
    BLOCK_FIELDS,
    FIELDS,
    SHARED_NAMES,
    Carry,
    SharedKV,
    shared_reads,
    shared_resets,
    shared_writes,
)
from flashtrain.model.config import ModelConfig
from flashtrain.model.layer_plan import LayerRole
from flashtrain.model.transformer import Transformer
from flashtrain.parallel.config import SCHEDULES, ParallelConfig
from flashtrain.parallel.grad_reduce import GradReducer
from flashtrain.parallel.lean_stage import LeanPipelineStage

FIRST_INPUTS = ("tokens", "token_types", "rows")


# --- what crosses a boundary (the carry contract: model/carry.py) ---------------------------------
def live_shared_fields(plan: tuple[LayerRole, ...], boundary: int) -> dict[str, LayerRole]:
    """Shared-carry fields that some layer at or after `boundary` reads before a later layer rewrites
    them, mapped to the layer (before `boundary`) that wrote them."""
    writer: dict[str, LayerRole] = {}
    for role in plan[:boundary]:
        for f in shared_resets(role):
            writer.pop(f, None)
        for f in shared_writes(role):
            writer[f] = role
    live, rewritten = {}, set()
    for role in plan[boundary:]:
        for f in shared_reads(role) - rewritten:
            if f in writer:
                live[f] = writer[f]
        rewritten |= shared_writes(role) | shared_resets(role)
    return {f: live[f] for f in SHARED_NAMES if f in live}


@dataclass(frozen=True)
class FieldSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def differentiable(self) -> bool:
        return self.dtype.is_floating_point

    def example(self, device) -> torch.Tensor:
        t = torch.zeros(self.shape, dtype=self.dtype, device=device)
        return t.requires_grad_(True) if self.differentiable else t


def boundary_specs(cfg: ModelConfig, plan: tuple[LayerRole, ...], boundary: int, b: int, seq_len: int,
                   local_len: int | None = None) -> list[FieldSpec]:
    """The tensors that cross the boundary before block `boundary`, in order, with shapes for a
    micro-batch of `b` sequences of `seq_len` tokens. Under context parallelism this rank holds
    `local_len` positions of each: tokens stay whole (the next stage hashes Engram n-grams over the
    whole sequence), the compressed KV / index-K are the gathered whole, the rest is local."""
    S, L = seq_len, local_len or seq_len
    specs = [FieldSpec("tokens", (b, S), torch.long), FieldSpec("token_types", (b, S), torch.long)]
    specs += [FieldSpec(f.name, f.shape(cfg, b, L, 0), f.dtype) for f in BLOCK_FIELDS]
    for name, writer in live_shared_fields(plan, boundary).items():
        f, n = FIELDS[name], S // plan[writer.kv_source].compress_ratio
        specs.append(FieldSpec(name, f.shape(cfg, b, L, n), f.dtype))
    return specs


# --- placement -----------------------------------------------------------------------------------
def stage_ids(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """The stages rank `pp_rank` of the pipeline group holds, in increasing order."""
    per, style = parallel.stages_per_rank, SCHEDULES[parallel.pipeline_schedule][1]
    if per == 1:
        return [pp_rank]
    if style == "loop":
        return [pp_rank + k * parallel.pp for k in range(per)]
    return sorted({pp_rank, 2 * parallel.pp - 1 - pp_rank})


@dataclass
class StageRange:
    index: int
    start: int  # first block
    end: int  # one past the last block
    n_stages: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1


def stage_ranges(bounds: list[tuple[int, int]]) -> list[StageRange]:
    return [StageRange(i, a, b, len(bounds)) for i, (a, b) in enumerate(bounds)]


def local_stage_ranges(parallel: ParallelConfig, bounds: list[tuple[int, int]], pp_rank: int) -> list[StageRange]:
    """The stages (of all `bounds`) that pipeline rank `pp_rank` holds."""
    if len(bounds) != parallel.n_stages:
        raise ConfigError(f"{len(bounds)} stage ranges for parallel.pp={parallel.pp} x "
                          f"{parallel.stages_per_rank} stages per rank ({parallel.pipeline_schedule})")
    ranges = stage_ranges(bounds)
    return [ranges[i] for i in stage_ids(parallel, pp_rank)]


def prune_to_stages(model: Transformer, ranges: list[StageRange]) -> Transformer:
    """Drop, in place, every block and top-level module no local stage runs. Names are unchanged
    (`layers.{i}.*` keeps its index); dropped blocks become parameter-free `nn.Identity`."""
    keep = {i for r in ranges for i in range(r.start, r.end)}
    for i in range(len(model.layers)):
        if i not in keep:
            model.layers[i] = nn.Identity()
    if not any(r.is_first for r in ranges):
        model.embed = None
        if model.cfg.vision_n_layers:
            model.vision = model.aligner = None
            model.image_start = model.image_newline = model.image_end = None
    if not any(r.is_last for r in ranges):
        model.norm = model.head = None
    return model


# --- side channels -------------------------------------------------------------------------------
@dataclass
class RoundStats:
    """What the local stages' forwards report over one optimizer step: per-layer expert loads and the
    sums of the balance / indexer loss values (each micro-batch's StepStats is folded in right after
    its forward; pipelining does not recompute forwards, so nothing is counted twice)."""

    expert_load: dict[int, torch.Tensor] = field(default_factory=dict)
    balance: torch.Tensor | float = 0.0  # sums kept as tensors: no host sync per micro-batch
    indexer: torch.Tensor | float = 0.0

    def reset(self) -> None:
        self.expert_load, self.balance, self.indexer = {}, 0.0, 0.0

    def add(self, stats: StepStats) -> None:
        for layer, load in stats.expert_load.items():  # on the device: no host sync per micro-batch
            load = load.detach()
            self.expert_load[layer] = self.expert_load[layer] + load if layer in self.expert_load else load.clone()
        self.balance = self.balance + stats.total("balance_loss")
        self.indexer = self.indexer + stats.total("indexer_loss")


class StageModule(nn.Module):
    """One pipeline stage: blocks [start, end) of `model`, plus the embedding / vision path when first
    and the final norm + head when last. Only the modules it runs are registered here (so the stage's
    parameters are its own); the forward calls the shared Transformer's stage pieces."""

    def __init__(self, model: Transformer, rng: StageRange, in_specs: list[FieldSpec] | None,
                 out_specs: list[FieldSpec] | None, stats: RoundStats):
        super().__init__()
        self._model = [model]  # not a submodule: another local stage may run other parts of it
        self.range = rng
        self.blocks = nn.ModuleList(model.layers[rng.start:rng.end])
        if rng.is_first:
            self.embed = model.embed
            if model.cfg.vision_n_layers:
                self.vision, self.aligner = model.vision, model.aligner
                self.image_start, self.image_newline = model.image_start, model.image_newline
                self.image_end = model.image_end
        if rng.is_last:  # the head runs inside the schedule's loss function (tiled, train/loss.py)
            self.norm = model.norm
        self.in_names = list(FIRST_INPUTS) if rng.is_first else [s.name for s in in_specs]
        self.out_specs = out_specs
        self.stats = stats
        self.images: list[list[torch.Tensor]] = []  # first stage: this round's images, by row
        # this round's row-sharded Engram lookups, per micro-batch (parallel/engram_shard.py): counts
        # exchanged at the round's start; a micro-batch's ids are sent when the previous one's forward starts
        self.engram_requests: list[dict] = []
        self.microbatch = 0  # the micro-batch being run (set by LeanPipelineStage)
        self.aux_grad_scale = 1.0
        # Anticipatory Routing (train/stability/anticipatory.py), per micro-batch of the round: cached routing indices
        # of this stage's MoE layers to follow, or dicts the forward records them into
        self.routes: list[dict] | None = None
        self.recorded: list[dict] | None = None

    def loss_parameters(self) -> list[nn.Parameter]:
        """The parameters the schedule's loss function trains (the last stage's head, not registered
        here): their gradients accumulate in the loss's forward (train/loss.py), not in the backward."""
        return list(self._model[0].head.parameters()) if self.range.is_last else []

    def forward(self, *tensors: torch.Tensor):
        model = self._model[0]
        f = dict(zip(self.in_names, tensors))
        tokens, types = f["tokens"], f["token_types"]
        if self.range.is_first:
            images = [self.images[i] for i in f["rows"].tolist()] if any(self.images) else None
            carry = model.embed_inputs(tokens, types, images)
        else:
            carry = Carry(f["h"], f["pre_mix"], SharedKV(**{k: f.get(k) for k in SHARED_NAMES}))
        ctx = model.context(tokens, types, StepStats(), self.aux_grad_scale)
        if self.routes is not None:
            ctx.routes = self.routes[self.microbatch]
        if self.recorded is not None:
            ctx.recorded = self.recorded[self.microbatch]
        if self.engram_requests:
            k = self.microbatch
            ctx.engram_requests = dict(self.engram_requests[k])
            for request in self.engram_requests[k].values():
                request.launch()  # no-op unless this is the round's first micro-batch
            for request in (self.engram_requests[k + 1] if k + 1 < len(self.engram_requests) else {}).values():
                request.launch()  # travels while this micro-batch computes
        carry = model.run_blocks(carry, ctx, self.range.start, self.range.end)
        self.stats.add(ctx.stats)
        if self.range.is_last:
            return model.final_hidden(carry).float()
        out = []
        for spec in self.out_specs:
            if spec.name in ("tokens", "token_types"):
                t = f[spec.name]
            elif spec.name in ("h", "pre_mix"):
                t = getattr(carry, spec.name)
            else:
                t = getattr(carry.shared, spec.name)
                if t is None:  # e.g. no candidate pool when the sequence is shorter than one group
                    t = torch.zeros(spec.shape, dtype=spec.dtype, device=tokens.device)
            if spec.differentiable:
                t = t.float()
                if t.grad_fn is None and t.requires_grad:
                    t = t.view_as(t)  # a pass-through leaf gets a graph node, so its gradient is routed back
            out.append(t)
        return tuple(out)


def _schedule_class(name: str):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    return {"1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble,
            "dualpipev": ScheduleDualPipeV}[name]


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its stages, the schedule that drives them, and the stats
    side channel they fill."""

    schedule: object
    modules: list[StageModule]
    stats: RoundStats
    has_first: bool
    has_last: bool
    stages: list = field(default_factory=list)
    n_microbatches: int = 1  # per round
    _forward_order: dict | None = field(default=None, repr=False)  # a multi-stage schedule's, built once

    def set_aux_grad_scale(self, scale: float) -> None:
        for m in self.modules:
            m.aux_grad_scale = scale

    def run_round(self, tokens, token_types, labels, images, routes: list[dict] | None = None,
                  reducer: GradReducer | None = None) -> list[torch.Tensor]:
        """One schedule step over a round's [M x b, S] batch; returns the last stage's per-micro-batch
        losses (empty elsewhere). `routes`: per micro-batch, cached routing indices of this rank's MoE
        layers to follow (Anticipatory Routing; None: each layer's own top-k). `reducer`: given for the
        optimizer step's last round, whose backwards complete the gradients: each local stage marks its
        parameters final in it before its last backward of the round, so buckets are reduced as that
        backward completes them, and the last stage marks the head before the round's last forward,
        whose loss accumulates the head's gradient (parallel/grad_reduce.py; None: nothing is marked)."""
        for m in self.modules:
            m.routes = routes
        for stage in self.stages:  # the head's gradient completes in the last loss forward, the rest in
            # the last backward
            stage.before_last_forward = None if reducer is None or not stage.is_last else (
                lambda s: reducer.mark_final(s.submod.loss_parameters()))
            stage.before_last_backward = None if reducer is None else (
                lambda s: reducer.mark_final(s.submod.parameters()))
        try:
            return self._round(self.schedule.step, tokens, token_types, labels, images)
        finally:
            for m in self.modules:
                m.routes = None
            for stage in self.stages:
                stage.before_last_forward = stage.before_last_backward = None

    def record_round(self, tokens, token_types, labels, images) -> list[dict]:
        """A forward-only pass of the round (no gradients, no statistics kept) that records the routing
        indices every local MoE layer picks: per micro-batch, {layer id: indices [b x S_local, k]}."""
        recorded: list[dict] = [{} for _ in range(self.n_microbatches)]
        stats = (dict(self.stats.expert_load), self.stats.balance, self.stats.indexer)  # the step's own
        for m in self.modules:
            m.recorded = recorded
        try:
            with torch.no_grad():
                self._forward_only(tokens, token_types, labels, images)
        finally:
            for m in self.modules:
                m.recorded = None
            self.stats.expert_load, self.stats.balance, self.stats.indexer = stats
        return recorded

    def eval_round(self, tokens, token_types, labels, images) -> list[torch.Tensor]:
        """A forward-only pass of the round without gradients: the loss function's value per micro-batch
        on the last stage (empty elsewhere); the caller's loss function decides what it computes
        (train/step_runner.py `PipelineLoss`: the held-out scores). The stats side channel gathers this
        round too: the caller runs it between steps (each step's first round resets it)."""
        with torch.no_grad():
            return self._forward_only(tokens, token_types, labels, images)

    def _forward_only(self, tokens, token_types, labels, images) -> list[torch.Tensor]:
        """The round's forwards alone. A one-stage-per-rank schedule runs its own `eval`; a multi-stage
        runtime schedule (DualPipeV, ZBV, interleaved) would still run the backward actions of its order
        in `eval`, so for the round its order is swapped for a forward-only one (`forward_only_order`),
        lowered with the same communication steps (torch's private `_add_unshard_reshard` /
        `_add_send_recv`), and restored after."""
        sched = self.schedule
        if not isinstance(sched, _PipelineScheduleRuntime):
            return self._round(sched.eval, tokens, token_types, labels, images)
        if self._forward_order is None:  # lowered as the schedule lowers its own (torch's validation of a
            # compute order insists on backwards, so the lowering steps are called directly)
            to_rank = sched.stage_index_to_group_rank
            order = {rank: _add_unshard_reshard(acts)
                     for rank, acts in forward_only_order(to_rank, self.n_microbatches).items()}
            self._forward_order = _add_send_recv(order, stage_to_rank=lambda st: to_rank[st],
                                                 num_stages=sched._num_stages)
        train_order, sched.pipeline_order_with_comms = sched.pipeline_order_with_comms, self._forward_order
        try:
            return self._round(sched.eval, tokens, token_types, labels, images)
        finally:
            sched.pipeline_order_with_comms = train_order

    def _round(self, run, tokens, token_types, labels, images) -> list[torch.Tensor]:
        for m in self.modules:
            if m.range.is_first:
                m.images = images
            m.engram_requests = m._model[0].engram_round_requests(tokens, token_types, self.n_microbatches,
                                                                   m.range.start, m.range.end)
        args = (tokens, token_types, torch.arange(tokens.shape[0], device=tokens.device)) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses} if self.has_last else {}
        try:
            if run == self.schedule.step:
                run(*args, return_outputs=False, **kwargs)
            else:
                run(*args, **kwargs)
        finally:
            for m in self.modules:
                m.images, m.engram_requests = [], []
        return losses


def forward_only_order(stage_to_rank: dict[int, int], n_microbatches: int) -> dict[int, list]:
    """Per pp rank, the forward of every micro-batch of each of its stages, stages in increasing order
    (compute actions only). Each forward waits only on the previous stage's, which every rank runs
    earlier in its own list or another rank runs without waiting on a later stage: no rank waits in a
    cycle."""
    order: dict[int, list] = {rank: [] for rank in sorted(set(stage_to_rank.values()))}
    for stage in sorted(stage_to_rank):
        order[stage_to_rank[stage]] += [_Action(stage, _ComputationType.FORWARD, m) for m in range(n_microbatches)]
    return order


def build_pipeline(model: Transformer, parallel: ParallelConfig, mine: list[StageRange], group: dist.ProcessGroup,
                   device: torch.device, micro_batch: int, seq_len: int, n_microbatches: int,
                   loss_fn: Callable) -> Pipeline:
    """Wrap this rank's stages `mine` (`local_stage_ranges`) of `model`, already pruned to them
    (`prune_to_stages`, parallel/construct.py), in PipelineStages and the configured schedule. The
    schedule calls `loss_fn(hidden, labels)` on the last stage (train/step_runner.py `PipelineLoss`)."""
    cfg, plan = model.cfg, model.plan
    split = model.sequence_split(seq_len)
    local_len = seq_len if split is None else split.length
    stats = RoundStats()
    modules, stages = [], []
    for r in mine:
        in_specs = None if r.is_first else boundary_specs(cfg, plan, r.start, micro_batch, seq_len, local_len)
        out_specs = None if r.is_last else boundary_specs(cfg, plan, r.end, micro_batch, seq_len, local_len)
        module = StageModule(model, r, in_specs, out_specs, stats)
        if r.is_first:
            ex_in = tuple(torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device) for _ in range(2)) + (
                torch.zeros(micro_batch, dtype=torch.long, device=device),)
        else:
            ex_in = tuple(s.example(device) for s in in_specs)
        if r.is_last:
            ex_out = (torch.zeros(micro_batch, local_len, cfg.dim, device=device, requires_grad=True),)
        else:
            ex_out = tuple(s.example(device) for s in out_specs)
        release = () if r.is_last else tuple(i for i, s in enumerate(out_specs) if s.name == "h")
        stages.append(LeanPipelineStage(module, r.index, r.n_stages, device, input_args=ex_in, output_args=ex_out,
                                        group=group, release_outputs=release))
        modules.append(module)
    cls = _schedule_class(parallel.pipeline_schedule)
    if parallel.stages_per_rank == 1:
        schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(schedule, modules, stats, any(r.is_first for r in mine), any(r.is_last for r in mine), stages,
                    n_microbatches)
