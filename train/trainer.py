"""The training loop (DESIGN.md "Training"). One optimizer step:

    batches            the step's micro-batches from the loader (or, while Anticipatory Routing is on,
                       from the stability guard's look-ahead buffer with their routing indices)
    step runner        forward/backward of every micro-batch, the gradient reduction (train/step_runner.py)
    clip, verdict      the norm over the whole model (parallel/dims.py); the stability guard's spike
                       verdict (train/stability/guard.py) before anything is updated
    optimizer step     ZeRO-1 (train/optim/, parallel/zero.py), skipped on a spike
    MoE bias update    from the loads all-reduced over the global batch (train/balancing.py)
    schedule / freeze  the LR of the step and the ViT body frozen until the decay starts (train/schedule.py)
    metrics            one record per step (train/metrics.py)
    evaluation         every `train.eval.interval` steps, the held-out loss and bits per byte through the
                       same step runner (train/evaluation/heldout.py), an eval event in the metrics
    checkpoint         every `train.checkpoint.interval` steps, at the end and on SIGTERM (train/checkpoint.py)

The loop holds no parallelism, no model and no stage: `__init__` brings the run up (train/build.py: configs,
layout, process group, parallel dimensions, data), is given this rank's train module (train/module.py: model,
pipeline, optimizers, gradient reduction, step runner, stability guard; whichever `train.stage` names) and
its loader, and resumes (train/resume.py); each step is the module's `step`; a collective that fails is reported
by step and operation (train/runtime/collectives.py). docs/step_path.md lists the files one batch passes through.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from flashtrain.data.trace import DataTrace, open_trace
from flashtrain.parallel.construct import model_template
from flashtrain.train.build import (
    bring_up,
    build_evaluator,
    build_loader,
    build_module,
    check_shards_at_start,
    read_configs,
)
from flashtrain.train.checkpoint import CheckpointWriter, latest_checkpoint, read_meta
from flashtrain.train.compile import compile_report
from flashtrain.train.config import CheckpointConfig, TrainConfig
from flashtrain.train.flops import mfu, peak_flops
from flashtrain.train.metrics import MetricsLogger, load_stats
from flashtrain.train.module import StepOutcome
from flashtrain.train.profile import StepProfiler
from flashtrain.train.recipe import check_stage, closing_line, next_boundary, stage_line, stage_name, start_stage
from flashtrain.train.resume import restore_data_position, resume_path
from flashtrain.train.runtime import faults
from flashtrain.train.runtime.collectives import CollectiveError, Operation, any_rank, collective_error
from flashtrain.train.runtime.run_guard import die_with_launcher
from flashtrain.train.stability.spike import rng_state, set_rng_state
from flashtrain.train.step_runner import StepBatches
from flashtrain.train.step_values import source_fields

__all__ = ["CheckpointConfig", "CollectiveError", "StepOutcome", "TrainConfig", "Trainer"]
log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: str | Path):
        self.started = time.time()  # this start's wall clock, for the last log line
        world = int(os.environ.get("WORLD_SIZE", "1"))
        die_with_launcher()
        faults.validate_environment()
        self.run_dir, self.raw_cfg = Path(run_dir), cfg
        # the recipe's stage of the resume point (train/recipe.py): its configuration, every stage checked
        self.stage, stage_cfg = start_stage(cfg, self.run_dir, world)
        self.cfg = read_configs(stage_cfg)  # validated before anything exists
        self.next_stage_tokens = next_boundary(cfg, self.stage)  # None: the last stage
        self.crossed = False  # this run of the stage ended at the next one's boundary (saved there)
        c, self.schedule = self.cfg, self.cfg.schedule
        self.max_steps = c.train.max_steps or self.schedule.total_steps
        self.step, self.tokens_seen, self._stop, self.op = 0, 0, False, Operation()
        self.source_tokens: dict[str, int] = {}  # per data source, the positions read so far (every dp rank)
        # the plan, the start checks, the run lock, the process group, the nodes, the dims (train/build.py)
        self.run = run = bring_up(c, world, self.run_dir)
        self.plan, self.rank, self.device, self.dims, self.nodes = run.plan, run.rank, run.device, run.dims, run.nodes
        self.is_main = run.is_main
        if self.is_main:
            run.log_start(self.max_steps, stage_line(cfg, self.stage, self.next_stage_tokens))
        run.read_data(heldout=bool(c.train.eval.interval))  # the seed; rank 0 first: the corpus, the Engram map
        corrupt = check_shards_at_start(run)  # the shards' tar indexes, headers only
        # this rank's train module (train/module.py): model, optimizers, gradient reduction, step runner, guard
        self.module = build_module(run, model_template(c.model, run.token_map), self.op)
        self.loader = build_loader(run, corrupt)
        # the MFU peak, once (rank 0 writes the records): configured, the GPU table, or this machine's cached
        # CPU measurement -- stated in the log (train/flops.py)
        self.peak = peak_flops(self.device, c.train.peak_tflops, True)[0] if self.is_main else None
        self.batches = StepBatches(self.loader, self.plan.accumulation)
        self.evaluator = build_evaluator(run, self.module.runner) if self.module.evaluates else None
        self.checkpoints = CheckpointWriter(self.run_dir, c.train.checkpoint.keep, c.train.checkpoint.async_save)
        self.trace: DataTrace | None = None  # data.trace: opened by `fit`
        self._resume()

    def _resume(self) -> None:
        path = resume_path(self.cfg.train.resume_from, self.run_dir, self.is_main)
        if path is None:
            return
        self.module.check_resume(read_meta(path), path)  # before anything is loaded
        meta, mine = self.module.load(path)
        self.step, self.tokens_seen = meta["step"], meta["tokens_seen"]
        check_stage(self.raw_cfg, self.stage, self.tokens_seen, path)
        if mine is None:  # weights alone: fresh optimizer state, data from the start, the schedule from step 0
            if self.is_main:
                log.info(f"started from the weights in {path} ({meta.get('imported_from', 'imported')}): step 0, fresh "
                         f"optimizer state")
            return
        restore_data_position(self.loader, mine["data"], path, self.dims.dp, self.cfg.data, self.is_main)
        self.source_tokens = dict(meta.get("source_tokens", {}))
        set_rng_state(mine["rng"])
        self.module.load_state_dict(mine)
        if self.is_main:
            log.info(f"resumed from {path} at step {self.step}")

    def save(self) -> None:
        # a background write is finished during a later save: the hook names the step it wrote
        hook = functools.partial(faults.on_checkpoint_write, self.step, self.rank)
        meta = {"step": self.step, "tokens_seen": self.tokens_seen, "config": self.cfg.cfg_dict,
                "source_tokens": dict(self.source_tokens), **self.module.checkpoint_meta()}
        rank_state = {"data": self.loader.state_dict(), "rng": rng_state()}
        self.module.save(self.checkpoints, self.step, meta, rank_state, hook)
        if self.checkpoints.pending is not None:
            faults.inject("checkpoint_in_flight", self.step, self.rank)

    # --- the loop ----------------------------------------------------------------------------
    def train_step(self) -> tuple[dict, dict]:
        """One training step and its metrics record: `forward_backward_update`, then the step counters."""
        t0 = time.perf_counter()
        lr = self.schedule.lr(self.step)
        cuda = self.device.type == "cuda"
        if cuda:  # the allocator's own counters: host-side, no synchronisation
            torch.cuda.reset_peak_memory_stats(self.device)
        out = self.forward_backward_update()
        self.step += 1
        self.tokens_seen += self.schedule.tokens_per_step
        dt = time.perf_counter() - t0
        # the step's one read-back: its values, the gradient norm, the expert-load statistics
        v = out.sums.read(grad_norm=out.grad_norm, load_stats=load_stats(out.loads))
        record = {
            "step": self.step, **self.module.record(out, v, self.step), "lr": lr, "tokens_seen": self.tokens_seen,
            "tokens_per_s": self.schedule.tokens_per_step / dt, "step_time_s": dt,
            "per_source": source_fields(self.loader.sources, v, self.source_tokens),
            # model FLOPs (forward + backward) per token at data.seq_len, and MFU = flops_per_token * tokens_per_s
            # / (peak per device * world), null without a known peak (train/flops.py; train.peak_tflops)
            "flops_per_token": (fpt := self.module.flops_per_token(self.cfg.data.seq_len)),
            "mfu": mfu(fpt, self.schedule.tokens_per_step / dt, self.peak, self.dims.world),
            # CUDA: this rank's peak of allocated bytes during the step (torch.cuda.max_memory_allocated); null on CPU
            "memory_peak_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else None,
        }
        return record, out.loads

    def forward_backward_update(self) -> StepOutcome:
        """One optimizer step's computation, communication and update (the train module's `step`) on the step's
        batches, traced when `data.trace` is on."""
        batches, routes = self.module.next_batches(self.step + 1, self.batches)
        if self.trace is not None:
            self.trace.record(self.step + 1, batches)
        return self.module.step(batches, routes, self.step, self.loader.counters)

    def fit(self) -> None:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "_stop", True))
        c = self.cfg
        metrics = MetricsLogger(self.run_dir, c.logging, c.cfg_dict, self.is_main, self.max_steps, self.step)
        profiler = StepProfiler.for_trainer(self)  # train.profile: traces / memory snapshots of chosen steps
        reads = self.dims.pp_rank == 0 and self.module.counts_data  # each dp rank's batches traced once
        self.trace = open_trace(self.cfg.data.trace, self.run_dir, self.step, self.loader.names, self.dims, reads)
        try:
            self._loop(metrics, profiler)
            self.op.name = "finishing the last checkpoint write"
            self.checkpoints.wait()  # (a SIGTERM stop leaves the last one in flight)
        except RuntimeError as e:
            raise collective_error(e, self.op, self.rank, self.cfg.parallel.timeout_s, self.run.liveness) from e
        finally:
            profiler.close()  # a trace / memory history still open (SIGTERM, a stop, a short run): write what it has
            metrics.close()
            if self.trace is not None:
                self.trace.close()
            signal.signal(signal.SIGTERM, previous)
        if self.is_main:  # after the progress bar has closed: a line of its own
            if self.module.compiled:
                log.info(compile_report())  # the graphs and where they break (train/compile.py)
            how = "stopped by SIGTERM" if self._stop else "ended stage" if self.crossed else "finished"
            log.info(closing_line(how, self.raw_cfg, self.stage, self.step, self.max_steps, self.tokens_seen,
                                  time.time() - self.started, latest_checkpoint(self.run_dir)))
        if dist.is_initialized():
            dist.barrier()
            self.run.stop_liveness()
            if not self.crossed:  # at a stage boundary the next stage's trainer runs in the same processes
                dist.destroy_process_group()

    def close(self) -> None:
        """Let go of what the next stage's trainer in this process takes again: the run directory's job lock and
        the loader's workers."""
        self.run.release()
        self.loader.close()

    def _loop(self, metrics: MetricsLogger, profiler: StepProfiler) -> None:
        last_saved = self.step
        self.module.guard.start(self.step, self.tokens_seen)
        while self.step < self.max_steps:
            saved, stop = self.loop_step(metrics, profiler)
            if saved:
                last_saved = self.step
            if stop:
                return
        if last_saved != self.step:
            self.op.name = f"saving checkpoint step_{self.step:08d}"
            self.save()
        self.op.name = "finishing the last checkpoint write"
        self.checkpoints.wait()

    def loop_step(self, metrics: MetricsLogger, profiler: StepProfiler) -> tuple[bool, bool]:
        """One pass of the loop: the training step, the stability guard's after-step, metrics, the held-out
        evaluation when due, the stop flag and the checkpoint when due. Returns (saved a checkpoint, stop)."""
        self.op.step = self.step + 1
        faults.inject("step_start", self.step + 1, self.rank)
        with profiler.step(self.step + 1):
            record, loads = self.train_step()
        rollback = self.module.guard.after_step(self.step, self.tokens_seen, record)
        if rollback is not None:  # train.spike.action=rollback: continue from the snapshot's step
            self.step, self.tokens_seen = rollback.step, rollback.tokens_seen
            metrics.event(rollback.event, wandb_step=rollback.wandb_step)
            return False, False
        if record["spike"] is None and not math.isfinite(record["loss"]):
            raise FloatingPointError(f"loss is {record['loss']} at step {self.step}; stopping (the last "
                                     f"checkpoint is intact; train.spike.action=skip or rollback survives this)")
        metrics.log(self.step, record, loads, wandb_step=self.step + self.module.guard.rolled_back_steps)
        if self.evaluator is not None and self.evaluator.due(self.step, self.schedule.total_steps):
            self.op.name = "the held-out evaluation"
            metrics.eval(self.evaluator.run(self.step), wandb_step=self.step + self.module.guard.rolled_back_steps)
        self.op.step = self.step  # the stop flag and the checkpoint belong to the step just done
        faults.inject("after_step", self.step, self.rank)
        self.op.name = "the stop-flag all-reduce"
        stop = any_rank(self._stop, self.device)  # every rank stops (and saves) together
        self._stop = stop or self._stop  # (the rank that got the signal may be another: the flag is all-reduced)
        # the next stage of the recipe (train/recipe.py): save here, end this stage's run (the launcher goes on)
        self.crossed = self.next_stage_tokens is not None and self.tokens_seen >= self.next_stage_tokens
        saved = self.step % self.cfg.train.checkpoint.interval == 0 or self.step == self.max_steps or stop or \
            self.crossed
        if saved:
            self.op.name = f"saving checkpoint step_{self.step:08d}"
            self.save()
        if stop and self.is_main:
            log.info(f"SIGTERM: saved step {self.step}, exiting")
        elif self.crossed and self.is_main:
            log.info(f"recipe stage {stage_name(self.raw_cfg, self.stage + 1)!r} from {self.next_stage_tokens:g} "
                     f"tokens: saved step {self.step} ({self.tokens_seen:,} tokens); it goes on in that stage's layout")
        return saved, stop or self.crossed
