"""Muon with V4.1's hybrid Newton-Schulz schedule and head-wise mode (V41_SPEC §7).

Per parameter:   M <- beta M + (1 - beta) G;   G^ = beta M + (1 - beta) G (Nesterov; M itself without)
                 O = NS(G^) * rms_scale * sqrt(max(rows, cols))
                 W <- W (1 - lr wd) - lr O                      (decoupled weight decay)

What counts as "a matrix" for NS:
- a 2-D weight [out, in]: itself;
- a stacked expert weight [E, out, in]: E independent matrices;
- a param group with `num_heads=H` (head-wise): the [H d, in] weight is H independent [d, in] blocks,
  each orthogonalised and scaled by rms_scale * sqrt(max(d, in)).
All matrices of one shape within a step are orthogonalised as one batch (in slices of at most
`ns_batch_elems` elements, by default `NS_BATCH_ELEMS` of the device, which bounds the Newton-Schulz
temporaries). NS runs in fp32 on CPU and in
bf16 on CUDA unless `ns_dtype` says otherwise; bf16 on a CPU without bf16 GEMMs (AVX2: no AVX512-BF16 or
AMX) runs fp32 GEMMs on bf16 values, each product rounded to bf16 -- bf16 GEMMs' numerics at fp32 GEMM
speed (`ns_native=True`: torch's own bf16 GEMMs; newton_schulz.py).

Data parallel (DESIGN.md "Parallelism"): ZeRO-1 is the one path that splits the Newton-Schulz work
over the ranks. `zero_of(param)` returns the parameter's `parallel.zero.Ownership`: its matrices are
cut into pieces of whole matrices, each owned by one rank of its replica group (the data-parallel
group; for routed experts under EP the replicas of the expert shard), balanced by Newton-Schulz cost
(parallel/zero.py). The owner alone keeps the momentum of its pieces (a flat buffer over them, in
piece order), orthogonalises them and applies the update; then the optimizer itself broadcasts every
piece from its owner over the replica group (these broadcasts are not `ParallelDims`' collectives), so
all replicas end with the parameter the replicated step gives. Without ZeRO (`optim.zero=false`, or no
replicas) every rank runs the whole step on every matrix it holds and nothing is exchanged.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import NamedTuple

import torch
import torch.distributed as dist

from flashtrain.train.optim.base import GroupwiseOptimizer
from flashtrain.train.optim.newton_schulz import V41_NS_SCHEDULE, newton_schulz


def _as_matrices(t: torch.Tensor, num_heads: int | None) -> torch.Tensor:
    """View a parameter-shaped tensor as a batch of matrices [n, rows, cols]."""
    if num_heads:
        if t.dim() != 2 or t.shape[0] % num_heads:
            raise ValueError(f"head-wise Muon: a [{num_heads} * head_dim, in] matrix is needed, got {tuple(t.shape)}")
        return t.view(num_heads, t.shape[0] // num_heads, t.shape[1])
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() == 3:
        return t
    raise ValueError(f"Muon takes 2-D matrices or stacked [E, out, in] experts, got shape {tuple(t.shape)}")


# Newton-Schulz slice sizes (values of G^) when `ns_batch_elems` is not given. CPU: slices that stay in cache; on
# the AMD EPYC of docs/kernels.md, flash_small's bf16 Muon step took 1.34-1.39 s with 2^19-2^21 and 1.54 s with
# 2^22, its fp32 step 5.2 s with 2^19-2^20 and 6.1 s with 2^22 (one thread). CUDA: enough matrices per launch to
# fill the SMs (2^22 values: 128 matrices of 128 x 256, 384 programs of the 64-wide Triton tiles).
NS_BATCH_ELEMS = {"cpu": 1 << 20, "cuda": 1 << 22}


class _Entry(NamedTuple):
    """One parameter (or ZeRO piece) as matrices [k, rows, cols]: views of the weight, its gradient and its
    momentum."""
    weight: torch.Tensor
    grad: torch.Tensor
    momentum: torch.Tensor


def _overlaps(sizes: list[int], start: int, count: int):
    """For matrices laid end to end (entry i holds sizes[i] of them) and the slice of `count` matrices from
    `start`: (i, rows of entry i, rows of the slice) for every entry the slice overlaps, as slices."""
    end, at = start + count, 0
    for i, n in enumerate(sizes):
        lo, hi = max(at, start), min(at + n, end)
        if lo < hi:
            yield i, slice(lo - at, hi - at), slice(lo - start, hi - start)
        at += n


class Muon(GroupwiseOptimizer):
    ZERO_SPLIT = "matrices"  # ZeRO-1 pieces of whole matrices, balanced by their orthogonalisation cost
    STATE_BUFFERS = 1  # momentum

    def __init__(self, params, lr: float = 2.6e-4, momentum: float = 0.95, weight_decay: float = 0.1,
                 nesterov: bool = True, rms_scale: float = 0.18, ns_coefficients=V41_NS_SCHEDULE,
                 ns_eps: float = 1e-7, ns_dtype: torch.dtype | None = None, use_triton: bool | None = None,
                 ns_batch_elems: int | None = None, zero_of=None, ns_native: bool | None = None):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"Muon: invalid lr={lr}, momentum={momentum} or weight_decay={weight_decay}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                        rms_scale=rms_scale, num_heads=None)
        super().__init__(params, defaults)
        self.ns_coefficients = tuple(tuple(c) for c in ns_coefficients)
        if not self.ns_coefficients:
            raise ValueError("Muon: ns_coefficients is empty; give at least one Newton-Schulz step (a, b, c)")
        self.ns_eps, self.ns_dtype, self.use_triton = ns_eps, ns_dtype, use_triton
        self.ns_batch_elems = ns_batch_elems
        self.zero_of = zero_of
        self.ns_native = ns_native  # bf16 NS: native bf16 GEMMs or fp32 ones (None: as the hardware has them)
        self._ghat_workspace: torch.Tensor | None = None

    def _step_group(self, group: dict) -> None:
        if self.zero_of is not None:
            return self._step_group_zero(group)
        heads = group["num_heads"]
        entries = []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            entries.append(_Entry(*(_as_matrices(t, heads) for t in (p, p.grad, state["momentum_buffer"]))))
        self._update(entries, group)

    def _update(self, entries: list[_Entry], group: dict) -> None:
        """Per matrix shape, in slices of at most `ns_batch_elems` values (which bounds the Newton-Schulz
        temporaries): the slice's momentum, then its G^ written into one reused workspace (while the momentum and
        gradient just read are in cache), their Newton-Schulz, each orthogonalised matrix applied to its weight
        (times the update's scale)."""
        beta, lr, wd, nesterov = group["momentum"], group["lr"], group["weight_decay"], group["nesterov"]
        by_shape: dict[tuple, list[_Entry]] = defaultdict(list)
        for e in entries:
            by_shape[tuple(e.weight.shape[1:])].append(e)
        for (rows, cols), same in by_shape.items():
            sizes = [e.weight.shape[0] for e in same]
            total = sum(sizes)
            device = same[0].grad.device
            per_slice = min(total, max(1, self._slice_elems(device) // (rows * cols)))
            work = self._workspace(per_slice * rows * cols, same[0].grad)
            scale = group["rms_scale"] * math.sqrt(max(rows, cols))
            for start in range(0, total, per_slice):
                ghat = work[:min(per_slice, total - start) * rows * cols].view(-1, rows, cols)
                pieces = list(_overlaps(sizes, start, ghat.shape[0]))
                for i, src, dst in pieces:  # G^ written straight into the workspace: no copy, no concatenation
                    grad, momentum = same[i].grad[src], same[i].momentum[src]
                    momentum.lerp_(grad, 1 - beta)
                    torch.lerp(grad, momentum, beta, out=ghat[dst]) if nesterov else ghat[dst].copy_(momentum)
                ortho = newton_schulz(ghat, self.ns_coefficients, self.ns_eps, self.ns_dtype, self.use_triton,
                                      self.ns_native)
                for i, src, dst in pieces:
                    w = same[i].weight[src]
                    if wd:
                        w.mul_(1 - lr * wd)
                    w.add_(ortho[dst], alpha=-lr * scale)

    def _slice_elems(self, device: torch.device) -> int:
        return self.ns_batch_elems or NS_BATCH_ELEMS.get(device.type, NS_BATCH_ELEMS["cuda"])

    def _workspace(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat buffer of at least `numel` values of `like`'s dtype and device, kept between steps (at most
        `ns_batch_elems` values: one Newton-Schulz slice of G^), so each step writes G^ to memory it touched
        before instead of fresh pages."""
        buf = self._ghat_workspace
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._ghat_workspace = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf

    def _step_group_zero(self, group: dict) -> None:
        """ZeRO-1: momentum, Newton-Schulz and the update for the pieces this rank owns; then each piece
        is broadcast from its owner."""
        heads = group["num_heads"]
        entries = []  # the pieces of the flat parameters this rank owns, as matrices
        live = [p for p in group["params"] if p.grad is not None]
        for p in live:
            own = self.zero_of(p)
            mine = own.mine()
            if not mine:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros(own.owned_numel, dtype=p.dtype, device=p.device)
            buf, at = state["momentum_buffer"], 0
            rows, cols = _as_matrices(p, heads).shape[1:]
            for piece in mine:
                entries.append(_Entry(*(t.view(-1, rows, cols) for t in (
                    p.view(-1)[piece.start:piece.end], p.grad.view(-1)[piece.start:piece.end],
                    buf[at:at + piece.numel]))))
                at += piece.numel
        self._update(entries, group)
        works = []
        for p in live:
            own = self.zero_of(p)
            if own.group is None:
                continue
            for piece in own.pieces:
                if piece.numel:
                    works.append(dist.broadcast(p.view(-1)[piece.start:piece.end], group=own.group,
                                                group_src=piece.owner, async_op=True))
        for w in works:
            w.wait()
