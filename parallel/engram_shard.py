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
Hash ids depend only on tokens, so steps 1-3 run ahead of the layer:
- under pipelining (every rank reads the round's batches), steps 1-2 run for every micro-batch of the
  round when the round starts (`request_round`: the counts of all micro-batches in one all-to-all, one
  host sync per layer and round, before any of the round's compute is queued), and each micro-batch's
  id exchange (step 3, `RowRequest.launch`) starts when the previous micro-batch's forward on the stage
  starts (parallel/pipeline.py `StageModule`) -- so it travels during that micro-batch's compute even
  when the Engram layer is the stage's first block (both are, in exp=flash's partition);
- without a pipeline, steps 1-3 run when the forward starts, before its first block
  (model/transformer.py `run_blocks`), and travel while the blocks before the Engram layer compute.
A recomputed forward (train.recompute) reuses the request. Step 4 runs in the layer: the rows (up to
S x cols x head_dim fp32 per micro-batch, 1.5 GiB at exp=flash's 64K tokens) would otherwise be held
from the prefetch to the micro-batch's backward by every micro-batch in flight.
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
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

from flashtrain.model.engram import Engram
from flashtrain.model.moe import balanced_split
from flashtrain.model.simulation import simulated
from flashtrain.parallel.zero import row_pieces


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if hasattr(t, "wait") else t  # fake tensors come back as plain (fake) tensors


@dataclass
class RowRequest:
    """A lookup: the distinct ids asked for, how to expand them back, the split sizes, and the ids this
    rank must serve (`asked`: None until `launch`, then an all-to-all running until first used)."""

    wanted: torch.Tensor
    inverse: torch.Tensor | None
    send: list[int]
    recv: list[int]
    group: object
    asked: torch.Tensor | None = None

    def launch(self) -> "RowRequest":
        """Step 3: send the ids to their owners (asynchronous; once)."""
        if self.asked is None:
            self.asked = all_to_all_single(self.wanted, self.recv, self.send, self.group)
        return self

    def wait(self) -> None:
        """Called before the layer (outside any recomputed region): the ids this rank serves are here."""
        self.asked = _waited(self.launch().asked)


class ShardedRows:
    """rows_of(local block, global hash ids, request) for one table split over `group`."""

    def __init__(self, group, size: int, rank: int, starts: list[int]):
        self.group, self.size, self.rank = group, size, rank
        self.starts = starts  # first global row of each rank's block, and the total at the end

    def request(self, ids: torch.Tensor) -> RowRequest:
        """Steps 1-3 for one micro-batch: counts (synchronous: the split sizes), then the ids, left running."""
        return self.request_round([ids])[0].launch()

    def request_round(self, ids: list[torch.Tensor]) -> list[RowRequest]:
        """Steps 1-2 for the micro-batches `ids` (one tensor each): distinct ids, and the per-owner
        counts of all of them exchanged in one all-to-all (one host sync). Step 3 is `launch`."""
        if simulated(ids[0]):
            sends = [balanced_split(t.numel(), self.size) for t in ids]
            return [RowRequest(t.reshape(-1), None, send, send, self.group) for t, send in zip(ids, sends)]
        uniques = [torch.unique(t.reshape(-1), sorted=True, return_inverse=True) for t in ids]
        bounds = torch.tensor(self.starts[1:-1], dtype=ids[0].dtype, device=ids[0].device)
        counts = torch.stack([torch.bincount(torch.bucketize(w, bounds, right=True), minlength=self.size)
                              for w, _ in uniques], dim=1)  # [owner, micro-batch]: each owner its row
        recv_counts = _waited(all_to_all_single(counts.reshape(-1), None, None, self.group))
        send = counts.T.tolist()
        recv = recv_counts.view(self.size, len(ids)).T.tolist()
        return [RowRequest(w, inv, s, r, self.group) for (w, inv), s, r in zip(uniques, send, recv)]

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
