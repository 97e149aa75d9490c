"""The train module (DESIGN.md "Training"): what one rank trains and how one optimizer step runs, as OLMo-core's
TrainModule. It owns this rank's model, its optimizers, the gradient reduction, the step runner (local or
pipelined), the parallel dimensions, the collective-operation context and the stability guard; the loop
(train/trainer.py) owns the data, the schedule's position, metrics and checkpoints' timing, and runs whichever
module it is given:

    next_batches(step, batches)      the step's micro-batches (and routing indices while Anticipatory Routing is on)
    step(batches, routes, step, ...) forward/backward of every micro-batch with the gradient reduction, clipping,
                                     the spike verdict, the optimizer step, the MoE bias update, the step
                                     values' all-reduce -> StepOutcome
    record(record, values)           the module's own fields of a step's metrics record
    flops_per_token(seq_len)         the model FLOPs of a trained token (train/flops.py)
    checkpoint_meta() / check_resume(meta, path) / save(...) / load(path) / load_state_dict(rank_state)

Two implementations: `TrainModule` (pre-training, here) and `DSparkModule` (the DSpark stage, train/dspark/stage.py).
`build_module` (train/build.py) makes the one `train.stage` names, for the trainer and for the memory
estimator (train/plan/estimate.py), which runs this same `step` on fake tensors (`tensor_mode`, no guard).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from flashtrain.model.param_kinds import ParamKind, parameter_kinds
from flashtrain.model.vision import set_vision_body_trainable
from flashtrain.parallel.construct import build_rank_model
from flashtrain.parallel.context import ContextComm
from flashtrain.parallel.dims import ParallelDims
from flashtrain.parallel.pipeline import Pipeline, build_pipeline, local_stage_ranges
from flashtrain.train.balancing import global_loads, update_biases
from flashtrain.train.checkpoint import load_checkpoint
from flashtrain.train.compile import apply_compile, compile_enabled
from flashtrain.train.flops import flops_per_token
from flashtrain.train.metrics import load_statistics
from flashtrain.train.optim import build_optimizers
from flashtrain.train.optim.routing import route_parameters, zero_inputs
from flashtrain.train.plan.stages import plan_stages, stage_units
from flashtrain.train.resume import check_model_config
from flashtrain.train.runtime import faults
from flashtrain.train.runtime.collectives import Operation
from flashtrain.train.stability.guard import StabilityGuard
from flashtrain.train.step_runner import LocalRunner, PipelineLoss, PipelineRunner, StepRunner
from flashtrain.train.step_values import StepValues, loader_fields

log = logging.getLogger(__name__)


@dataclass
class StepOutcome:
    """What `TrainModule.step` reports: the step's values summed over every rank, the global expert loads, the
    gradient norm before clipping, the spike verdict (None: updated), whether the MoE layers routed by
    anticipated indices."""

    sums: StepValues
    loads: dict[int, torch.Tensor]
    grad_norm: torch.Tensor
    spike: str | None
    routed: bool


@dataclass
class RankParts:
    """What `build_rank` makes: this rank's share of the model and everything that trains it."""

    model: torch.nn.Module
    pipe: Pipeline | None
    optim: object  # OptimizerSet (train/optim)
    reducer: object  # GradReducer (parallel/grad_reduce.py)
    runner: StepRunner
    compiled: bool = False  # train.compile applied to the blocks (train/compile.py)


def counts_data(dims: ParallelDims) -> bool:
    """The cp ranks of a group read the same batches: only cp rank 0 counts them."""
    return dims.cp_rank == 0


def sinkhorn_row_group_of(model, dims: ParallelDims):
    """Row-sharded Engram tables: the Sinkhorn update's column statistics are all-reduced over dp."""
    if not dims.engram_shard:
        return None
    kinds = parameter_kinds(model)
    tables = {id(p) for n, p in model.named_parameters() if kinds[n] is ParamKind.ENGRAM_TABLE}
    return lambda p: dims.dp_cp_group if id(p) in tables else None


def optimizers_and_reducer(model, c, dims: ParallelDims, lr: float):
    """The trained model's optimizers (the three-optimizer split, ZeRO-1 by the split each optimizer declares,
    row-sharded Engram tables' statistics over dp) and its gradient reducer."""
    splits, matrices = zero_inputs(route_parameters(model, c.model, c.optim))
    zero_plan = dims.zero_plan(model, splits, matrices)
    optim = build_optimizers(model, c.model, c.optim, (lambda p: zero_plan[id(p)]) if dims.zero else None,
                             sinkhorn_row_group_of(model, dims), lr=lr)
    return optim, dims.grad_reducer(model)


