"""The training loop (DESIGN.md "Training"): batches -> forward/backward over gradient-accumulation
micro-batches (gradients reduced in buckets as the last backward produces them) -> clip -> optimizer
step (ZeRO-1) -> MoE bias update -> LR / ViT-freeze schedule -> metrics -> checkpoint. Every collective
of gradients, clipping and optimizer-state ownership lives in `parallel.dims.ParallelDims`.

- Fixed batch: `train.global_batch_tokens` / `data.seq_len` sequences per optimizer step (rounded);
  with `data.batch_size` sequences per micro-batch and dp ranks, accumulation = global / (dp x micro).
- Loss: cross-entropy (mean over label tokens of each micro-batch, averaged over micro-batches and
  ranks) + the sequence balance loss and indexer KL, which ride on the backward pass (model/aux.py,
  scaled by 1 / accumulation like the CE) and are logged separately.
- MoE biases: after every step, from loads summed over micro-batches and ranks (train/balancing.py).
- ViT body frozen until the schedule's decay start (a function of the step, so resuming on either side
  behaves the same), then trained with `optim.vision_lr_mult`.
- Checkpoints every `train.checkpoint.interval` steps, at the end and on SIGTERM (train/checkpoint.py);
  a run directory with checkpoints resumes from the newest complete one, or from `train.resume_from`.
- Data parallel over any number of ranks (gloo on CPU, NCCL on CUDA), and pipeline parallel
  (`parallel.pp`, parallel/pipeline.py) on a ("pp", "dp_rep", "ep") DeviceMesh: each optimizer step runs its
  micro-batches through the configured schedule in rounds of `parallel.microbatches`; every rank of a
  pipeline reads the same batches (its dp rank's), the last stage computes the cross-entropy, each
  stage's aux losses ride on its own backward, gradients are reduced over dp, the clipping norm over
  the whole model (all stages), and the expert loads over everyone.
- Expert parallel (`parallel.ep`, parallel/experts.py): each EP rank holds E / ep experts of every MoE
  layer and dispatches tokens by all-to-all; expert gradients are reduced over the replicas of the
  shard only, and checkpoints hold the experts as global tensors (loadable with any ep).
- Context parallel (`parallel.cp`, model/sequence_split.py): the cp ranks of a group read the same
  batches and each runs its positions of every sequence; losses are partial sums over the whole
  sequence's denominators, so gradients are summed over dp x cp and divided by dp; the data counters are
  taken on cp rank 0 only. Checkpoints do not depend on cp (a cp=2 run resumes at cp=1).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from flashtrain.config.errors import ConfigError
from flashtrain.config.typed import typed_config
from flashtrain.data.loader import PackedLoader, check_sources, data_sources
from flashtrain.model.aux import StepStats
from flashtrain.model.recompute import validate_recompute
from flashtrain.model.vision import set_vision_body_trainable
from flashtrain.parallel.config import ParallelConfig
from flashtrain.parallel.construct import build_rank_model, model_template
from flashtrain.parallel.context import ContextComm
from flashtrain.parallel.dims import ParallelDims
from flashtrain.parallel.mesh import mesh_shape
from flashtrain.parallel.pipeline import build_pipeline, local_stage_ranges
from flashtrain.train import faults
from flashtrain.train.anticipatory import AnticipatoryRouting, AnticipatoryRoutingConfig
from flashtrain.train.balancing import accumulate_loads, global_loads, update_biases
from flashtrain.train.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    checkpoint_problem,
    latest_verified_checkpoint,
    load_checkpoint,
    weights_only,
)
from flashtrain.train.config import data_config, model_config, optim_config, schedule, token_spec
from flashtrain.train.engram_map import load_or_build_engram_map
from flashtrain.train.flops import PeakTflops, flops_per_token, mfu, peak_flops
from flashtrain.train.loss import tiled_lm_loss
from flashtrain.train.metrics import LoggingConfig, MetricsLogger, load_statistics
from flashtrain.train.optim import build_optimizers
from flashtrain.train.optim.routing import route_parameters, zero_inputs
from flashtrain.train.profile import ProfileConfig, StepProfiler
from flashtrain.train.run_guard import acquire_run_lock, die_with_launcher
from flashtrain.train.spike import Snapshots, SpikeConfig, SpikeDetector, rng_state, set_rng_state
from flashtrain.train.stages import plan_stages, stage_units
from flashtrain.train.step_values import LOADER_COUNTERS, StepValues

log = logging.getLogger(__name__)
# model fields that change how the step is computed, not what: a run may resume with other values (e.g. a
# smaller attention chunk for the 1M-token extension, whose indexer scores [chunk, heads, S / m] per chunk)
# fields a resume may change: execution details, and QAT (switched on for the last part of a run)
EXECUTION_ONLY = frozenset({"attn_chunk_size", "use_triton", "qat"})


class CollectiveError(RuntimeError):
    """A collective failed or did not complete within `parallel.timeout_s`; names the step and the operation."""


@dataclass
class CheckpointConfig:
    interval: int = 50
    keep: int = 3
    async_save: bool = False


@dataclass
class TrainConfig:
    global_batch_tokens: float = 100.6e6
    max_steps: int | None = None  # stop after this many optimizer steps (the schedule is unchanged)
    seed: int = 0
    grad_clip: float = 1.0
    loss_tile_tokens: int = 2048  # head + cross-entropy over tiles of this many positions (train/loss.py)
    recompute: str = "none"  # activation recomputation per block: none | selective | full (model/recompute.py)
    balance_rate: float = 1e-3
    resume_from: str | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peak_tflops: PeakTflops = field(default_factory=PeakTflops)  # MFU peak per device type (train/flops.py)
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # traces / memory snapshots (train/profile.py)
    spike: SpikeConfig = field(default_factory=SpikeConfig)  # loss-spike detection and rollback (train/spike.py)
    anticipatory_routing: AnticipatoryRoutingConfig = field(default_factory=AnticipatoryRoutingConfig)


@dataclass
class Layout:
    world: int
    dp: int
    micro_batch: int
    accumulation: int  # micro-batches per optimizer step on each dp rank
    global_sequences: int
    pp: int = 1
    round_microbatches: int = 1  # pipeline: micro-batches per schedule step
    ep: int = 1
    cp: int = 1  # context parallel: ranks sharing each sequence

    @property
    def rounds(self) -> int:
        return self.accumulation // self.round_microbatches


def plan_layout(train: TrainConfig, seq_len: int, micro_batch: int, parallel: ParallelConfig, world: int,
                n_layers: int = 40, n_routed_experts: int = 1) -> Layout:
    """Validate the process layout and the fixed batch before anything is built."""
    if parallel.world is not None and parallel.world != world:
        raise ConfigError(f"parallel.world={parallel.world} but this run has {world} process(es): the layout "
                          f"(pp={parallel.pp}, cp={parallel.cp}, ep={parallel.ep}) is for {parallel.world}; launch "
                          f"that many, or set parallel.world=null and degrees that divide {world}")
    dp = mesh_shape(world, parallel.pp, parallel.ep, n_layers, n_routed_experts, parallel.cp).dp
    if parallel.stage_layers is not None and (len(parallel.stage_layers) != parallel.n_stages
                                              or sum(parallel.stage_layers) != n_layers
                                              or min(parallel.stage_layers) < 1):
        raise ConfigError(f"parallel.stage_layers={parallel.stage_layers}: needs {parallel.n_stages} positive layer "
                          f"counts (pp={parallel.pp} x {parallel.stages_per_rank} stage(s) per rank for "
                          f"{parallel.pipeline_schedule}) summing to {n_layers}")
    g = max(1, round(train.global_batch_tokens / seq_len))
    unit = dp * micro_batch
    if g % unit:
        nearest = sorted({max(unit, g // unit * unit), (g // unit + 1) * unit}, key=lambda n: (abs(n - g), n))
        raise ConfigError(
            f"train.global_batch_tokens={train.global_batch_tokens:g} is {g} sequences of data.seq_len={seq_len}, "
            f"which {dp} data-parallel rank(s) x data.batch_size={micro_batch} do not divide; use a global batch of "
            f"a multiple of {unit * seq_len} tokens -- the nearest is train.global_batch_tokens={nearest[0] * seq_len} "
            f"({nearest[0]} sequences)" + (f" or {nearest[1] * seq_len}" if len(nearest) > 1 else "") +
            " -- or change data.batch_size / the number of processes")
    validate_recompute(train.recompute)
    if train.loss_tile_tokens <= 0:
        raise ConfigError(f"train.loss_tile_tokens={train.loss_tile_tokens}: must be a positive number of positions")
    if train.checkpoint.interval <= 0 or train.checkpoint.keep <= 0:
        raise ConfigError("train.checkpoint.interval and train.checkpoint.keep must be positive")
    accumulation = g // (dp * micro_batch)
    if parallel.cp > 1:
        from flashtrain.model.sequence_split import chunk_ranges

        chunk_ranges(seq_len, parallel.cp, parallel.cp_balance)  # a sequence too short for the split fails here
    return Layout(world, dp, micro_batch, accumulation, g, parallel.pp, parallel.round_microbatches(accumulation),
                  parallel.ep, parallel.cp)


def _init_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: str | Path):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        die_with_launcher()
        faults.validate_environment()
        self._configure(cfg, run_dir, world)
        if int(os.environ.get("RANK", "0")) == 0:  # one job per run directory (held until this process ends)
            self._run_lock = acquire_run_lock(self.run_dir)
        check_sources(self.data_cfg, self.layout.dp)  # bad shards or tokenizer fail here, before any process group
        if self.train_cfg.resume_from and not Path(self.train_cfg.resume_from).is_dir():
            raise FileNotFoundError(f"train.resume_from={self.train_cfg.resume_from!r} does not exist")

        self.rank, world, self.device = _init_distributed(self.parallel.timeout_s)
        self._setup_groups(world)
        if self.is_main:
            log.info(f"run directory {self.run_dir}: {world} process(es) on {self.device.type}, pp={self.layout.pp} "
                     f"dp={self.layout.dp} ep={self.layout.ep} cp={self.layout.cp}, {self.max_steps} steps")
        torch.manual_seed(self.train_cfg.seed)
        random.seed(self.train_cfg.seed)
        np.random.seed(self.train_cfg.seed)
        # rank 0 builds the default corpus / engram map first; the others then find them cached
        for turn in (0, 1):
            if (turn == 0) == self.is_main:
                text, mm, tok = data_sources(self.data_cfg, self.spec)
                token_map = load_or_build_engram_map(tok) if self.model_cfg.engram_layer_ids else None
            self._barrier()
        self._build(model_template(self.model_cfg, token_map))
        self.loader = PackedLoader(self.data_cfg, self.spec, text, mm, self.dp_rank, self.layout.dp)
        self.checkpoints = CheckpointWriter(self.run_dir, self.train_cfg.checkpoint.keep,
                                            self.train_cfg.checkpoint.async_save)
        self._resume()

    def _configure(self, cfg: DictConfig, run_dir: str | Path, world: int) -> None:
        """Everything validated before a process group, a model or data exists."""
        self.run_dir = Path(run_dir)
        self.cfg_dict = OmegaConf.to_container(cfg, resolve=True)
        self.model_cfg = model_config(cfg)
        self.optim_cfg = optim_config(cfg)
        self.data_cfg = data_config(cfg)
        self.train_cfg = typed_config(TrainConfig, self.cfg_dict["train"], "train")
        self.log_cfg = typed_config(LoggingConfig, self.cfg_dict.get("logging"), "logging")
        self.parallel = typed_config(ParallelConfig, self.cfg_dict.get("parallel"), "parallel")
        self.schedule = schedule(cfg)
        self.layout = plan_layout(self.train_cfg, self.data_cfg.seq_len, self.data_cfg.batch_size, self.parallel, world,
                                  self.model_cfg.n_layers, self.model_cfg.n_routed_experts)
        self.engram_shard = self.parallel.shard_engram(self.model_cfg, self.layout.dp * self.layout.cp)
        self.max_steps = self.train_cfg.max_steps or self.schedule.total_steps
        self.spec = token_spec(self.model_cfg)
        self.tensor_mode = None  # a mode every tensor of the run is made under (the estimator's FakeTensorMode)
        self.step = 0
        self.tokens_seen = 0
        self._stop = False
        self._op = "start-up"  # the operation the step is in, named when a collective fails (issue 18 item 8)
        self._op_step = 0  # the step that operation belongs to
        self.detector = SpikeDetector(self.train_cfg.spike)
        self.snapshots = Snapshots(self.train_cfg.spike)
        self.ar = AnticipatoryRouting(self.train_cfg.anticipatory_routing)
        self._spike: str | None = None  # the current step's spike verdict (compute_step)
        self.spikes = {"skipped": 0, "rolled_back": 0}
        self.rolled_back_steps = 0  # steps undone by rollbacks: the wandb step axis stays increasing
        self._rollbacks_in_a_row, self._last_spike_step = 0, 0

    def _setup_groups(self, world: int) -> None:
        """The parallel dimensions (mesh, groups, this rank's coordinates; after the process group)."""
        self.is_main = self.rank == 0
        self.mixed_precision = self.device.type == "cuda"
        self.dims = ParallelDims.build(world, self.rank, self.layout.pp, self.layout.ep, self.model_cfg.n_layers,
                                       self.model_cfg.n_routed_experts, self.device.type,
                                       zero=self.optim_cfg.zero, engram_shard=self.engram_shard,
                                       bucket_bytes=int(self.parallel.grad_bucket_mb * (1 << 20)), cp=self.layout.cp)
        self.pp_rank, self.dp_rank, self.ep_rank = self.dims.pp_rank, self.dims.dp_rank, self.dims.ep_rank
        self.cp_rank = self.dims.cp_rank
        self.counts_data = self.cp_rank == 0  # the cp ranks of a group read the same batches: count them once

    def _build(self, template) -> None:
        """This rank's model, pipeline stages and optimizers from the whole model's meta-device template
        (`model_template`): pruned to this rank's stages and expert shard, then materialised
        (parallel/construct.py), so no rank allocates what it does not own and every layout starts from
        the same weights."""
        self.model = template
        self.pipe = None
        stages = None
        if self.layout.pp > 1:
            bounds = self._partition()
            stages = local_stage_ranges(self.parallel, bounds, self.pp_rank)
        engram_group = self.dims.dp_cp_group if self.dims.engram_shard else None
        build_rank_model(self.model, self.device, self.train_cfg.seed, stages, self.layout.ep, self.ep_rank,
                         self.dims.ep_group, self.tensor_mode, engram_group,
                         dist.get_rank(engram_group) if engram_group is not None else 0, self.dims.dp_cp)
        self.model.set_recompute(self.train_cfg.recompute)
        if self.layout.cp > 1:
            self.model.set_context_parallel(self.layout.cp, self.cp_rank, self.parallel.cp_balance,
                                            ContextComm(self.dims.cp_group))
        with self.tensor_mode or contextlib.nullcontext():
            if self.layout.pp > 1:
                self.pipe = self._build_pipeline(bounds)
            kinds, matrices = zero_inputs(route_parameters(self.model, self.model_cfg, self.optim_cfg))
            self.zero_plan = self.dims.zero_plan(self.model, kinds, matrices)
            self.optim = build_optimizers(self.model, self.model_cfg, self.optim_cfg,
                                          None if self.dims.zero else self.dims.muon_split_group_of(self.model),
                                          (lambda p: self.zero_plan[id(p)]) if self.dims.zero else None,
                                          self._sinkhorn_row_group_of(), lr=self.schedule.lr(self.step))
            self.reducer = self.dims.grad_reducer(self.model)

    def _partition(self) -> list[tuple[int, int]]:
        """[start, end) blocks of the parallel.n_stages stages (train/stages.py, as launch/plan.py shows)."""
        units = stage_units(self.model, self.model_cfg, self.optim_cfg, self.parallel, self.data_cfg.seq_len,
                            self.data_cfg.batch_size, self.train_cfg.recompute, self.mixed_precision,
                            self.layout.dp * self.layout.cp, self.layout.cp)
        return plan_stages(units, self.parallel)

    def _build_pipeline(self, bounds: list[tuple[int, int]]):
        """This rank's stages wrapped in the configured schedule."""
        accum = self.layout.accumulation

        split = self.model.sequence_split(self.data_cfg.seq_len)

        def loss_fn(hidden, labels):  # the last stage returns the final hidden states, not logits
            return tiled_lm_loss(hidden, self.model.head, labels, self.train_cfg.loss_tile_tokens, 1.0 / accum, split)

        pipe = build_pipeline(self.model, self.parallel, bounds, self.pp_rank, self.dims.pp_group, self.device,
                              self.data_cfg.batch_size, self.data_cfg.seq_len, self.layout.round_microbatches, loss_fn)
        if self.is_main:
            log.info(f"pipeline: {self.parallel.pipeline_schedule}, pp={self.layout.pp} x "
                     f"{self.parallel.stages_per_rank} stage(s) per rank, layers per stage "
                     f"{[b - a for a, b in bounds]}, {self.layout.round_microbatches} micro-batches per round x "
                     f"{self.layout.rounds} round(s)")
        return pipe

    # --- helpers -----------------------------------------------------------------------------
    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _all_reduce(self, t: torch.Tensor, op=None, group=None) -> torch.Tensor:
        """In place over `group` (default: every rank), through the device (NCCL reduces device tensors only)."""
        if dist.is_initialized():
            on_device = t.to(self.device)
            dist.all_reduce(on_device, op=op or dist.ReduceOp.SUM, group=group)
            t.copy_(on_device)
        return t

    def _sinkhorn_row_group_of(self):
        """Row-sharded Engram tables: the Sinkhorn update's column statistics are all-reduced over dp."""
        if not self.dims.engram_shard:
            return None
        tables = {id(p) for n, p in self.model.named_parameters() if n.endswith(".engram.embed.weight")}
        return lambda p: self.dims.dp_cp_group if id(p) in tables else None

    def _resume(self) -> None:
        own = latest_verified_checkpoint(self.run_dir, report=log.warning if self.is_main else lambda _: None,
                                         move_damaged=True)
        path = self.train_cfg.resume_from or own
        if self.train_cfg.resume_from:
            problem = checkpoint_problem(self.train_cfg.resume_from)
            if problem:
                raise CheckpointError(f"train.resume_from={self.train_cfg.resume_from} is damaged ({problem}); "
                                      f"pick another checkpoint")
        if self.train_cfg.resume_from and own is not None and weights_only(self.train_cfg.resume_from):
            # imported weights are where a run starts, not a resume point: a restart continues the run's own
            if self.is_main:
                log.info(f"train.resume_from={self.train_cfg.resume_from} holds weights only (an import); the run "
                         f"directory has its own checkpoints: resuming from {own}")
            path = own
        if path is None:
            return
        meta, mine = load_checkpoint(path, self.model, self.optim.optimizers, self.dp_rank, self.layout.dp,
                                     self.dims.global_layout(self.model))
        saved_model = meta["config"]["model"]
        diff = sorted(k for k in set(saved_model) | set(self.cfg_dict["model"])
                      if saved_model.get(k) != self.cfg_dict["model"].get(k) and k not in EXECUTION_ONLY)
        if diff:
            raise ConfigError(f"checkpoint {path} was written for a different model config (fields {diff} differ); "
                             f"use a new run directory, or the model config it was trained with")
        self.step, self.tokens_seen = meta["step"], meta["tokens_seen"]
        if mine is None:  # weights alone: fresh optimizer state, data from the start, the schedule from step 0
            if self.is_main:
                log.info(f"started from the weights in {path} ({meta.get('imported_from', 'imported')}): step 0, fresh "
                      f"optimizer state")
            return
        self.loader.load_state_dict(mine["data"])
        set_rng_state(mine["rng"])
        if "spike" in mine:
            self.detector.load_state_dict(mine["spike"]["detector"])
            self.spikes = dict(mine["spike"]["counts"])
            self.rolled_back_steps = mine["spike"]["rolled_back_steps"]
            if not self.ar.load_state_dict(mine["anticipatory_routing"], (mine.get("own") or {}).get("routes")):
                if self.is_main:
                    log.warning("the checkpoint's cached routing indices are for another layout: recomputing them "
                                "with the resumed parameters")
        if self.is_main:
            log.info(f"resumed from {path} at step {self.step}")

    def save(self) -> None:
        step = self.step  # a background write is finished during a later save: the hook names the step it wrote

        def hook(tmp):
            faults.inject("checkpoint_write", step, self.rank)

        hasher = getattr(self.model, "engram_hasher", None)
        meta = {"step": self.step, "tokens_seen": self.tokens_seen, "config": self.cfg_dict,
                "engram_compressed_vocab_size": None if hasher is None else hasher.compressed_vocab}
        rank_state = {"data": self.loader.state_dict(), "rng": rng_state(),
                      "spike": {"detector": self.detector.state_dict(), "counts": dict(self.spikes),
                                "rolled_back_steps": self.rolled_back_steps},
                      "anticipatory_routing": self.ar.state_dict()}
        routes = self.ar.routes_state()
        self.checkpoints.save(self.step, self.model, self.optim.optimizers, meta, rank_state, self.dp_rank,
                              fault_hook=hook, layout=self.dims.global_layout(self.model),
                              own_state=None if routes is None else {"routes": routes})
        if self.checkpoints.pending is not None:
            faults.inject("checkpoint_in_flight", self.step, self.rank)

    def _on_sigterm(self, signum, frame) -> None:
        self._stop = True

    def _step_batches(self) -> list[dict]:
        """The step's micro-batches from the loader (every rank of a pipeline reads the same ones)."""
        return [next(self.loader) for _ in range(self.layout.accumulation)]

    def _record_routes(self, batches: list[dict]) -> list[dict]:
        """Anticipatory Routing's extra forward (no gradients) over a step's micro-batches with the current
        parameters: per micro-batch, {MoE layer id: routing indices} of this rank's layers."""
        self._op = "the anticipatory-routing forward (pipeline transfers, expert all-to-all)"
        out: list[dict] = []
        with torch.no_grad(), self.autocast():
            if self.pipe:
                m = self.layout.round_microbatches
                for r in range(self.layout.rounds):
                    tokens, types, labels, images = self._round_inputs(batches[r * m:(r + 1) * m])
                    out += self.pipe.record_round(tokens, types, labels, images)
            else:
                for batch in batches:
                    recorded: dict = {}
                    self.model.run(batch["tokens"].to(self.device), batch["token_types"].to(self.device),
                                   [[img.to(self.device) for img in row] for row in batch["images"]], StepStats(),
                                   recorded=recorded)
                    out.append(recorded)
        return out

    def _round_inputs(self, batches: list[dict]):
        tokens = torch.cat([b["tokens"] for b in batches]).to(self.device)
        types = torch.cat([b["token_types"] for b in batches]).to(self.device)
        labels = torch.cat([b["labels"] for b in batches]).to(self.device)
        images = [[img.to(self.device) for img in row] for b in batches for row in b["images"]]
        return tokens, types, labels, images

    def _local_passes(self, batches: list[dict], routes: list[dict] | None) -> tuple[torch.Tensor, dict]:
        """Forward/backward of every micro-batch of the step, one after another (no pipeline)."""
        accum = self.layout.accumulation
        loads: dict[int, torch.Tensor] = {}
        sums = StepValues(self.device)
        for i, batch in enumerate(batches):
            stats = StepStats()
            tokens = batch["tokens"].to(self.device)
            types = batch["token_types"].to(self.device)
            images = [[img.to(self.device) for img in row] for row in batch["images"]]
            hidden = self.model.final_hidden(self.model.run(tokens, types, images, stats, aux_grad_scale=1.0 / accum,
                                                            routes=None if routes is None else routes[i]))
            loss = tiled_lm_loss(hidden, self.model.head, batch["labels"].to(self.device),
                                 self.train_cfg.loss_tile_tokens, 1.0 / accum,
                                 self.model.sequence_split(tokens.shape[1]))
            if i == accum - 1:
                self.reducer.mark_final()  # the gradients complete in this backward: reduce buckets as they do
            loss.backward()
            accumulate_loads(loads, stats.expert_load)  # on the device: no host sync per micro-batch
            sums.add("ce", loss * accum)
            sums.add("balance_loss", stats.total("balance_loss"))
            sums.add("indexer_loss", stats.total("indexer_loss"))
            if self.counts_data:
                sums.add("pad_tokens", batch["pad_tokens"])
                sums.add("positions", batch["tokens"].numel() + batch["tokens"].shape[0])
        return sums, loads

    def _pipeline_passes(self, batches: list[dict], routes: list[dict] | None) -> tuple[torch.Tensor, dict]:
        """The step's micro-batches through the schedule, `round_microbatches` per round. Every rank of
        the pipeline reads the same batches; the last stage's losses give the CE, each stage reports
        the aux values and loads of its own layers, and the data counters are taken on pp rank 0 only,
        so the all-reduces over every rank count each quantity once per dp rank."""
        accum, m = self.layout.accumulation, self.layout.round_microbatches
        self.pipe.set_aux_grad_scale(1.0 / accum)
        self.pipe.stats.reset()
        sums = StepValues(self.device)
        for r in range(self.layout.rounds):
            self.pipe.set_before_last_backward(self._mark_final if r == self.layout.rounds - 1 else None)
            mine = batches[r * m:(r + 1) * m]
            tokens, types, labels, images = self._round_inputs(mine)
            losses = self.pipe.run_round(tokens, types, labels, images,
                                         None if routes is None else routes[r * m:(r + 1) * m])
            if losses:  # the schedule's losses are CE / accum
                sums.add("ce", torch.stack(losses) * accum)
            if self.pp_rank == 0 and self.counts_data:
                sums.add("pad_tokens", sum(b["pad_tokens"] for b in mine))
                sums.add("positions", sum(b["tokens"].numel() + b["tokens"].shape[0] for b in mine))
        sums.add("balance_loss", self.pipe.stats.balance)
        sums.add("indexer_loss", self.pipe.stats.indexer)
        return sums, dict(self.pipe.stats.expert_load)

    def _mark_final(self, stage) -> None:
        self.reducer.mark_final(stage.submod.parameters())

    # --- the loop ----------------------------------------------------------------------------
    def train_step(self) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        lr = self.schedule.lr(self.step)
        sums, loads, grad_norm = self.compute_step()
        n_micro = self.layout.accumulation * self.layout.dp
        self.step += 1
        self.tokens_seen += self.schedule.tokens_per_step
        dt = time.perf_counter() - t0
        v = sums.read()
        record = {
            "step": self.step, "loss": v["ce"] / n_micro, "balance_loss": v["balance_loss"] / n_micro,
            "indexer_loss": v["indexer_loss"] / n_micro, "lr": lr, "grad_norm": grad_norm.item(),
            "tokens_seen": self.tokens_seen, "tokens_per_s": self.schedule.tokens_per_step / dt, "step_time_s": dt,
            "padding_fraction": v["pad_tokens"] / max(v["positions"], 1.0),
            "skipped_samples": int(sum(v[k] for k in LOADER_COUNTERS)),
            "vit_trainable": bool(self.schedule.vit_trainable(self.step - 1)),
            # train.spike / train.anticipatory_routing: this step's verdict (null: normal), whether its MoE
            # layers routed by anticipated indices, and the run's totals
            "spike": self._spike, "anticipatory_routing": self.ar.last_routes is not None,
            "spikes_skipped": self.spikes["skipped"], "rollbacks": self.spikes["rolled_back"],
            "expert_load": load_statistics(loads),
            # model FLOPs (forward + backward) per token at data.seq_len, and MFU = flops_per_token * tokens_per_s
            # / (peak per device * world), null without a known peak (train/flops.py; train.peak_tflops)
            "flops_per_token": (fpt := flops_per_token(self.model_cfg, self.data_cfg.seq_len)),
            "mfu": mfu(fpt, self.schedule.tokens_per_step / dt,
                       peak_flops(self.device, self.train_cfg.peak_tflops, self.is_main)[0], self.layout.world),
        }
        return record, loads

    def autocast(self):
        """bf16 autocast on CUDA (and when simulating it, train/estimate.py); fp32 on the CPU."""
        if self.mixed_precision:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    def compute_step(self) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """One optimizer step's computation and communication, without host syncs: forward/backward of
        every micro-batch, gradient reduction, clipping, optimizer step, MoE bias update, the sums'
        all-reduce. Returns (the step's summed values, train/step_values.py; global loads; grad norm)."""
        if self.model_cfg.vision_n_layers:
            set_vision_body_trainable(self.model, self.schedule.vit_trainable(self.step))
        lr = self.schedule.lr(self.step)
        self.optim.set_lr(lr)
        batches, routes = self.ar.next_step(self.step + 1, self._step_batches, self._record_routes)
        self.reducer.zero_grad()
        self._op = "the forward/backward passes (pipeline transfers, expert all-to-all, gradient buckets)"
        with self.autocast(), self._injected_spike():
            sums, loads = self._pipeline_passes(batches, routes) if self.pipe else self._local_passes(batches, routes)
        self._op = "the gradient reduction"
        self.reducer.finish()
        self._op = "the gradient-norm all-reduce (clipping)"
        grad_norm = self.dims.clip(self.model, self.train_cfg.grad_clip, self.device)
        self._spike = None
        if self.detector.enabled and self.tensor_mode is None:  # train.spike: judged before anything is updated
            self._op = "the spike check's loss all-reduce"
            self._spike = self._spike_verdict(sums, grad_norm)
        if self._spike is None:
            self._op = "the optimizer step"
            self.optim.step()
        self._op = "the expert-load all-reduce"
        loads = global_loads(loads, self.model_cfg.n_layers, self.model_cfg.n_routed_experts, device=self.device)
        if self._spike is None:
            update_biases(self.model, loads, self.train_cfg.balance_rate)
        if self.pp_rank == 0 and self.counts_data:  # the loader's counters of this step's reads, once per dp rank
            for k in LOADER_COUNTERS:
                sums.add(k, self.loader.counters().get(k, 0))
        self._op = "the all-reduce of the step's losses and counters"
        sums.all_reduce()
        return sums, loads, grad_norm

    @contextlib.contextmanager
    def _injected_spike(self):
        """FLASHTRAIN_FAULT=spike:... (tests, drills): this rank's head input x scale for the step."""
        scale = faults.spike_scale(self.step + 1, self.rank) if self.tensor_mode is None else None
        head = getattr(self.model, "head", None)
        hook = None if scale is None or head is None else head.register_forward_pre_hook(
            lambda module, args: (args[0] * scale, *args[1:]))
        try:
            yield
        finally:
            if hook is not None:
                hook.remove()

    def _spike_verdict(self, sums: StepValues, grad_norm: torch.Tensor) -> str | None:
        """The spike rule on the step's global loss and grad norm (train/spike.py); every rank judges the
        same values and the verdict is max-reduced, so all ranks act alike."""
        loss, norm = sums.global_value("ce") / (self.layout.accumulation * self.layout.dp), float(grad_norm.item())
        reason = self.detector.reason(loss, norm)
        flag = torch.tensor([0.0 if reason is None else 1.0])
        self._all_reduce(flag, dist.ReduceOp.MAX if dist.is_initialized() else None)
        if not flag.item():
            self.detector.accept(loss, norm)
            return None
        return reason or "another rank judged this step a spike"

    def fit(self) -> None:
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        metrics = MetricsLogger(self.run_dir, self.log_cfg, self.cfg_dict, self.is_main, self.max_steps, self.step)
        profiler = StepProfiler.for_trainer(self)  # train.profile: traces / memory snapshots of chosen steps
        try:
            self._loop(metrics, profiler)
        except RuntimeError as e:
            raise self._collective_error(e) from e
        finally:
            profiler.close()  # a trace / memory history still open (SIGTERM, a stop, a short run): write what it has
            metrics.close()
            signal.signal(signal.SIGTERM, previous)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def _rollback(self, record: dict, metrics: MetricsLogger) -> None:
        """train.spike.action=rollback: back to the newest snapshot at least rollback_steps before the spike;
        the data stream continues after the spike's batches; Anticipatory Routing switches on."""
        spike_step = self.step
        self._rollbacks_in_a_row += 1
        self._last_spike_step = max(self._last_spike_step, spike_step)
        if self._rollbacks_in_a_row > self.train_cfg.spike.max_rollbacks:
            limit = self.train_cfg.spike.max_rollbacks
            raise FloatingPointError(f"step {spike_step}: spike ({self._spike}) after {limit} rollbacks in a row "
                                     f"(train.spike.max_rollbacks={limit}); stopping (the last checkpoint is intact)")
        snap = self.snapshots.target(spike_step)
        self.snapshots.restore(snap, self.model, self.optim.optimizers)
        wandb_step = spike_step + self.rolled_back_steps  # the spike's own (unlogged) step on the wandb axis
        self.rolled_back_steps += spike_step - snap.step
        self.step, self.tokens_seen = snap.step, snap.tokens_seen
        self.spikes["rolled_back"] += 1
        self.ar.activate(self.step)
        event = {"event": "rollback", "spike_step": spike_step, "reason": self._spike, "loss": record["loss"],
                 "grad_norm": record["grad_norm"], "to_step": snap.step,
                 "anticipatory_routing_until": self.ar.active_until, "rollbacks": self.spikes["rolled_back"]}
        if self.is_main:
            log.warning(f"step {spike_step}: spike ({self._spike}); rolled back to step {snap.step}, the data "
                        f"continues after the spike's batches, anticipatory routing (delta_steps="
                        f"{self.train_cfg.anticipatory_routing.delta_steps}) through step {self.ar.active_until}")
        metrics.event(event, wandb_step=wandb_step)

    def _loop(self, metrics: MetricsLogger, profiler: StepProfiler) -> None:
        last_saved = self.step
        if self.train_cfg.spike.action == "rollback":  # a rollback point from the start
            self.snapshots.take(self.step, self.tokens_seen, self.model, self.optim.optimizers)
        while self.step < self.max_steps:
            self._op_step = self.step + 1
            faults.inject("step_start", self.step + 1, self.rank)
            with profiler.step(self.step + 1):
                record, loads = self.train_step()
            if self._spike is not None and self.train_cfg.spike.action == "rollback":
                self._rollback(record, metrics)
                continue
            if self._spike is not None:
                self.spikes["skipped"] += 1
                record["spikes_skipped"] = self.spikes["skipped"]
                if self.is_main:
                    log.warning(f"step {self.step}: spike ({self._spike}); update skipped "
                                f"({self.spikes['skipped']} so far)")
            elif not math.isfinite(record["loss"]):
                raise FloatingPointError(f"loss is {record['loss']} at step {self.step}; stopping (the last "
                                         f"checkpoint is intact; train.spike.action=skip or rollback survives this)")
            elif self.step > self._last_spike_step:  # past the spike that caused the last rollbacks
                self._rollbacks_in_a_row = 0
            metrics.log(self.step, record, loads, wandb_step=self.step + self.rolled_back_steps)
            self._op_step = self.step  # the stop flag and the checkpoint belong to the step just done
            if self.train_cfg.spike.action == "rollback" and self.snapshots.due(self.step):
                self.snapshots.take(self.step, self.tokens_seen, self.model, self.optim.optimizers)
            faults.inject("after_step", self.step, self.rank)
            self._op = "the stop-flag all-reduce"
            stop = torch.tensor([1.0 if self._stop else 0.0])
            self._all_reduce(stop, dist.ReduceOp.MAX if dist.is_initialized() else None)
            if self.step % self.train_cfg.checkpoint.interval == 0 or self.step == self.max_steps or stop.item():
                self._op = f"saving checkpoint step_{self.step:08d}"
                self.save()
                last_saved = self.step
            if stop.item():
                if self.is_main:
                    log.info(f"SIGTERM: saved step {self.step}, exiting")
                return
        if last_saved != self.step:
            self._op = f"saving checkpoint step_{self.step:08d}"
            self.save()
        self._op = "finishing the last checkpoint write"
        self.checkpoints.wait()

    def _collective_error(self, e: RuntimeError) -> RuntimeError:
        """A failed or timed-out collective, named by step and operation (parallel.timeout_s bounds the wait)."""
        if not dist.is_initialized() or isinstance(e, (CollectiveError, FloatingPointError, CheckpointError)):
            return e
        text = str(e)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        if not (timed_out or isinstance(e, dist.DistError) or "connection" in text.lower()):
            return e
        why = (f"did not complete within parallel.timeout_s={self.parallel.timeout_s:g} s (a rank stalled or "
               f"is stuck)" if timed_out else f"failed ({type(e).__name__}: {text.splitlines()[0][:200]})")
        return CollectiveError(f"rank {self.rank}: step {self._op_step}, {self._op}: a collective {why}; the last "
                               f"checkpoint is intact -- restart in the run directory to resume (raise "
                               f"parallel.timeout_s if the step legitimately takes longer)")
