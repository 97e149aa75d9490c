"""The pipeline partition of a run, from its configs (DESIGN.md "Parallelism": the partitioner): one
function for the trainer and `launch/plan.py`, so the stages a run builds are the ones the planner shows.

Per-block costs (parallel/partition.py) need each parameter's optimizer (its state size) and the
run's sharing of state: experts over ep, ZeRO-1 optimizer state over its replicas, row-sharded Engram
tables over dp. The partition is the cost-balanced one, or `parallel.stage_layers` when pinned.
"""

from __future__ import annotations

from torch import nn

from flashtrain.model.config import ModelConfig
from flashtrain.parallel.config import ParallelConfig
from flashtrain.parallel.partition import (
    PartitionCosts,
    in_flight_microbatches,
    in_flight_states,
    partition,
    unit_costs,
)
from flashtrain.parallel.pipeline import stage_ids
from flashtrain.train.optim.config import OptimConfig
from flashtrain.train.optim.routing import route_parameters, state_buffers


def stage_units(model: nn.Module, model_cfg: ModelConfig, optim_cfg: OptimConfig, parallel: ParallelConfig,
                seq_len: int, micro_batch: int, recompute: str, mixed_precision: bool, dp: int,
                cp: int = 1, round_microbatches: int = 0) -> list[dict]:
    """The partitioner's per-block costs for this run (`model` may live on the meta device). `dp`: the
    ranks holding the same parameters (dp x cp); under context parallelism a rank's activations are those
    of its seq_len / cp positions, plus the whole sequence's compressed entries and the indexer's scores
    against them (parallel/partition.py `block_activations`). `round_microbatches`: a pipeline round's
    micro-batches (their inputs stay on the device for the round; 0 without a pipeline)."""
    costs = partition_costs(model_cfg, optim_cfg, parallel, recompute, mixed_precision, dp, round_microbatches)
    return unit_costs(model, model_cfg, optimizer_state_of(model, model_cfg, optim_cfg), seq_len, micro_batch, costs,
                      -(-seq_len // cp))


def optimizer_state_of(model: nn.Module, model_cfg: ModelConfig, optim_cfg: OptimConfig) -> dict[str, int]:
    """Each parameter's optimizer state in values per parameter value, by the V4.1 routing (train/optim)."""
    return state_buffers(route_parameters(model, model_cfg, optim_cfg))


def partition_costs(model_cfg: ModelConfig, optim_cfg: OptimConfig, parallel: ParallelConfig, recompute: str,
                    mixed_precision: bool, dp: int, round_microbatches: int = 0) -> PartitionCosts:
    """How a run shares its state (`dp`: the ranks holding the same parameters, dp x cp) and what it keeps
    for backward: the cost model's settings, for the trainer's partition and the layout search
    (train/plan/layouts.py) alike."""
    return PartitionCosts(recompute=recompute, mixed_precision=mixed_precision, ep=parallel.ep, dp=dp,
                          zero=optim_cfg.zero, engram_shard=parallel.shard_engram(model_cfg, dp),
                          round_microbatches=round_microbatches if parallel.pp > 1 else 0,
                          kv_segments=2 if parallel.cp > 1 and parallel.cp_balance == "zigzag" else 1)


def plan_stages(units: list[dict], parallel: ParallelConfig, microbatches: int | None = None) -> list[tuple[int, int]]:
    """[start, end) blocks of the parallel.n_stages stages; `microbatches`: per pipeline round (what sets the
    micro-batches in flight of interleaved 1F1B; default 2 pp)."""
    budget = None if parallel.gpu_memory_gb is None else parallel.gpu_memory_gb * 1e9
    schedule = parallel.pipeline_schedule
    return partition(units, parallel.n_stages, parallel.stage_layers,
                     in_flight_microbatches(parallel.pp, schedule, microbatches), parallel.partition_memory_slack,
                     budget, [stage_ids(parallel, r) for r in range(parallel.pp)],
                     in_flight_states(parallel.pp, schedule, microbatches))
