"""Construction of a training run as plain functions (DESIGN.md "Training", "Construction at scale"),
composed by the trainer (train/trainer.py) and the memory estimator (train/plan/estimate.py) alike:

    read_configs(cfg)              every typed config of the run, validated (train/config.py)
    plan_layout(...)               the degrees (ParallelDims.plan) and the batch arithmetic (BatchPlan),
                                   checked before anything exists
    init_distributed(timeout_s)    the process group (gloo on CPU, NCCL on CUDA) and this rank's device
    build_dims(...)                the parallel dimensions: mesh, groups, this rank's coordinates
    build_module(...)              this rank's train module (train/module.py; the DSpark stage's,
                                   train/dspark/stage.py): model, pipeline stages, optimizers, gradient reducer,
                                   step runner, from the whole model's meta-device template
    build_loader(...)              the packed data loader of this rank's dp slice
    build_evaluator(...)           the held-out set and this rank's share of it (train/evaluation/heldout.py)

The estimator's one seam is `build_module`'s `tensor_mode`: the memory estimator passes its
FakeTensorMode, under which the model is materialised and the pipeline, optimizers and reducer are
built (the pruning stays on plain meta tensors); the trainer passes nothing. What else differs when
simulating (values that do not exist on fake tensors) is listed in train/plan/estimate.py.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from flashtrain.config.errors import ConfigError, InputNotFoundError
from flashtrain.config.typed import typed_config
from flashtrain.data.config import DataConfig, TokenSpec, resolve_shards
from flashtrain.data.heldout import heldout_set
from flashtrain.data.loader import (
    PackedLoader,
    check_shard_indexes,
    check_sources,
    data_sources,
    heldout_shards,
    reader_shards,
)
from flashtrain.data.tokenizer import load_tokenizer, token_byte_counts
from flashtrain.model.config import ModelConfig
from flashtrain.model.recompute import validate_recompute
from flashtrain.model.sequence_split import chunk_ranges
from flashtrain.parallel.config import ParallelConfig, check_recompute_with_schedule
from flashtrain.parallel.dims import ParallelDims
from flashtrain.parallel.liveness import Liveness
from flashtrain.parallel.nodes import STARTUP_TURNS, NodeTable, check_shared_run_dir, cuda_device_index, startup_turn
from flashtrain.train.compile import check_backend, compile_enabled
from flashtrain.train.config import (
    BatchPlan,
    TrainConfig,
    data_config,
    model_config,
    optim_config,
    plan_batches,
    rounded_batch_note,
    schedule,
    token_spec,
)
from flashtrain.train.dspark.stage import DSparkModule, check_backbone_path, validate_stage
from flashtrain.train.engram_map import load_or_build_engram_map
from flashtrain.train.evaluation.heldout import Evaluator
from flashtrain.train.metrics import LoggingConfig
from flashtrain.train.module import TrainModule, counts_data
from flashtrain.train.optim.config import OptimConfig
from flashtrain.train.runtime.collectives import Operation, all_reduce, barrier
from flashtrain.train.runtime.run_guard import acquire_run_lock, die_with_parent
from flashtrain.train.schedule import Schedule
from flashtrain.train.step_runner import StepRunner

log = logging.getLogger(__name__)


@dataclass
class RunConfigs:
    """Every typed config of a run, and the resolved mapping they came from (saved with checkpoints)."""

    cfg_dict: dict
    model: ModelConfig
    optim: OptimConfig
    data: DataConfig
    train: TrainConfig
    logging: LoggingConfig
    parallel: ParallelConfig
    schedule: Schedule
    spec: TokenSpec


def read_configs(cfg: DictConfig) -> RunConfigs:
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    model = model_config(cfg)
    c = RunConfigs(cfg_dict, model, optim_config(cfg), data_config(cfg),
                   typed_config(TrainConfig, cfg_dict["train"], "train"),
                   typed_config(LoggingConfig, cfg_dict.get("logging"), "logging"),
                   typed_config(ParallelConfig, cfg_dict.get("parallel"), "parallel"), schedule(cfg),
                   token_spec(model))
    validate_stage(c)
    check_ablations(c)
    return c


def check_ablations(c: RunConfigs) -> None:
    """The ablation switches (model.attention / residual / ffn, docs/training.md "What each component buys")
    against what the run asks of the model, before anything is built."""
    m, p = c.model, c.parallel
    if m.ablated and c.train.stage != "pretrain":
        raise ConfigError(f"train.stage={c.train.stage}: the drafter is trained against V4.1 as published, not "
                          f"with {', '.join('model.' + a for a in m.ablated)}; drop the ablation(s)")
    if m.ablated and p.pp > 1:
        raise ConfigError(f"parallel.pp={p.pp}: the ablation(s) {', '.join('model.' + a for a in m.ablated)} are "
                          f"checked on one pipeline stage only; set parallel.pp=1")
    if m.attention == "dense" and p.cp > 1:
        raise ConfigError(f"parallel.cp={p.cp}: model.attention=dense attends over the whole prefix, which a "
                          f"context-parallel slice does not hold; set parallel.cp=1")
    if m.ffn == "dense" and p.ep > 1:
        raise ConfigError(f"parallel.ep={p.ep}: model.ffn=dense has no experts to shard; set parallel.ep=1")
    if m.ffn == "dense" and c.train.spike.action == "rollback":
        raise ConfigError("train.spike.action=rollback: its Anticipatory Routing replays MoE routing, which "
                          "model.ffn=dense does not have; use train.spike.action=skip or none")


def ablation_line(c: RunConfigs) -> str | None:
    """The startup line of a run that is not V4.1 as published (docs/training.md "What each component buys"):
    the switches set away from it, Engram off and the Muon ablation included; None for the published recipe."""
    away = [f"model.{a}" for a in c.model.ablated]
    if not c.model.engram_layer_ids:
        away.append("model.engram_layer_ids=[]")
    if c.optim.matrices != "muon":
        away.append(f"optim.matrices={c.optim.matrices}")
    return f"ablation: {', '.join(away)} (not V4.1 as published)" if away else None


def plan_layout(train: TrainConfig, seq_len: int, micro_batch: int, parallel: ParallelConfig, world: int,
                n_layers: int = 40, n_routed_experts: int = 1) -> BatchPlan:
    """Validate the process layout and the fixed batch before anything is built: the run's degrees
    (`plan.dims`, not yet connected) and its batch arithmetic."""
    if parallel.world is not None and parallel.world != world:
        raise ConfigError(f"parallel.world={parallel.world} but this run has {world} process(es): the layout "
                          f"(pp={parallel.pp}, cp={parallel.cp}, ep={parallel.ep}) is for {parallel.world}; launch "
                          f"that many, or set parallel.world=null and degrees that divide {world}")
    dims = ParallelDims.plan(world, parallel.pp, parallel.ep, n_layers, n_routed_experts, parallel.cp)
    if parallel.stage_layers is not None and (len(parallel.stage_layers) != parallel.n_stages
                                              or sum(parallel.stage_layers) != n_layers
                                              or min(parallel.stage_layers) < 1):
        raise ConfigError(f"parallel.stage_layers={parallel.stage_layers}: needs {parallel.n_stages} positive layer "
                          f"counts (pp={parallel.pp} x {parallel.stages_per_rank} stage(s) per rank for "
                          f"{parallel.pipeline_schedule}) summing to {n_layers}")
    plan = plan_batches(train, seq_len, micro_batch, dims, parallel)
    validate_recompute(train.recompute)
    check_recompute_with_schedule(parallel.pipeline_schedule, parallel.pp, train.recompute)
    if compile_enabled(train.compile, "cuda" if torch.cuda.is_available() else "cpu", train.compile_default):
        check_backend(train.compile_backend)
    if train.loss_tile_tokens <= 0:
        raise ConfigError(f"train.loss_tile_tokens={train.loss_tile_tokens}: must be a positive number of positions")
    if train.checkpoint.interval <= 0 or train.checkpoint.keep <= 0:
        raise ConfigError("train.checkpoint.interval and train.checkpoint.keep must be positive")
    if parallel.cp > 1:
        chunk_ranges(seq_len, parallel.cp, parallel.cp_balance)  # a sequence too short for the split fails here
    return plan


def run_plan(c: RunConfigs, world: int) -> BatchPlan:
    return plan_layout(c.train, c.data.seq_len, c.data.batch_size, c.parallel, world, c.model.n_layers,
                       c.model.n_routed_experts)


def init_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    """(rank, world, device): the process group of a torchrun launch -- of one process too (NCCL on one GPU, as
    launch/check_gpu.py runs it) --, none for a plain `python` start."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if (world > 1 or "TORCHELASTIC_RUN_ID" in os.environ) and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if torch.cuda.is_available():
        local = cuda_device_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def build_dims(c: RunConfigs, plan: BatchPlan, rank: int, device_type: str) -> ParallelDims:
    """The run's parallel dimensions (`plan.dims`) connected: mesh, groups, this rank's coordinates (after
    the process group)."""
    dims = plan.dims
    return dims.connect(rank, device_type, zero=c.optim.zero, engram_shard=c.parallel.shard_engram(c.model, dims.dp_cp),
                        bucket_bytes=int(c.parallel.grad_bucket_mb * (1 << 20)))


