"""Expert parallelism (DESIGN.md "Parallelism"): each rank of an EP group holds E / ep of every MoE
layer's routed experts; tokens travel to their experts' rank and back with `all_to_all_single`.

Dispatch, for one MoE layer on each rank of the EP group (dropless: every routed (token, expert) pair
is computed, no capacity):
1. sort the (token, expert) pairs by global expert id: experts [r E/ep, (r+1) E/ep) live on EP rank r,
   so the pairs for each destination are contiguous;
2. exchange the per-expert pair counts (an all-to-all of E integers), from which both sides know the
   variable split sizes;
3. all-to-all the token rows and their routing weights (autograd: the backward is the reverse
   all-to-all, so gradients reach the sender's activations and gate);
4. the owner regroups the received rows by local expert (source order kept within an expert),
   computes them with the weight applied before w2 (as the local path does), and sends the results
   back (a third all-to-all, with autograd);
5. the sender adds each result into its token's row (fp32).
Loads for balancing are counted from the gate's selections on the token's own rank, then summed over
every rank (train/balancing.py), exactly as without EP.

`shard_experts` slices an identically initialised whole model's stacks to this rank's experts, so
every layout starts from the same weights; parameter names do not change (`layers.{i}.ffn.experts.w1`
is [E / ep, ...] here, with `offset` its first global index).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

from flashtrain.model.moe import RoutedExperts, balanced_split, expert_sizes
from flashtrain.model.simulation import simulated


def _chunks(xs: list[int], n: int) -> list[list[int]]:
    return [xs[i:i + n] for i in range(0, len(xs), n)]


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Variable-split all-to-all along dim 0 whose backward is the reverse all-to-all."""
    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


class AllToAllDispatch:
    """The EP dispatcher a RoutedExperts calls instead of its local path (set by `shard_experts`)."""

    def __init__(self, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep

    def _exchange_plan(self, flat: torch.Tensor, E: int, e_local: int):
        """(rows sent to each EP rank, rows received from each, the permutation that regroups the received
        rows by local expert, rows per local expert as a device tensor). The split sizes are the one host
        synchronisation of the layer: a single `tolist` of both lists. Fake tensors (train/plan/estimate.py)
        carry no values: every rank then sends and receives the balanced split, without exchanging counts."""
        ep = self.ep
        if simulated(flat):
            splits = [sum(part) for part in _chunks(balanced_split(flat.numel(), E), e_local)]
            n = sum(splits)
            sizes = torch.tensor(balanced_split(n, e_local), dtype=torch.int32, device=flat.device)
            return splits, splits, torch.arange(n, device=flat.device), sizes
        per_expert = expert_sizes(flat, E)  # pairs this rank sends to each global expert
        # functional (an op selective recomputation can keep, so a recomputed block does not exchange again)
        recv_per_expert = all_to_all_single(per_expert, None, None, self.group).wait().view(ep, e_local)
        in_splits, out_splits = torch.stack([per_expert.view(ep, e_local).sum(1), recv_per_expert.sum(1)]).tolist()
        # received rows: by source rank, then by expert; regroup by local expert
        local_id = torch.arange(e_local, device=flat.device).repeat(ep).repeat_interleave(
            recv_per_expert.flatten(), output_size=sum(out_splits))
        return in_splits, out_splits, local_id.argsort(stable=True), recv_per_expert.sum(0, dtype=torch.int32)

    def __call__(self, experts: RoutedExperts, x: torch.Tensor, weights: torch.Tensor,
                 indices: torch.Tensor) -> torch.Tensor:
        ep, E = self.ep, experts.n_global
        e_local = E // ep
        flat = indices.flatten()
        order = flat.argsort(stable=True)
        token = order // indices.shape[1]
        in_splits, out_splits, perm, sizes = self._exchange_plan(flat, E, e_local)
        recv_x = _a2a(x[token], out_splits, in_splits, self.group)
        recv_w = _a2a(weights.flatten()[order], out_splits, in_splits, self.group)
        ys = experts.local_experts(recv_x[perm], recv_w[perm], sizes)
        back = torch.empty_like(ys).index_copy(0, perm, ys)  # undo the regrouping
        result = _a2a(back, in_splits, out_splits, self.group)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add(0, token, result.float())


def expert_modules(model: nn.Module) -> list[RoutedExperts]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


@torch.no_grad()
def shard_experts(model: nn.Module, ep: int, ep_rank: int, group: dist.ProcessGroup) -> None:
    """Keep experts [ep_rank E/ep, (ep_rank+1) E/ep) of every MoE layer, in place, and route through
    the all-to-all dispatcher."""
    dispatcher = AllToAllDispatch(group, ep)
    for experts in expert_modules(model):
        e_local = experts.n_global // ep
        experts.offset = ep_rank * e_local
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            setattr(experts, name, nn.Parameter(full[experts.offset:experts.offset + e_local].clone(),
                                                requires_grad=full.requires_grad))
        experts.dispatcher = dispatcher
