"""Per-rank model construction (DESIGN.md "Construction at scale").

The model is built as a shape-only template on the meta device, pruned to the rank's pipeline stages
and sharded to its experts there, and only then materialised on the target device and initialised
(`Transformer.materialize`: buffers recomputed, each parameter block drawn from a generator seeded by
the run seed and its global name and row, model/init.py). No rank allocates a parameter it does not
own, and every layout starts from the weights one process building the whole model would have.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from flashtrain.model import Transformer
from flashtrain.model.config import ModelConfig
from flashtrain.parallel.engram_shard import shard_engram_tables
from flashtrain.parallel.experts import shard_experts
from flashtrain.parallel.pipeline import StageRange, prune_to_stages

if TYPE_CHECKING:
    from flashtrain.parallel.dims import ParallelDims


def model_template(cfg: ModelConfig, token_map: list[int] | None = None) -> Transformer:
    """The whole model on the meta device: shapes, names and roles, no storage."""
    with torch.device("meta"):
        return Transformer(cfg, token_map=token_map, init=False)


def build_rank_model(template: Transformer, device: torch.device | str, seed: int,
                     stages: list[StageRange] | None = None, dims: ParallelDims | None = None,
                     tensor_mode=None) -> Transformer:
    """Prune `template` (in place) to `stages`, to this rank's expert shard of `dims.ep` and, when
    `dims.engram_shard`, to its row block of every Engram table over the dp x cp ranks; then materialise
    what is left on `device` with the run `seed` -- under `tensor_mode` when given (the memory
    estimator's FakeTensorMode: the pruning stays on plain meta tensors, the materialised ones are fake).
    No `dims`: one process, nothing sharded."""
    if stages is not None:
        prune_to_stages(template, stages)
    if dims is not None and dims.ep > 1:
        shard_experts(template, dims.ep, dims.ep_rank, dims.ep_group)
    if dims is not None and dims.engram_shard and dims.dp_cp_group is not None:
        shard_engram_tables(template, dims.dp_cp, dims.dp_cp_rank, dims.dp_cp_group)
    with tensor_mode or contextlib.nullcontext():
        return template.materialize(device, seed)