def build_rank(c, plan, dims: ParallelDims, device: torch.device, template, mixed_precision: bool, op: Operation,
               lr: float, log_pipeline: bool = False, tensor_mode=None) -> RankParts:
    """This rank's model, pipeline stages and optimizers from the whole model's meta-device template
    (`model_template`): pruned to this rank's stages and expert shard, then materialised
    (parallel/construct.py), so no rank allocates what it does not own and every layout starts from
    the same weights. `tensor_mode`: the estimator's seam (train/build.py)."""
    model, stages, bounds = template, None, None
    if dims.pp > 1:  # the cost-balanced partition (train/plan/stages.py, as launch/plan.py shows)
        units = stage_units(model, c.model, c.optim, c.parallel, c.data.seq_len, c.data.batch_size, c.train.recompute,
                            mixed_precision, dims.dp_cp, dims.cp, plan.round_inputs)
        bounds = plan_stages(units, c.parallel, plan.round_microbatches)
        stages = local_stage_ranges(c.parallel, bounds, dims.pp_rank)
    build_rank_model(model, device, c.train.seed, stages, dims, tensor_mode)
    model.set_recompute(c.train.recompute)
    compiled = tensor_mode is None and compile_enabled(c.train.compile, device.type, c.train.compile_default)
    if compiled:
        apply_compile(model, c.train.compile_backend)  # never under the estimator's fake tensors (train/compile.py)
    if dims.cp > 1:
        model.set_context_parallel(dims.cp, dims.cp_rank, c.parallel.cp_balance, ContextComm(dims.cp_group))
    with tensor_mode or contextlib.nullcontext():
        pipe = None
        if dims.pp > 1:
            loss_fn = PipelineLoss(model, c.train.loss_tile_tokens, plan.accumulation, c.data.seq_len)
            pipe = build_pipeline(model, c.parallel, stages, dims.pp_group, device, c.data.batch_size,
                                  c.data.seq_len, plan.round_microbatches, loss_fn)
            if log_pipeline:
                log.info(f"pipeline: {c.parallel.pipeline_schedule}, pp={dims.pp} x "
                         f"{c.parallel.stages_per_rank} stage(s) per rank, layers per stage "
                         f"{[b - a for a, b in bounds]}, {plan.round_microbatches} micro-batches per round x "
                         f"{plan.rounds} round(s)")
        optim, reducer = optimizers_and_reducer(model, c, dims, lr)
    common = dict(device=device, loss_tile_tokens=c.train.loss_tile_tokens, mixed_precision=mixed_precision,
                  counts_data=counts_data(dims), op=op, micro_batches=plan.global_microbatches)
    if pipe is None:
        runner = LocalRunner(model, reducer, plan.accumulation, **common)
    else:
        runner = PipelineRunner(model, pipe, reducer, plan.accumulation, plan.round_microbatches,
                                dims=dims, loss_fn=loss_fn, **common)
    return RankParts(model, pipe, optim, reducer, runner, compiled)


