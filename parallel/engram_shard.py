"""Row-sharded Engram tables (V41_SPEC §5 "at scale"; DESIGN.md "Parallelism": Engram tables).

Each Engram table (hundreds of millions of rows at `exp=flash`) is split over the data-parallel ranks
of its pipeline stage: rank r holds a contiguous block of rows (`parallel.zero.row_pieces`: sizes
differing by at most one row) as `engram.embed.weight`, with `row_offset` / `global_rows` recorded on
the embedding module (initialisation draws the global rows it holds, model/init.py; checkpoints write
the block at its offset, train/checkpoint.py). A lookup (`ShardedRows`), per Engram layer and micro-batch:
1. the distinct hash ids of the local batch, sorted -- so the ids of each owner are contiguous;
2. per-owner counts exchanged (one all-to-all of dp integers; the split sizes are the one host sync);
3. the ids go to their owners (all-to-all), each owner gathers its rows (autograd to its block);
4. the rows come back (all-to-all with autograd), and are expanded to every position.
Backward runs the reverse: each row's gradient goes back to its owner, summed over every rank that
looked it up, into the owner's block gradient -- which is therefore already the sum over dp and is
not all-reduced (parallel/grad_reduce.py only divides it by dp). The row-sharded Sinkhorn update then
all-reduces its column statistics over the same group (train/optim/sinkhorn.py).
Fake tensors (the memory estimator) carry no ids: every rank then sends and receives the balanced
share of the lookups, without de-duplication (the worst case).
"""

from __future__ import annotations

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


class ShardedRows:
    """rows_of(local block, global hash ids) for one table split over `group`."""

    def __init__(self, group, size: int, rank: int, starts: list[int]):
        self.group, self.size, self.rank = group, size, rank
        self.starts = starts  # first global row of each rank's block, and the total at the end

    def __call__(self, block: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if is_fake(flat):
            wanted, inverse = flat, None
            send = balanced_split(flat.numel(), self.size)
            recv = send
        else:
            wanted, inverse = torch.unique(flat, sorted=True, return_inverse=True)
            bounds = torch.tensor(self.starts[1:-1], dtype=wanted.dtype, device=wanted.device)
            counts = torch.bincount(torch.bucketize(wanted, bounds, right=True), minlength=self.size)
            recv_counts = _waited(all_to_all_single(counts, None, None, self.group))
            send, recv = counts.tolist(), recv_counts.tolist()
        asked = _waited(all_to_all_single(wanted, recv, send, self.group))  # ids this rank owns, by asker
        rows = F.embedding(asked - self.starts[self.rank], block)
        got = all_to_all_single_autograd(rows.contiguous(), send, recv, self.group)
        out = got if inverse is None else got[inverse]
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
