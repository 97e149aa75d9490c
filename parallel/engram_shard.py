"""Row-sharded Engram tables (V41_SPEC §5 "at scale"; DESIGN.md "Parallelism": Engram tables).

Each Engram table (hundreds of millions of rows at `exp=flash`) is split over the data-parallel ranks
of its pipeline stage: rank r holds a contiguous block of rows (`parallel.zero.row_pieces`: sizes
differing by at most one row) as `engram.embed.weight`, with `row_offset` / `global_rows` recorded on
the embedding module (initialisation draws the global rows it holds, model/init.py; checkpoints write
the block at its offset, train/checkpoint.py). A lookup (`ShardedRows`), per Engram layer and micro-batch:
1. the distinct hash ids of the local batch, sorted -- so the ids of each owner are contiguous;
2. per-owner counts exchanged (one all-to-all of dp integers; the split sizes are the one host sync);
3. the ids go to their owners (all-to-all);
4. each owner gathers its rows (autograd to its block), the rows come back (all-to-all with autograd)
   and are expanded to every position.
Hash ids depend only on tokens, so steps 1-3 (`request`) run when the stage's forward starts, before
its first block (model/transformer.py `run_blocks`): the id exchange travels while the blocks before
the Engram layer compute, and a recomputed forward (train.recompute) reuses the request instead of
exchanging ids again; step 4 runs in the layer.
Backward runs the reverse: each row's gradient goes back to its owner, summed over every rank that
looked it up, into the owner's block gradient -- which is therefore already the sum over dp and is
not all-reduced (parallel/grad_reduce.py only divides it by dp). The row-sharded Sinkhorn update then
all-reduces its column statistics over the same group (train/optim/sinkhorn.py).
Fake tensors (the memory estimator) carry no ids: every rank then sends and receives the balanced
share of the lookups, without de-duplication (the worst case).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

from model.engram import Engram
from model.moe import balanced_split
from parallel.zero import row_pieces


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if hasattr(t, "wait") else t  # fake tensors come back as plain (fake) tensors


@dataclass
class RowRequest:
    """A lookup in flight: the distinct ids asked for, how to expand them back, the split sizes, and
    the ids this rank must serve (an all-to-all still running until first used)."""

    wanted: torch.Tensor
    inverse: torch.Tensor | None
    send: list[int]
    recv: list[int]
    asked: torch.Tensor

    def wait(self) -> None:
        """Called before the layer (outside any recomputed region): the ids this rank serves are here."""
        self.asked = _waited(self.asked)


class ShardedRows:
    """rows_of(local block, global hash ids, request) for one table split over `group`."""

    def __init__(self, group, size: int, rank: int, starts: list[int]):
        self.group, self.size, self.rank = group, size, rank
        self.starts = starts  # first global row of each rank's block, and the total at the end

    def request(self, ids: torch.Tensor) -> RowRequest:
        """Steps 1-3's exchanges: counts (synchronous: the split sizes), then the ids, left running."""
        flat = ids.reshape(-1)
        if is_fake(flat):
            send = balanced_split(flat.numel(), self.size)
            return RowRequest(flat, None, send, send, all_to_all_single(flat, send, send, self.group))
        wanted, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        bounds = torch.tensor(self.starts[1:-1], dtype=wanted.dtype, device=wanted.device)
        counts = torch.bincount(torch.bucketize(wanted, bounds, right=True), minlength=self.size)
        recv_counts = _waited(all_to_all_single(counts, None, None, self.group))
        send, recv = counts.tolist(), recv_counts.tolist()
        return RowRequest(wanted, inverse, send, recv, all_to_all_single(wanted, recv, send, self.group))

    def __call__(self, block: torch.Tensor, ids: torch.Tensor, request: RowRequest | None = None) -> torch.Tensor:
        req = request if request is not None else self.request(ids)
        req.wait()  # a no-op when run_blocks has waited already (a recomputed forward reuses the request)
        rows = F.embedding(req.asked - self.starts[self.rank], block)
        got = all_to_all_single_autograd(rows.contiguous(), req.send, req.recv, self.group)
        out = got if req.inverse is None else got[req.inverse]
        return out.view(*ids.shape, block.shape[1])


@torch.no_grad()
def shard_engram_tables(model: nn.Module, size: int, rank: int, group) -> None:
    """Keep rank `rank`'s row block of every Engram table (on the meta template, before materialising)
    and route lookups through `ShardedRows`."""
    for module in model.modules():
        if not isinstance(module, Engram):
            continue
        embed = module.embed
        rows = embed.weight.shape[0]
        pieces = row_pieces(rows, 1, size)
        starts = [p.start for p in pieces] + [rows]
        mine = pieces[rank]
        embed.weight = nn.Parameter(embed.weight[mine.start:mine.end].clone(), requires_grad=embed.weight.requires_grad)
        embed.num_embeddings = mine.numel
        embed.global_rows, embed.row_offset = rows, mine.start
        module.rows_of = ShardedRows(group, size, rank, starts)
