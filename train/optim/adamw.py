"""AdamW over the parameter pieces this rank owns (ZeRO-1 flat element shards, parallel/zero.py;
V41_SPEC §7 for the hyper-parameters).

Each parameter's flattened elements are cut into equal chunks, one per rank of its replica group; this
rank runs torch's AdamW on views of its chunks (the update lands in the parameter itself, the moments
exist for the chunk only), then one all-gather per replica group, run by this optimizer itself,
assembles every updated parameter on every rank. A parameter without a gradient this step (on every
rank alike: parallel/grad_reduce.py) is skipped, as torch's AdamW skips it. Without ZeRO (`zero_of`
None) each rank owns every element and nothing is gathered: exactly torch's AdamW.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashtrain.parallel.zero import Ownership, flat_pieces, whole


def _flat_layout(own: Ownership) -> bool:
    """Whether `own` is `parallel.zero.flat_pieces`' layout: owner k holds elements [k per, (k + 1) per),
    per = ceil(numel / size). Then the all-gathered chunks (row k of the receive buffer: owner k's piece,
    padded to per) laid end to end are the parameter -- one copy per parameter instead of one per piece
    (exp=flash's 64K layout has replica groups of dp x cp = 512 ranks: 512 copies per parameter)."""
    return own.pieces == flat_pieces(max(q.end for q in own.pieces), len(own.pieces))


class ShardedAdamW:
    ZERO_SPLIT = "flat"  # ZeRO-1 pieces of equal flat chunks
    STATE_BUFFERS = 2  # first and second moments

    def __init__(self, param_groups: list[dict], zero_of=None, **adamw_kwargs):
        self.zero_of = zero_of or (lambda p: whole(p.numel()))
        self.params = [p for g in param_groups for p in g["params"]]
        self.view_of: dict[int, torch.Tensor] = {}
        self._flat: dict[int, bool] = {}  # per parameter: its ownership is the flat layout (`_flat_layout`)
        inner_groups = []
        for g in param_groups:
            views = []
            for p in g["params"]:
                own = self.zero_of(p)
                piece = own.pieces[own.rank]
                if piece.numel:
                    self.view_of[id(p)] = p.detach().view(-1)[piece.start:piece.end]
                    views.append(self.view_of[id(p)])
            inner_groups.append({**g, "params": views})
        owned = [g for g in inner_groups if g["params"]]  # a rank may own no chunk of a group's parameters
        self.inner = torch.optim.AdamW(owned, **adamw_kwargs) if owned else None
        self.extra_groups = [g for g in inner_groups if not g["params"]]  # still given their lr by set_lr
        self.state = self.inner.state if self.inner is not None else {}

    @property
    def param_groups(self) -> list[dict]:
        return (self.inner.param_groups if self.inner is not None else []) + self.extra_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        live = [p for p in self.params if p.grad is not None]
        for p in self.params:
            v = self.view_of.get(id(p))
            if v is not None:
                own = self.zero_of(p)
                piece = own.pieces[own.rank]
                v.grad = p.grad.view(-1)[piece.start:piece.end] if p.grad is not None else None
        if self.inner is not None:
            self.inner.step()
        self._gather(live)

    def _gather(self, live: list[torch.Tensor]) -> None:
        """One all-gather per replica group of every rank's updated chunks (padded to equal size)."""
        by_group: dict[int, list[tuple[torch.Tensor, Ownership]]] = {}
        for p in live:
            own = self.zero_of(p)
            if own.group is not None:
                by_group.setdefault(id(own.group), []).append((p, own))
        for members in by_group.values():
            group, size = members[0][1].group, len(members[0][1].pieces)
            per = [max(q.numel for q in own.pieces) for _, own in members]
            send = torch.cat([torch.nn.functional.pad(p.view(-1)[own.pieces[own.rank].start:own.pieces[own.rank].end],
                                                      (0, n - own.pieces[own.rank].numel))
                              for (p, own), n in zip(members, per)])
            recv = send.new_empty(size * send.numel())
            dist.all_gather_single(recv, send, group=group)
            recv = recv.view(size, -1)
            at = 0
            for (p, own), n in zip(members, per):
                flat = p.view(-1)
                if id(p) not in self._flat:
                    self._flat[id(p)] = _flat_layout(own)
                if self._flat[id(p)]:  # rows of whole chunks, then the last one's part: two copies at most
                    full, rest = divmod(flat.numel(), n)
                    flat[:full * n].view(full, n).copy_(recv[:full, at:at + n])
                    if rest:
                        flat[full * n:].copy_(recv[full, at:at + rest])
                else:
                    for q in own.pieces:
                        if q.numel:
                            flat[q.start:q.end].copy_(recv[q.owner, at:at + q.numel])
                at += n

    # --- checkpoint interface (train/checkpoint.py) ---------------------------------------------
    def state_pieces(self, p: torch.Tensor):
        if id(p) not in self.view_of:
            return []
        own = self.zero_of(p)
        return [own.pieces[own.rank]]

    def owned_state(self):
        """(param, state name, value, pieces): tensors flat over this rank's pieces, scalars as they are."""
        for p in self.params:
            v = self.view_of.get(id(p))
            if v is not None and v in self.state:
                for k, val in self.state[v].items():
                    yield p, k, val, self.state_pieces(p)

    def install_state(self, p: torch.Tensor, k: str, value: torch.Tensor) -> None:
        v = self.view_of.get(id(p))
        if v is not None:
            self.state[v][k] = value.to(p.device) if value.dim() else value

    def clear_state(self) -> None:
        self.state.clear()