class TrainModule:
    """Pre-training (`train.stage=pretrain`): the whole model trains; its MoE layers are the backbone's."""

    evaluates = True  # the held-out LM evaluation runs through this module's step runner (train/evaluation/heldout.py)

    def __init__(self, c, plan, dims: ParallelDims, device: torch.device, parts: RankParts, op: Operation,
                 schedule, mixed_precision: bool, is_main: bool = True, guard: bool = True):
        self.cfg, self.plan, self.dims, self.device, self.op, self.schedule = c, plan, dims, device, op, schedule
        self.model, self.pipe, self.optim, self.runner = parts.model, parts.pipe, parts.optim, parts.runner
        self.compiled, self.mixed_precision = parts.compiled, mixed_precision
        self.counts_data = counts_data(dims)
        # the stability guard (train/stability/guard.py); None in the estimator, whose fake values cannot be judged
        self.guard = StabilityGuard(c.train.spike, c.train.anticipatory_routing, self.model, self.optim.optimizers,
                                    device, op, is_main) if guard else None

    @classmethod
    def build(cls, c, plan, dims, device, template, op, schedule, mixed_precision: bool, is_main: bool = True,
              tensor_mode=None) -> TrainModule:
        parts = build_rank(c, plan, dims, device, template, mixed_precision, op, schedule.lr(0),
                           log_pipeline=is_main and tensor_mode is None, tensor_mode=tensor_mode)
        return cls(c, plan, dims, device, parts, op, schedule, mixed_precision, is_main, guard=tensor_mode is None)

    # --- the step --------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """The schedule's settings for the step after `step` steps: the ViT body frozen until the decay, the LR."""
        if self.cfg.model.vision_n_layers:
            set_vision_body_trainable(self.model, self.schedule.vit_trainable(step))
        self.optim.set_lr(self.schedule.lr(step))

    def next_batches(self, step: int, batches) -> tuple[list[dict], list[dict] | None]:
        """Step `step`'s micro-batches: from the stability guard's look-ahead buffer with their routing indices
        while Anticipatory Routing is on (train/stability/anticipatory.py), else the next of `batches` and no routes."""
        if self.guard is not None and self.guard.reads_ahead(step):
            return self.guard.next_batches(step, batches, self.runner.record_routes)
        return next(batches), None

    def step(self, batches: list[dict], routes: list[dict] | None, step: int, counters=dict) -> StepOutcome:
        """One optimizer step's computation, communication and update after `step` steps, without host syncs
        (but the spike verdict's): forward/backward of every micro-batch with the gradient reduction (the step
        runner), clipping, the stability verdict, the optimizer step, the MoE bias update, the all-reduce of the
        step's values (train/step_values.py). `counters()`: the loader's counters of this step's reads."""
        self.begin_step(step)
        with self._injected_spike(step + 1):
            sums, loads = self.runner.run(batches, routes)
        self.op.name = "the gradient-norm all-reduce (clipping)"
        grad_norm = self.dims.clip(self.model, self.cfg.train.grad_clip, self.device)
        spike = None if self.guard is None else self.guard.verdict(sums, grad_norm, self.plan.global_microbatches)
        if spike is None:
            self.op.name = "the optimizer step"
            self.optim.step()
        self.op.name = "the expert-load all-reduce"
        loads = self.global_loads(loads)
        if spike is None:
            update_biases(self.model, loads, self.cfg.train.balance_rate)
        if self.dims.pp_rank == 0 and self.counts_data:  # the loader's counters of this step's reads, once per dp rank
            for name, count in loader_fields(counters()).items():
                sums.record(name, count, "count")
        self.op.name = "the all-reduce of the step's losses and counters"
        sums.all_reduce()
        return StepOutcome(sums, loads, grad_norm, spike, routes is not None)

    def global_loads(self, loads: dict) -> dict[int, torch.Tensor]:
        """The step's expert loads of every MoE layer, summed over the global batch (train/balancing.py)."""
        m = self.cfg.model
        return global_loads(loads, m.n_layers, m.n_routed_experts, device=self.device)

    @contextlib.contextmanager
    def _injected_spike(self, step: int):
        """FLASHTRAIN_FAULT=spike:... (tests, drills): this rank's head input x scale for the step."""
        scale = faults.spike_scale(step, self.dims.rank)
        head = getattr(self.model, "head", None)
        hook = None if scale is None or head is None else head.register_forward_pre_hook(
            lambda module, args: (args[0] * scale, *args[1:]))
        try:
            yield
        finally:
            if hook is not None:
                hook.remove()

    # --- what the loop reports ------------------------------------------------------------------
    def flops_per_token(self, seq_len: int) -> float:
        return flops_per_token(self.cfg.model, seq_len)

    def record(self, out: StepOutcome, v: dict, step: int) -> dict:
        """This module's fields of step `step`'s metrics record, from the step's outcome and its values read on the
        host (`v`, train/step_values.py): every metric the step recorded (the losses, the padding, the loader's
        skips), the gradient norm, whether the ViT body trained, the stability guard's verdict, whether the MoE
        layers routed by anticipated indices and the run's totals (train.spike / train.anticipatory_routing), the
        expert-load statistics (train/metrics.py)."""
        return {**out.sums.reported(v), "grad_norm": v["grad_norm"],
                "vit_trainable": bool(self.schedule.vit_trainable(step - 1)), "spike": out.spike,
                "anticipatory_routing": out.routed, "spikes_skipped": self.guard.counts["skipped"],
                "rollbacks": self.guard.counts["rolled_back"],
                "expert_load": load_statistics(out.loads, v["load_stats"])}

    def frozen(self) -> list[torch.nn.Module]:
        """The rank's modules that hold weights but do not train (none in pre-training)."""
        return []

    def stages(self) -> list[int]:
        """The pipeline stages this rank runs."""
        return [0] if self.pipe is None else [mod.range.index for mod in self.pipe.modules]

    # --- checkpoints ----------------------------------------------------------------------------
    def checkpoint_meta(self) -> dict:
        """This module's part of a checkpoint's meta."""
        hasher = getattr(self.model, "engram_hasher", None)
        return {"engram_compressed_vocab_size": None if hasher is None else hasher.compressed_vocab}

    def check_resume(self, meta: dict, path) -> None:
        """Before anything is loaded: the checkpoint is of this model (another model's tensors would fail to load
        with a message about one of them)."""
        check_model_config(meta["config"]["model"], self.cfg.cfg_dict["model"], path)

    def save(self, writer, step: int, meta: dict, rank_state: dict, hook=None) -> None:
        """Collective (train/checkpoint.py `CheckpointWriter.save`): the model, its optimizers' state, `meta` and
        this rank's state with the stability guard's."""
        writer.save(step, self.model, self.optim.optimizers, meta, {**rank_state, **self.guard.state_dict()},
                    self.dims.dp_rank, fault_hook=hook, layout=self.dims.global_layout(self.model),
                    own_state=self.guard.own_state())

    def load(self, path) -> tuple[dict, dict | None]:
        """The model and optimizer state of the checkpoint at `path` (train/checkpoint.py `load_checkpoint`):
        (meta, this data-parallel rank's state, None for weights alone)."""
        return load_checkpoint(path, self.model, self.optim.optimizers, self.dims,
                               self.dims.global_layout(self.model))

    def load_state_dict(self, rank_state: dict) -> None:
        """This rank's state of a checkpoint that the module keeps: the stability guard's."""
        self.guard.load_state_dict(rank_state, rank_state.get("own"))
