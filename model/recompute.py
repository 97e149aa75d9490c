"""Activation recomputation per block (`train.recompute`; DESIGN.md "Memory").

- `none`:      autograd keeps every tensor the block's backward needs.
- `full`:      only the block's input carry is kept; the whole block runs again in backward
               (torch's non-reentrant activation checkpoint). Under expert parallelism that re-runs the
               dispatch all-to-alls too, in the same order on every rank of the EP group.
- `selective`: the outputs of the large matmuls (`aten.mm` / `addmm` / `_grouped_mm` / the FP8 GEMM op: every
               projection, gate and expert matmul) and of the collectives (the expert all-to-alls) are kept;
               everything else -- norms, the context-parallel exchanges (eager collectives, parallel/context.py:
               they run again), activations, RoPE, mHC mixes, the indexer's selection and the sparse-attention
               core, whose score blocks are batched matmuls -- is recomputed in backward. The kept collective
               outputs are replayed from the cache, so the recomputation sends nothing (torch's selective
               activation checkpoint, as torchtitan's `_save_list` / Megatron's `recompute_modules`).

The block mutates the carry's `SharedKV` in place (a Full layer publishes its KV, a Reindex layer its
top-k), so the checkpointed function takes the carry as explicit tensors (`Carry.tensors`, in the order
of model/carry.py's table) and builds a fresh carry from them: the recomputation sees the block's
original inputs, never what the forward wrote afterwards.

The aux side channel (`StepStats`) is filled by the first run only; a recomputation writes into a
throwaway one, so loads and aux values are counted once (their gradients ride on the original graph).
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from flashtrain.config.errors import ConfigError
from flashtrain.model.aux import StepStats
from flashtrain.model.carry import Carry
from flashtrain.model.fp8_linear import fp8_block_gemm

RECOMPUTE_MODES = ("none", "selective", "full")


@functools.cache
def _saved_ops() -> frozenset:
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    ops = {aten.mm.default, aten.addmm.default, c10d.all_to_all_single.default, c10d.wait_tensor.default,
           c10d._wrap_tensor_autograd.default}
    for name in ("_scaled_mm", "_grouped_mm"):  # fp8 GEMMs; the routed experts' grouped GEMM (model/moe.py)
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    ops.add(fp8_block_gemm._opoverload)  # the FP8 Linears' GEMMs (model/fp8_linear.py, model.fp8.enabled)
    return frozenset(ops)


def _selective_policy(saved: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    return create_selective_checkpoint_contexts(partial(_selective_policy, _saved_ops()))


def validate_recompute(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"train.recompute={mode!r}: must be one of {', '.join(RECOMPUTE_MODES)}")


def recompute_block(fn: Callable, carry: Carry, ctx, mode: str) -> Carry:
    """`fn(carry, ctx) -> carry` under activation checkpointing of `mode` ('full' or 'selective')."""
    first = [True]

    def run(*tensors):  # the carry's fields in CARRY_FIELDS order (model/carry.py)
        run_ctx = ctx if first[0] else dataclasses.replace(ctx, stats=StepStats())
        first[0] = False
        return fn(Carry.from_tensors(tensors), run_ctx).tensors()

    # The checkpoint keeps its inputs as fresh views, and a field the block passes through unchanged comes
    # back as the original tensor: a zero-bubble pipeline detaches a stage's outputs in place after the
    # input backward, and such an output (e.g. a passed-on KV) may be a checkpointed block's input too.
    originals = carry.tensors()
    inputs = [t.view_as(t) if t is not None and t.requires_grad else t for t in originals]
    kwargs = {"context_fn": selective_context} if mode == "selective" else {}
    outs = checkpoint(run, *inputs, use_reentrant=False, **kwargs)
    passed = {id(v): t for v, t in zip(inputs, originals) if v is not None}
    return Carry.from_tensors(passed.get(id(o), o) for o in outs)