@dataclass
class Run:
    """A run brought up in this process (`bring_up`), then its data (`Run.read_data`)."""

    c: RunConfigs
    plan: BatchPlan
    rank: int
    device: torch.device
    dims: ParallelDims
    nodes: NodeTable | None = None
    liveness: Liveness | None = None
    lock: object | None = None  # the run directory's job lock (train/runtime/run_guard.py; rank 0 of a training run)
    tokenizer: str | None = None  # `read_data`: the tokenizer's path
    sources: list | None = None  # the training data sources (data/loader.py `data_sources`)
    heldout: list[str] | None = None  # the held-out shards (data/loader.py `heldout_shards`)
    token_map: list[int] | None = None  # the Engram tokenizer map (train/engram_map.py); None without Engram

    run_dir: Path | None = None  # a training run's directory

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def stop_liveness(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()
            self.liveness = None

    def release(self) -> None:
        """Let go of what the next stage's run in this process takes again: the heartbeat and the job lock."""
        self.stop_liveness()
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def log_start(self, max_steps: int, stage_line: str | None = None) -> None:
        """A training run's start-up lines (rank 0): where it runs and how, the recipe's stage, an ablation, the
        job's nodes."""
        c, d = self.c, self.dims
        backend = f", process group {dist.get_backend()}" if dist.is_initialized() else ""
        log.info(f"run directory {self.run_dir}: {d.world} process(es) on {self.device.type}, pp={d.pp} dp={d.dp} "
                 f"ep={d.ep} cp={d.cp}, {max_steps} steps{backend}")
        for line in (stage_line, ablation_line(c)):
            if line:
                log.info(line)
        if len(self.nodes.nodes()) > 1:
            log.info(f"{self.nodes.summary()}; a rank whose heartbeat stands still for parallel.peer_timeout_s="
                     f"{c.parallel.peer_timeout_s:g} s is gone and ends the job")

    def read_data(self, heldout: bool = True) -> Run:
        """The seed, then the data sources, the held-out shards (`heldout`) and the Engram map: rank 0 builds the
        default corpus / Engram map first, then each other node's first rank (a node-local cache), then the rest
        find them cached (parallel/nodes.py `startup_turn`)."""
        c = self.c
        torch.manual_seed(c.train.seed)
        random.seed(c.train.seed)
        np.random.seed(c.train.seed)
        local = self.nodes.places[self.rank].local_rank if self.nodes is not None else 0
        mine = startup_turn(self.rank, local)
        for turn in range(STARTUP_TURNS):
            if turn == mine:
                self.sources, self.tokenizer = data_sources(c.data, c.spec)
                self.heldout = heldout_shards(c.data, c.spec) if heldout else []
                self.token_map = load_or_build_engram_map(self.tokenizer) if c.model.engram_layer_ids else None
            barrier()
        return self


def bring_up(c: RunConfigs, world: int, run_dir: Path | None = None, rank: int | None = None,
             checks: bool = True) -> Run:
    """One bring-up for the trainer, the checkpoint scorer (train/evaluation/checkpoint.py), speculative
    decoding (train/dspark/speculative.py) and the memory estimator (train/plan/estimate.py), before any model
    exists: the run plan (`run_plan`), what the start needs on disk (`check_start`; `checks`), the process group
    (`init_distributed`; `rank` given: the caller's own, the estimator's fake one, on the CPU), the job's nodes,
    the connected dims.
    A training run (`run_dir`) also takes the run directory's lock (rank 0), checks every node sees the
    directory and starts the job's liveness heartbeat. `Run.read_data` then reads the data."""
    plan = run_plan(c, world)
    if checks:
        check_start(c, plan.dp)  # the data and the resume point on disk, before anything is written
    lock = None
    if run_dir is not None and int(os.environ.get("RANK", "0")) == 0:  # one job per run directory (held until
        lock = acquire_run_lock(run_dir)                                # this process ends)
        if note := rounded_batch_note(c.train.global_batch_tokens, c.data.seq_len):
            log.warning(note)
    if rank is None:
        rank, world, device = init_distributed(c.parallel.timeout_s)
        nodes = NodeTable.gather()  # the job's nodes (parallel/nodes.py): named in messages
    else:
        device, nodes = torch.device("cpu"), None
    liveness = None
    if run_dir is not None:  # every node must see the run directory
        check_shared_run_dir(run_dir, nodes, rank)
        liveness = Liveness.for_job(rank, world, c.parallel.peer_timeout_s, nodes.describe)
    return Run(c, plan, rank, device, build_dims(c, plan, rank, device.type), nodes=nodes, liveness=liveness, lock=lock,
               run_dir=run_dir)


def build_module(run: Run, template, op: Operation, mixed_precision: bool | None = None,
                 tensor_mode=None) -> TrainModule:
    """This rank's train module for the run's `train.stage` (train/module.py): pre-training's, or the DSpark
    stage's (train/dspark/stage.py), built from the whole model's meta-device template; `mixed_precision` (default: on
    CUDA) bf16 autocast. `tensor_mode`: the estimator's seam (module docstring); the module it builds has no
    stability guard."""
    c = run.c
    module = DSparkModule if c.train.stage == "dspark" else TrainModule
    mixed_precision = run.device.type == "cuda" if mixed_precision is None else mixed_precision
    return module.build(c, run.plan, run.dims, run.device, template, op, c.schedule, mixed_precision, run.is_main,
                        tensor_mode)


def build_loader(run: Run, known_corrupt: set[str] | None = None) -> PackedLoader:
    """This rank's loader of the run's data sources; its workers die with this process (a SIGKILLed trainer leaves
    none behind). `known_corrupt`: its shards the start-up check found unreadable (counted in `corrupt_shards`
    from the start)."""
    c, dims = run.c, run.dims
    return PackedLoader(c.data, c.spec, run.sources, dims.dp_rank, dims.dp,
                        worker_init_fn=functools.partial(die_with_parent, os.getpid()),
                        known_corrupt=known_corrupt or set())


def check_shards_at_start(run: Run) -> set[str]:
    """The start-up check of every listed shard's tar index (headers only, nothing decoded;
    data/loader.py `check_shard_indexes`): each rank that reads data (pipeline rank 0, context-parallel rank
    0) checks the shards of its dp rank and names each unreadable one in a warning; rank 0 says how many
    were checked and found unreadable (one all-reduce). A broken shard stops nothing: its complete samples
    are read and it counts in `corrupt_shards`. Returns this rank's unreadable shards."""
    c, dims = run.c, run.dims
    mine = reader_shards(run.sources, dims.dp_rank, dims.dp, c.data.num_workers) if \
        dims.pp_rank == 0 and counts_data(dims) else []
    problems = check_shard_indexes(mine)
    for shard, problem in problems.items():
        log.warning(f"shard {shard}: {problem}; its complete samples are read, the rest skipped (counted in "
                    f"corrupt_shards)")
    counts = torch.tensor([float(len(mine)), float(len(problems))])
    all_reduce(counts, run.device)
    if run.is_main:
        checked, bad = int(counts[0]), int(counts[1])
        log.info(f"start-up check of the shards' tar indexes: {checked} shard(s), "
                 + (f"{bad} unreadable (named above; rank 0 names its own, each rank its own)" if bad else
                    "all readable"))
    return set(problems)


def build_evaluator(run: Run, runner: StepRunner, periodic: bool = True) -> Evaluator | None:
    """The run's held-out evaluation (train/evaluation/heldout.py) through `runner` from the run's held-out shards
    (data/loader.py `heldout_shards`); None with `train.eval.interval` 0, or without held-out shards (logged).
    `periodic`: a run's, every `train.eval.interval` steps (False: one scoring of a checkpoint, launch/evaluate.py)."""
    c, dims, shards, is_main = run.c, run.dims, run.heldout, run.is_main
    if not c.train.eval.interval:
        return None
    if not shards:
        if is_main:
            log.warning("no held-out data: evaluation is off (set data.val_shards to held-out shards written by "
                        "launch/prepare_data.py, or train.eval.interval=0 to silence this)")
        return None
    token_bytes = token_byte_counts(load_tokenizer(run.tokenizer), c.spec.vocab_size)
    heldout = heldout_set(c.data, c.spec, shards, c.train.eval.tokens, token_bytes)
    if is_main:
        when = f"held-out evaluation every {c.train.eval.interval} steps" if periodic else "held-out set"
        log.info(f"{when}: {len(heldout.batches)} micro-batches, " + ", ".join(
            f"{name} {int(n)} tokens" for name, n in zip(heldout.sources, heldout.targets) if n))
    return Evaluator(c.train.eval, heldout, token_bytes, runner, dims, c.data.batch_size, run.device, is_main)


def check_start(c: RunConfigs, readers: int) -> None:
    """What a start needs on disk, checked before a process group exists: the data (shards, tokenizer, enough
    shards for `readers` data-parallel ranks x workers; data/loader.py `check_sources`) and train.resume_from."""
    check_sources(c.data, readers, c.spec)
    check_backbone_path(c)
    if c.train.eval.interval and c.data.val_shards is not None:
        resolve_shards(c.data.val_shards, "val_shards")  # a pattern that matches nothing fails now
    if c.train.resume_from and not Path(c.train.resume_from).is_dir():
        raise InputNotFoundError(f"train.resume_from={c.train.resume_from!r} does not exist; point it at a "
                                 f"checkpoint directory (checkpoints/step_XXXXXXXX) or remove it")
