"""Per-rank model construction (DESIGN.md "Construction at scale").

The model is built as a shape-only template on the meta device, pruned to the rank's pipeline stages
and sharded to its experts there, and only then materialised on the target device and initialised
(`Transformer.materialize`: buffers recomputed, each parameter block drawn from a generator seeded by
the run seed and its global name and row, model/init.py). No rank allocates a parameter it does not
own, and every layout starts from the weights one process building the whole model would have.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from flashtrain.model import Transformer
from flashtrain.model.config import ModelConfig
from flashtrain.parallel.engram_shard import shard_engram_tables
from flashtrain.parallel.experts import shard_experts
from flashtrain.parallel.pipeline import StageRange, prune_to_stages


def model_template(cfg: ModelConfig, token_map: list[int] | None = None) -> Transformer:
    """The whole model on the meta device: shapes, names and roles, no storage."""
    with torch.device("meta"):
        return Transformer(cfg, token_map=token_map, init=False)


def build_rank_model(template: Transformer, device: torch.device | str, seed: int,
                     stages: list[StageRange] | None = None, ep: int = 1, ep_rank: int = 0,
                     ep_group: dist.ProcessGroup | None = None, tensor_mode=None,
                     engram_group: dist.ProcessGroup | None = None, dp_rank: int = 0, dp: int = 1) -> Transformer:
    """Prune `template` (in place) to `stages`, to expert shard `ep_rank` of `ep` and, with an
    `engram_group`, to row block `dp_rank` of `dp` of every Engram table; then materialise
    what is left on `device` with the run `seed` -- under `tensor_mode` when given (the memory
    estimator's FakeTensorMode: the pruning stays on plain meta tensors, the materialised ones are fake)."""
    if stages is not None:
        prune_to_stages(template, stages)
    if ep > 1:
        shard_experts(template, ep, ep_rank, ep_group)
    if engram_group is not None:
        shard_engram_tables(template, dp, dp_rank, engram_group)
    with tensor_mode or contextlib.nullcontext():
        return template.materialize(device, seed)
