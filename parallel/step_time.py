"""A step-time estimate of a process layout, for ranking layouts against each other (the layout search,
train/plan/layouts.py; docs/parallelism.md "Choosing a layout"). Analytic, from the partitioner's per-block
costs (parallel/partition.py `unit_costs`) and stated hardware assumptions (`Hardware`, the `plan`
config group); a relative figure, not a measurement.

Per micro-batch, on each pipeline rank (the ranks of one pipeline position are alike):
- compute: (3 F + R) / `gpu_flops`, F the forward FLOPs of the rank's blocks (`flops_per_token`) for the
  micro-batch's b x S / cp tokens (forward 1 F, backward 2 F), R what the backward runs again under
  `train.recompute` (full: F; selective: the attention core and indexer, `attention_flops_per_token`;
  none: 0);
- exposed communication, bytes over the bandwidth of the group (`intra_node_gb_s` when the group's
  ranks share a node, `inter_node_gb_s` otherwise; the mesh puts cp and ep groups on consecutive ranks,
  parallel/mesh.py):
  - expert all-to-all, per block: dispatch and combine, 2 x tokens x n_activated_experts x dim x
    `ACT_BYTES`, the (ep - 1) / ep share that leaves the rank, in the forward, the backward and a fully
    recomputed forward (selective recomputation replays the kept all-to-all outputs);
  - context parallelism, per Full layer: the whole sequence's compressed KV and index-K gathered,
    S / m x (head_dim + index_head_dim) x `ACT_BYTES` x (cp - 1) / cp, and reduce-scattered back in the
    backward (again in a fully recomputed forward);
  - pipeline: each stage's output carry sent on and its gradient sent back (2 x the boundary bytes);
  not counted: the data-parallel gradient reduction (bucketed and overlapped with the backward,
  parallel/grad_reduce.py), the window halo, overlap of communication with compute, and kernel
  efficiency (a larger micro-batch or a shorter sequence per rank is not faster per token here).
The step: (M + bubble) x the slowest rank's micro-batch time, M the micro-batches of a pipeline round.
The bubble, in micro-batch times, from the DualPipe table (github.com/deepseek-ai/DualPipe: 1F1B
(PP-1)(F+B), ZB1P (PP-1)(F+B-2W), DualPipe (PP/2-1)(F&B+B-3W)), with f, b, w the forward, input-gradient
(recomputation included) and weight-gradient shares of a rank's micro-batch (f + b + w = 1), chunk times
half of those where a rank holds two stages, and F&B = F + B (no overlap credited):
  1f1b              pp - 1
  interleaved_1f1b  (pp - 1) / 2
  zbv               (pp - 1) (f + b - w) / 2
  dualpipev         (pp / 2 - 1) (f + 2 b - w) / 2
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtrain.model.config import ModelConfig
from flashtrain.model.layer_plan import Role
from flashtrain.parallel.dims import ParallelDims

ACT_BYTES = 2  # bf16: the activations an all-to-all or gather carries on a GPU


@dataclass
class Hardware:
    """What the estimate assumes of a GPU and its links (the `plan` group, conf/plan/default.yaml)."""

    gpu_tflops: float = 400.0  # achieved bf16 TFLOP/s per GPU
    gpus_per_node: int = 8
    intra_node_gb_s: float = 400.0  # GB/s per GPU inside a node (NVLink)
    inter_node_gb_s: float = 50.0  # GB/s per GPU between nodes (400 Gb/s InfiniBand)

    def bandwidth(self, span: int) -> float:
        """Bytes/s of a group whose ranks span `span` consecutive ranks."""
        gb_s = self.intra_node_gb_s if span <= self.gpus_per_node else self.inter_node_gb_s
        return gb_s * 1e9


def bubble_microbatches(schedule: str, pp: int, f: float, b: float, w: float) -> float:
    """Idle time of a pipeline round in micro-batch times (module docstring); 0 without a pipeline."""
    if pp == 1:
        return 0.0
    if schedule == "1f1b":
        return float(pp - 1)
    if schedule == "interleaved_1f1b":
        return (pp - 1) / 2
    if schedule == "zbv":
        return max(0.0, (pp - 1) * (f + b - w) / 2)
    if schedule == "dualpipev":
        return max(0.0, (pp / 2 - 1) * (f + 2 * b - w) / 2)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


@dataclass
class StepTime:
    step_s: float
    compute_s: float  # the slowest rank's compute per micro-batch
    comm_s: float  # its exposed communication per micro-batch
    bubble: float  # idle fraction of the step
    microbatch_s: float  # the slowest rank's micro-batch time


def step_time(cfg: ModelConfig, units: list[dict], bounds: list[tuple[int, int]], stages_of_rank: list[list[int]],
              schedule: str, dims: ParallelDims, *, micro_batch: int, seq_len: int, microbatches: int, recompute: str,
              hw: Hardware) -> StepTime:
    """The estimate of the module docstring for one layout: `dims` its degrees (`ParallelDims.plan`, no groups),
    `units` its per-block costs, `bounds` the stages' [start, end) blocks, `microbatches` per pipeline round
    (one round per step)."""
    world, pp, cp, ep = dims.world, dims.pp, dims.cp, dims.ep
    from flashtrain.model.layer_plan import layer_plan

    plan = layer_plan(cfg)
    tokens = micro_batch * -(-seq_len // cp)
    flops = hw.gpu_tflops * 1e12
    ep_bw, cp_bw, pp_bw = hw.bandwidth(ep), hw.bandwidth(cp), hw.bandwidth(world)
    ep_passes = 3 if recompute == "full" else 2
    cp_passes = 3 if recompute == "full" else 2
    worst, worst_parts = -1.0, (0.0, 0.0, 0.0, 0.0)
    for stages in stages_of_rank:
        fwd = rec = comm = 0.0
        for s in stages:
            a, z = bounds[s]
            for i in range(a, z):
                u = units[i]
                fwd += u["flops_per_token"] * tokens
                if recompute == "full":
                    rec += u["flops_per_token"] * tokens
                elif recompute == "selective":
                    rec += u.get("attention_flops_per_token", 0) * tokens
                comm += ep_passes * 2 * tokens * cfg.n_activated_experts * cfg.dim * ACT_BYTES * (ep - 1) / ep / ep_bw
                role = plan[i]
                if cp > 1 and role.role is Role.FULL:
                    entries = seq_len // role.compress_ratio * micro_batch
                    gathered = entries * (cfg.head_dim + cfg.index_head_dim) * ACT_BYTES * (cp - 1) / cp
                    comm += cp_passes * gathered / cp_bw
            if z < len(units):  # the carry on to the next stage and its gradient back
                comm += 2 * units[z].get("carry_bytes", 0) / pp_bw
        compute = (3 * fwd + rec) / flops
        total = compute + comm
        if total > worst:
            worst, worst_parts = total, (compute, comm, fwd, rec)
    compute, comm, fwd, rec = worst_parts
    work = 3 * fwd + rec
    f, b, w = (fwd / work, (fwd + rec) / work, fwd / work) if work else (1 / 3, 1 / 3, 1 / 3)
    bubble = bubble_microbatches(schedule, pp, f, b, w)
    step = (microbatches + bubble) * worst
    return StepTime(step_s=step, compute_s=compute, comm_s=comm, bubble=bubble / (microbatches + bubble),
                    microbatch_s=worst)
