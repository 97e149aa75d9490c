"""Gradient reduction over data-parallel replicas, bucketed and overlapped with backward (DESIGN.md
"Parallelism": data parallel).

Gradients live in flat per-group buckets (`bucket_bytes` each): every trainable parameter's `.grad`
is a view into its bucket, so backward accumulates straight into the buffer that is reduced -- there
is no separate flat copy of all gradients. Buckets hold parameters in reverse registration order
(roughly the order backward produces them) and each holds parameters of one replica group only:
- non-expert parameters: the data-parallel group;
- routed experts under EP: the replicas of their shard (dp / ep ranks; none when ep = dp: the
  all-to-all backward already summed the group's contributions into the owner's gradient);
- row-sharded Engram tables: none (the lookup's all-to-all backward returned every rank's rows to
  their owner, parallel/engram_shard.py).
Every gradient is divided by the dp size (the loss is a mean over all dp ranks' micro-batches).

Overlap: before the backward that completes a parameter's gradient (the last micro-batch of the step;
under pipelining the stage's last backward), `mark_final(params)`; each parameter's post-accumulate-grad
hook then counts it, and a bucket whose parameters have all arrived starts its all-reduce asynchronously
while backward goes on -- in bucket order (a complete bucket waits for the ones before it), so every
rank issues the same sequence of collectives whatever order its own graph completes them in (an image on
one rank only puts the vision path in its graph). `finish()` starts the buckets still waiting
(parameters this backward did not reach), waits for all of them and applies the zero-fill rule: a
parameter that got a gradient on some ranks only takes part with zeros elsewhere (its bucket slot is
zero), one that got none on any rank of its group ends without a gradient (`.grad = None`), as in a
single process -- decided by one small all-reduce of "touched" flags per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flashtrain.model.simulation import simulated


@dataclass
class Bucket:
    group: object  # process group, or None: not reduced (only scaled)
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    offsets: list[int]
    arrived: int = 0
    work: object = None
    final: set = field(default_factory=set)


class GradReducer:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], group_of, divisor: int,
                 bucket_bytes: int = 25 << 20):
        """group_of(name) -> the replica group to all-reduce over, or None (scale only)."""
        self.named = list(named_params)
        self.group_of, self.divisor, self.bucket_bytes = group_of, divisor, bucket_bytes
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, tuple[Bucket, int]] = {}
        self.trainable: tuple = ()
        self.touched: set[int] = set()
        self.hooks = []
        self.launches = 0  # buckets started from a hook, i.e. overlapped with backward (for tests)
        self.next_bucket = 0  # buckets [0, next_bucket) have started

    # --- layout ------------------------------------------------------------------------------
    def _build(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks, self.buckets, self.bucket_of = [], [], {}
        by_group: dict[int, list] = {}
        groups = {}
        for name, p in reversed(self.named):
            if not p.requires_grad:
                continue
            g = self.group_of(name)
            groups[id(g)] = g
            by_group.setdefault(id(g), []).append(p)
        for gid, params in by_group.items():
            current, size = [], 0
            for p in params:
                nbytes = p.numel() * p.element_size()
                if current and (size + nbytes > self.bucket_bytes or p.dtype != current[0].dtype):
                    self._add_bucket(groups[gid], current)
                    current, size = [], 0
                current.append(p)
                size += nbytes
            if current:
                self._add_bucket(groups[gid], current)
        for b in self.buckets:
            for p in b.params:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.trainable = tuple(id(p) for _, p in self.named if p.requires_grad)

    def _add_bucket(self, group, params) -> None:
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += p.numel()
        buf = torch.zeros(n, dtype=params[0].dtype, device=params[0].device)
        b = Bucket(group, params, buf, offsets)
        for i, p in enumerate(params):
            self.bucket_of[id(p)] = (b, i)
        self.buckets.append(b)

    def _view(self, b: Bucket, i: int) -> torch.Tensor:
        p = b.params[i]
        return b.buffer[b.offsets[i]:b.offsets[i] + p.numel()].view_as(p)

    # --- per step ----------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero every bucket and point each trainable parameter's `.grad` at its slot; rebuilds the
        buckets when the set of trainable parameters changed (the ViT unfreezing)."""
        if tuple(id(p) for _, p in self.named if p.requires_grad) != self.trainable or not self.hooks:
            for _, p in self.named:
                p.grad = None
            self._build()
        for b in self.buckets:
            b.buffer.zero_()
            b.arrived, b.work, b.final = 0, None, set()
            for i, p in enumerate(b.params):
                p.grad = self._view(b, i)
        self.touched = set()
        self.next_bucket = 0

    def mark_final(self, params=None) -> None:
        """The next backward completes the gradients of `params` (default: all): reduce as they arrive."""
        ids = {id(p) for p in params} if params is not None else set(self.bucket_of)
        for pid in ids:
            if pid in self.bucket_of:
                self.bucket_of[pid][0].final.add(pid)

    def _on_grad(self, p: torch.Tensor) -> None:
        self.touched.add(id(p))
        b, i = self.bucket_of[id(p)]
        slot = self._view(b, i)
        # autograd replaced the view instead of adding into it
        if not simulated(slot) and p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
            p.grad = slot
        if id(p) in b.final:
            b.final.discard(id(p))
            b.arrived += 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start the complete buckets that follow the started ones, in bucket order."""
        while self.next_bucket < len(self.buckets):
            b = self.buckets[self.next_bucket]
            if b.arrived < len(b.params):
                return
            self._launch(b)
            self.launches += 1
            self.next_bucket += 1

    def _launch(self, b: Bucket) -> None:
        b.buffer.div_(self.divisor)
        if b.group is not None:
            b.work = dist.all_reduce(b.buffer, group=b.group, async_op=True)

    def finish(self) -> None:
        """Start the remaining buckets, wait for all, and drop gradients no rank of the group produced."""
        for b in self.buckets[self.next_bucket:]:  # in bucket order, as every rank does
            self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        self._zero_fill_rule()

    def _zero_fill_rule(self) -> None:
        by_group: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            by_group.setdefault(id(b.group), []).append(b)
        for buckets in by_group.values():  # one small all-reduce per group
            params = [p for b in buckets for p in b.params]
            got = [id(p) in self.touched for p in params]  # known here: a host read only to agree over a group
            if buckets[0].group is not None:  # did any replica's backward produce it: one host read per group
                flags = torch.tensor(got, dtype=torch.float32, device=buckets[0].buffer.device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=buckets[0].group)
                got = flags
            if simulated(buckets[0].buffer):  # the memory estimator: no values, every gradient is assumed to exist
                continue
            for p, arrived in zip(params, got if isinstance(got, list) else got.tolist()):
                if not arrived:
                    p.grad = None
