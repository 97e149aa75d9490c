"""The language-model head and cross-entropy, tiled over the sequence (DESIGN.md "Memory").

`[tokens, vocab]` logits are never materialised: DeepSpeed's Arctic Long Sequence Training
`TiledFusedLogitsLoss` runs head + cross-entropy on one tile of `train.loss_tile_tokens` positions at a
time and back-propagates each tile right away (the head weight's gradient accumulates then, the
hidden states' gradient is kept for the autograd backward), so the largest temporary is one tile's
logits: 2048 x 129,280 fp32 = 1 GiB for exp=flash, against 31.6 GiB for a 64K sequence.

The loss is `scale` x the mean cross-entropy over the label positions (IGNORE positions excluded),
summed over tiles -- the same value as `F.cross_entropy(head(x), labels, ignore_index=IGNORE)`. The
scale (1 / gradient-accumulation steps) is applied inside each tile, because the tiles' head-weight
gradients are accumulated before the caller's backward: the caller must back-propagate the returned
loss with gradient 1 (`loss.backward()`; a pipeline schedule does).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from flashtrain.data.loader import IGNORE
from flashtrain.model.simulation import simulated

os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss  # noqa: E402


class _TiledLogitsLoss(TiledFusedLogitsLoss):
    """DeepSpeed's tiled forward; the backward scales the kept hidden-state gradient by the incoming
    gradient in place as a tensor op, where DeepSpeed's first compares it with 1.0 on the host -- a
    sync per micro-batch, and a question fake tensors (the memory estimator) cannot answer."""

    @staticmethod
    def backward(ctx, *grads):
        (x_grad,) = ctx.saved_tensors
        return (None, None, x_grad.mul_(grads[0]), None, None, None, None, None, None)


def tile_cross_entropy(head: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The head and the summed cross-entropy of one tile (x [T, D], y [T]; IGNORE positions add 0)."""
    return F.cross_entropy(head(x).float(), y, ignore_index=IGNORE, reduction="sum")


def tile_cross_entropies(head: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The head and each position's cross-entropy of one tile [T] (0 at IGNORE positions)."""
    return F.cross_entropy(head(x).float(), y, ignore_index=IGNORE, reduction="none")


# what a loss tile runs; train.compile (train/compile.py) replaces them by their compiled versions
_TILE = {"sum": tile_cross_entropy, "each": tile_cross_entropies}


_COMPILED: dict = {}  # the compiled tile functions, made once (a new wrapper each time would recompile)


def compile_tile(on: bool = True, backend: str = "inductor") -> None:
    """torch.compile the loss tile's head + cross-entropy (train/compile.py `apply_compile`) with `backend`;
    on=False: back to eager."""
    if on and _COMPILED.get("backend") != backend:
        _COMPILED.update(sum=torch.compile(tile_cross_entropy, backend=backend),
                         each=torch.compile(tile_cross_entropies, backend=backend), backend=backend)
    _TILE.update({"sum": _COMPILED["sum"], "each": _COMPILED["each"]} if on else
                 {"sum": tile_cross_entropy, "each": tile_cross_entropies})


def tiled_lm_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, tile_tokens: int,
                  scale: float = 1.0, split=None, sources: torch.Tensor | None = None,
                  source_ce: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [B, S, D] (after the final norm), labels [B, S] -> scale x mean CE over label positions.

    Context parallelism (`split`, model/sequence_split.py): hidden holds this rank's positions, labels
    the whole sequences; the loss is this rank's positions' CE sum over the whole batch's label count,
    so the ranks' losses add up to the mean.

    `sources` [B, S] (the data source of each label, data/loader.py `label_sources`) with `source_ce`
    (float64 [n_sources], on the device): each source's CE sum (unscaled, no gradient) is added to
    `source_ce` as the tiles run -- the per-source training loss, without a host read."""
    if split is not None:
        labels = split.local(labels)
        sources = None if sources is None else split.local(sources)
    # fake labels (the memory estimator, train/plan/estimate.py) have no values: every position counts. The label
    # count stays on the device (a 0-dim tensor): reading it on the host would be a sync per micro-batch
    if split is not None:
        n_valid = split.seq_len * labels.shape[0] if simulated(labels) else split.sum(
            (labels != IGNORE).sum()).clamp_min(1)
    else:
        n_valid = labels.numel() if simulated(labels) else (labels != IGNORE).sum().clamp_min(1)
    factor = scale / n_valid
    tiles = max(1, math.ceil(labels.numel() / tile_tokens))

    def tile_loss(head: nn.Linear, x: torch.Tensor, y: torch.Tensor, src: torch.Tensor | None = None) -> torch.Tensor:
        if src is None:
            return _TILE["sum"](head, x, y) * factor
        ce = _TILE["each"](head, x, y)  # 0 at IGNORE
        source_ce.index_add_(0, src, ce.detach().to(source_ce.dtype))
        return ce.sum() * factor

    if sources is None or source_ce is None:
        return _TiledLogitsLoss.apply(tile_loss, head, hidden, labels, None, tiles, [], "sum")
    return _TiledLogitsLoss.apply(tile_loss, head, hidden, labels, sources, tiles, [], "sum")


class Tile(NamedTuple):
    """What a held-out score is computed from, per position of a tile: the CE (0 at an unscored label), the
    logits, the targets (IGNORE: unscored) and whether the target stands for at least one byte."""
    ce: torch.Tensor
    logits: torch.Tensor
    targets: torch.Tensor
    has_bytes: torch.Tensor


class HeldOutScore(NamedTuple):
    """A held-out metric (train/evaluation/heldout.py): its per-position value of a `Tile`, summed over the set
    per source, and what the sum is divided by -- `token`: the scored positions; `bits_per_byte`: ln 2 x the
    UTF-8 bytes of the targets (a sum of nats over those with bytes becomes bits per byte)."""
    name: str
    value: Callable[[Tile], torch.Tensor]
    per: str


# the held-out record's scores, one entry each (a new held-out metric is a line here and its test)
HELDOUT_SCORES = (
    HeldOutScore("loss", lambda t: t.ce, "token"),  # nats per scored position
    HeldOutScore("bpb", lambda t: t.ce * t.has_bytes, "bits_per_byte"),  # special tokens stand for no bytes
)


def heldout_sums(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, token_bytes: torch.Tensor,
                 tile_tokens: int, split=None) -> torch.Tensor:
    """The held-out scores of a micro-batch (train/evaluation/heldout.py), no gradient: float64
    [len(HELDOUT_SCORES)], each score's values summed over its label positions. Head + cross-entropy in tiles of
    `tile_tokens` positions, as `tiled_lm_loss`. Context parallelism (`split`): this rank's positions only, so
    the ranks' sums add up to the whole sequences'."""
    if split is not None:
        labels = split.local(labels)
    x, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    out = torch.zeros(len(HELDOUT_SCORES), dtype=torch.float64, device=hidden.device)
    with torch.no_grad():
        for t0 in range(0, y.numel(), tile_tokens):
            yt = y[t0:t0 + tile_tokens]
            logits = head(x[t0:t0 + tile_tokens]).float()
            ce = F.cross_entropy(logits, yt, ignore_index=IGNORE, reduction="none").double()
            tile = Tile(ce, logits, yt, token_bytes[yt.clamp(min=0)] > 0)
            for i, score in enumerate(HELDOUT_SCORES):
                out[i] += score.value(tile).sum()
    return out
