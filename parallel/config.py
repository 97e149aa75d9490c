"""Parallel layout config (DESIGN.md "Parallelism"), filled from Hydra's `parallel` group.

- `world`: the number of processes the layout is for; null = any. Set (an exp for a cluster), the trainer
  refuses another world size and launch/plan.py / launch/estimate.py take it as their default --world.
- `pp`: pipeline degree; `dp` = world size / (pp x cp) is derived, never configured.
- `pipeline_schedule`: `1f1b` | `interleaved_1f1b` | `zbv` | `dualpipev` (torch.distributed.pipelining schedules;
  the last three hold two stages per rank: looped for interleaved 1F1B, V-shaped for ZBV and DualPipeV).
- `microbatches`: micro-batches per pipeline round; null = every micro-batch of the optimizer step in
  one round (the gradient-accumulation count). It must divide that count and meet the schedule's rule.
- `schedule`: the former name of `pipeline_schedule` ("schedule" alone means the LR schedule); still read,
  with a deprecation message, for one release.
- `timeout_s`: the process-group timeout (collectives that wait longer fail instead of hanging).
- `peer_timeout_s`: a rank whose heartbeat has not moved for this long is gone (its process or node died):
  the job ends, naming it (parallel/liveness.py), without waiting for `timeout_s`.
- `stage_layers`: layer counts per stage (pp x stages per rank entries) to pin the partition by hand.
- `partition_memory_slack`: the cost-balanced partition first minimises the largest stage's memory M, then
  the slowest stage's compute among splits whose stages all stay within M x (1 + slack)
  (parallel/partition.py); 0 = never trade memory for speed.
- `gpu_memory_gb`: a memory budget per rank (GB = 1e9 bytes) for the partitioner's cost model (which
  tests/test_partition.py checks block by block against the estimator): set, the partition minimises
  the slowest stage's (or, with two stages per rank, rank's) compute among the splits that fit it;
  null = memory first (above).
- `ep`: expert parallelism: routed experts sharded over ep ranks (it divides dp x cp), parallel/experts.py.
- `cp`: context parallelism: cp ranks share every sequence, each holding its queries' slice
  (model/sequence_split.py, parallel/context.py); dp = world / (pp x cp). `cp_balance`: `zigzag` (2 cp
  chunks, rank r holds r and 2cp - 1 - r: even causal cost) or `contiguous`.
- `engram_shard`: row-shard the Engram tables over the stage's data-parallel ranks (parallel/engram_shard.py);
  null = when one table is larger than `engram_shard_min_gb` (fp32), true / false to force.
- `grad_bucket_mb`: size of the gradient buckets reduced while backward runs (parallel/grad_reduce.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flashtrain.config.errors import ConfigError

log = logging.getLogger(__name__)

# schedule name -> (stages per rank, stage placement style)
SCHEDULES: dict[str, tuple[int, str]] = {
    "1f1b": (1, "loop"),
    "interleaved_1f1b": (2, "loop"),
    "zbv": (2, "v"),
    "dualpipev": (2, "v"),
}


def splits_backward(schedule: str, pp: int) -> bool:
    """Whether the schedule runs a micro-batch's backward in two passes, input gradients then weight gradients
    (torch.distributed.pipelining's zero-bubble split: the V-shaped schedules)."""
    return pp > 1 and SCHEDULES[schedule][1] == "v"


def check_recompute_with_schedule(schedule: str, pp: int, recompute: str) -> None:
    """Selective recomputation (torch's selective checkpointing, model/recompute.py) allows one backward through
    a recomputed region, and a split backward makes two: torch raises in the first weight pass. Refused here,
    before anything is built."""
    if recompute == "selective" and splits_backward(schedule, pp):
        raise ConfigError(f"train.recompute=selective with parallel.pipeline_schedule={schedule}: {schedule} runs each "
                          f"backward in two passes (input, then weight gradients) and selective recomputation "
                          f"allows one; use train.recompute=none or full, or parallel.pipeline_schedule=1f1b or "
                          f"interleaved_1f1b")


@dataclass
class ParallelConfig:
    world: int | None = None
    pp: int = 1
    ep: int = 1
    cp: int = 1
    cp_balance: str = "zigzag"
    pipeline_schedule: str = "1f1b"
    timeout_s: float = 1800.0
    peer_timeout_s: float = 60.0
    microbatches: int | None = None
    stage_layers: list | None = None
    partition_memory_slack: float = 0.0
    gpu_memory_gb: float | None = None
    engram_shard: bool | None = None
    engram_shard_min_gb: float = 4.0
    grad_bucket_mb: float = 25.0

    # parallel.schedule: the former name of pipeline_schedule ("schedule" alone is the LR schedule)
    renamed_fields = {"schedule": "pipeline_schedule"}

    @property
    def stages_per_rank(self) -> int:
        return SCHEDULES[self.pipeline_schedule][0] if self.pp > 1 else 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def validate(self) -> None:
        if self.stage_layers is not None:
            self.stage_layers = [int(k) for k in self.stage_layers]
        if self.pipeline_schedule not in SCHEDULES:
            raise ConfigError(f"parallel.pipeline_schedule={self.pipeline_schedule!r}: unknown; use one of "
                              f"{sorted(SCHEDULES)}")
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s={self.timeout_s}: the process-group timeout in seconds, > 0")
        if not self.peer_timeout_s > 0:
            raise ConfigError(f"parallel.peer_timeout_s={self.peer_timeout_s}: how long a rank's heartbeat may stand "
                              f"still before it counts as gone, in seconds (> 0)")
        if self.pp < 1 or self.ep < 1 or self.cp < 1:
            raise ConfigError(f"parallel.pp={self.pp}, parallel.ep={self.ep}, parallel.cp={self.cp}: "
                              "degrees must be >= 1")
        from flashtrain.model.sequence_split import BALANCE_MODES

        if self.cp_balance not in BALANCE_MODES:
            raise ConfigError(f"parallel.cp_balance={self.cp_balance!r}: use one of {', '.join(BALANCE_MODES)}")
        if self.grad_bucket_mb <= 0 or self.engram_shard_min_gb < 0:
            raise ConfigError(f"parallel.grad_bucket_mb={self.grad_bucket_mb} must be > 0 and "
                              f"parallel.engram_shard_min_gb={self.engram_shard_min_gb} >= 0")
        if self.partition_memory_slack < 0:
            raise ConfigError(f"parallel.partition_memory_slack={self.partition_memory_slack}: must be >= 0 (the "
                              f"fraction of extra stage memory allowed for a faster pipeline; 0 = none)")
        if self.world is not None and self.world < 1:
            raise ConfigError(f"parallel.world={self.world}: the number of processes of the layout (>= 1), or null")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ConfigError(f"parallel.gpu_memory_gb={self.gpu_memory_gb}: a positive per-GPU budget in GB, or null")
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(f"parallel.microbatches={self.microbatches}: must be >= 1 (or null for one round "
                              f"per optimizer step)")

    def shard_engram(self, model_cfg, dp: int) -> bool:
        """Whether the Engram tables are row-sharded over dp (never on one data-parallel rank)."""
        if dp == 1 or not model_cfg.engram_layer_ids:
            return False
        if self.engram_shard is not None:
            return bool(self.engram_shard)
        from flashtrain.model.engram import engram_table_rows

        largest = max(engram_table_rows(model_cfg)) * model_cfg.engram_head_dim * 4
        return largest > self.engram_shard_min_gb * 2 ** 30

    def round_microbatches(self, accumulation: int) -> int:
        """Micro-batches per pipeline round, checked against the step's micro-batch count and the
        schedule's own rule (torch.distributed.pipelining raises late and vaguely; we say what to set)."""
        m = self.microbatches or accumulation
        if accumulation % m:
            raise ConfigError(f"parallel.microbatches={m} does not divide the {accumulation} micro-batches of an "
                              f"optimizer step (global batch / (dp x data.batch_size)); use a divisor of "
                              f"{accumulation}, or null")
        if self.pp == 1:
            return m
        n_stages = self.n_stages
        if self.pipeline_schedule in ("1f1b", "zbv", "dualpipev") and m < n_stages:
            raise ConfigError(f"parallel.pipeline_schedule={self.pipeline_schedule} with {n_stages} stages needs "
                              f"at least {n_stages} micro-batches per round, got parallel.microbatches={m}; raise "
                              f"train.global_batch_tokens or lower data.batch_size so a step has >= {n_stages}")
        if self.pipeline_schedule == "interleaved_1f1b":
            rounds = max(1, m // self.pp)
            if m % rounds:
                raise ConfigError(f"parallel.pipeline_schedule=interleaved_1f1b runs {m} micro-batches per round in "
                                  f"max(1, {m} // pp={self.pp}) = {rounds} rounds, which must divide {m}; use "
                                  f"parallel.microbatches a multiple of {self.pp}")
        return m
