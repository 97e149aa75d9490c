"""Cost-aware pipeline partitioning (DESIGN.md "Parallelism"): split the model into contiguous stages
minimising the largest per-stage memory, and report memory and compute per stage.

Units, in order: `embed` (token embedding + vision tower + aligner + image vectors: the first stage),
blocks 0..L-1 (Engram modules inside blocks 1 and 14), `head` (final norm + LM head: the last stage).
The embedding/vision unit is merged into block 0 and the head into the last block, so the first and last
stages always carry them.

Cost model (an estimate, documented here; the pipeline issue's measurements refine it):
- state bytes of a parameter = `bytes_per_value` x (parameter + gradient + optimizer state), where the
  optimizer (from the V4.1 routing, train/optim/routing.py rules) keeps 1 buffer for Muon and Sinkhorn,
  2 for AdamW;
- activation bytes of a block per micro-batch = tokens x `activation_bytes` x (the 4 residual streams
  in and out, the sublayer inputs/outputs, queries and attention output, the activated experts'
  intermediate values, plus the compressor / indexer values of Full and Reindex layers), times the
  micro-batches a stage holds in flight (`in_flight_microbatches`, from the schedule's warm-up);
- compute per token of a block = 2 x its activated parameters + attention (4 x heads x head_dim x
  (window + selected compressed entries)) + indexer scoring (Full / Reindex: 2 x index heads x index
  head_dim x visible compressed entries, on average seq_len / (2 m)).
The objective is the maximum per-stage memory (state + activations); compute is reported beside it.
Works on the meta device (shapes only).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from model.config import ConfigError, ModelConfig
from model.layer_plan import Role


@dataclass
class PartitionCosts:
    bytes_per_value: int = 4  # fp32 master weights, gradients and optimizer state
    activation_bytes: int = 2  # bf16 activations


def unit_costs(model: nn.Module, cfg: ModelConfig, optimizer_of: dict[str, str], seq_len: int,
               micro_batch: int, costs: PartitionCosts) -> list[dict]:
    """Per block: state bytes, activation bytes (one micro-batch) and forward FLOPs per token, with the
    embedding/vision unit folded into block 0 and the head into the last block."""
    n_state = {"muon": 1, "sinkhorn": 1, "adamw": 2}
    units = []
    per_expert = sum(p.numel() for p in model.layers[0].ffn.experts.parameters()) // cfg.n_routed_experts
    tokens = seq_len * micro_batch

    def state_bytes(prefix: str, module: nn.Module) -> int:
        return sum(p.numel() * costs.bytes_per_value * (2 + n_state[optimizer_of[f"{prefix}{n}"]])
                   for n, p in module.named_parameters())

    for role, block in zip(model.plan, model.layers):
        params = sum(p.numel() for p in block.parameters())
        engram = 0 if block.engram is None else block.engram.embed.weight.numel()
        routed = sum(p.numel() for p in block.ffn.experts.parameters())
        activated = params - engram - routed + cfg.n_activated_experts * per_expert
        selected = cfg.index_topk if role.compress_ratio else 0
        flops = 2 * activated + 4 * cfg.n_heads * cfg.head_dim * (cfg.window_size + selected)
        act = ((2 * cfg.hc_mult + 4) * cfg.dim + 2 * cfg.n_heads * cfg.head_dim
               + 3 * cfg.moe_inter_dim * (cfg.n_activated_experts + cfg.n_shared_experts))
        if role.has_indexer:
            visible = seq_len / (2 * role.compress_ratio)
            flops += 2 * cfg.index_n_heads * cfg.index_head_dim * visible
            act += cfg.index_n_heads * cfg.index_head_dim + cfg.index_topk
        if role.role is Role.FULL:
            act += 2 * cfg.head_dim
        units.append({"name": f"layers.{role.id}", "state_bytes": state_bytes(f"layers.{role.id}.", block),
                      "activation_bytes": tokens * costs.activation_bytes * act, "flops_per_token": flops})
    first, last = units[0], units[-1]
    for n, p in model.named_parameters():
        if not n.startswith("layers."):
            unit = last if n.startswith(("head.", "norm.")) else first
            unit["state_bytes"] += p.numel() * costs.bytes_per_value * (2 + n_state[optimizer_of[n]])
            if n == "head.weight":
                unit["flops_per_token"] += 2 * p.numel()
    return units


def bounds_from_counts(counts: list[int]) -> list[tuple[int, int]]:
    """Layer counts per stage -> contiguous [start, end) ranges."""
    bounds, at = [], 0
    for k in counts:
        bounds.append((at, at + k))
        at += k
    return bounds


def in_flight_microbatches(pp: int, schedule: str = "1f1b") -> list[int]:
    """Micro-batches whose activations each stage holds at its peak, from the warm-up of the
    torch.distributed.pipelining schedules (an estimate for the partitioner):
    - 1F1B: stage s of P holds P - s;
    - interleaved 1F1B (2 looped stages per rank, rank r = s mod P): the rank runs P + 2 (P - 1 - r)
      forwards before its first backward, shared by its two stages;
    - ZBV / DualPipeV (rank r holds stage r and 2P - 1 - r): 2P - 1 - r forwards of its first stage and
      P of its second before the first backward."""
    if schedule == "1f1b":
        return [pp - s for s in range(pp)]
    if schedule == "interleaved_1f1b":
        return [-(-(pp + 2 * (pp - 1 - s % pp)) // 2) for s in range(2 * pp)]
    return [2 * pp - 1 - s if s < pp else pp for s in range(2 * pp)]


def _stage_cost(units: list[dict], a: int, b: int, in_flight: int) -> float:
    return sum(u["state_bytes"] + in_flight * u["activation_bytes"] for u in units[a:b])


def partition(units: list[dict], pp: int, stage_layers: list[int] | None = None,
              in_flight: list[int] | None = None) -> list[tuple[int, int]]:
    """Contiguous [start, end) unit ranges for `pp` stages (virtual stages included) minimising the
    maximum stage cost (exact DP), or the ranges given by `stage_layers` (layer counts per stage).
    `in_flight`: micro-batches in flight per stage (default: 1F1B's)."""
    n = len(units)
    in_flight = in_flight or in_flight_microbatches(pp)
    if not 1 <= pp <= n:
        raise ConfigError(f"parallel.pp={pp}: a stage needs at least one of the {n} blocks")
    if stage_layers is not None:
        if len(stage_layers) != pp or sum(stage_layers) != n or min(stage_layers) < 1:
            raise ConfigError(f"parallel.stage_layers={stage_layers}: needs {pp} positive counts summing to {n}")
        return bounds_from_counts(stage_layers)
    INF = float("inf")
    best = [[INF] * (n + 1) for _ in range(pp + 1)]  # best[s][j]: first j units in s stages
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for j in range(s, n - (pp - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == INF:
                    continue
                c = max(best[s - 1][i], _stage_cost(units, i, j, in_flight[s - 1]))
                if c < best[s][j]:
                    best[s][j], cut[s][j] = c, i
    bounds, j = [], n
    for s in range(pp, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    return bounds[::-1]


def partition_report(units: list[dict], bounds: list[tuple[int, int]], in_flight: list[int] | None = None) -> dict:
    pp = len(bounds)
    in_flight = in_flight or in_flight_microbatches(pp)
    stages = []
    for s, (a, b) in enumerate(bounds):
        stages.append({"stage": s, "layers": [a, b - 1], "n_layers": b - a,
                       "state_bytes": sum(u["state_bytes"] for u in units[a:b]),
                       "in_flight": in_flight[s],
                       "activation_bytes": in_flight[s] * sum(u["activation_bytes"] for u in units[a:b]),
                       "bytes": _stage_cost(units, a, b, in_flight[s]),
                       "flops_per_token": sum(u["flops_per_token"] for u in units[a:b])})

    def imbalance(key):
        vals = [st[key] for st in stages]
        return max(vals) / (sum(vals) / len(vals))

    return {"pp": pp, "stages": stages, "imbalance_bytes": imbalance("bytes"),
            "imbalance_compute": imbalance("flops_per_token")}
