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
`ns_batch_elems` elements, which bounds the Newton-Schulz temporaries). NS runs in fp32 on CPU and in
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

import torch

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


class Muon(GroupwiseOptimizer):
    def __init__(self, params, lr: float = 2.6e-4, momentum: float = 0.95, weight_decay: float = 0.1,
                 nesterov: bool = True, rms_scale: float = 0.18, ns_coefficients=V41_NS_SCHEDULE,
                 ns_eps: float = 1e-7, ns_dtype: torch.dtype | None = None, use_triton: bool | None = None,
                 ns_batch_elems: int = 1 << 22, zero_of=None, ns_native: bool | None = None):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"Muon: invalid lr={lr}, momentum={momentum} or weight_decay={weight_decay}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                        rms_scale=rms_scale, num_heads=None)
        super().__init__(params, defaults)
        self.ns_coefficients = tuple(tuple(c) for c in ns_coefficients)
        self.ns_eps, self.ns_dtype, self.use_triton = ns_eps, ns_dtype, use_triton
        self.ns_batch_elems = ns_batch_elems
        self.zero_of = zero_of
        self.ns_native = ns_native  # bf16 NS: native bf16 GEMMs or fp32 ones (None: as the hardware has them)

    def _step_group(self, group: dict) -> None:
        if self.zero_of is not None:
            return self._step_group_zero(group)
        beta, heads = group["momentum"], group["num_heads"]
        updates: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, G^ as matrices)
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - beta)
            ghat = p.grad.lerp(buf, beta) if group["nesterov"] else buf
            updates.append((p, _as_matrices(ghat, heads)))
        if not updates:
            return
        self._apply(updates, self._orthogonalized(updates, group["rms_scale"]), group["lr"], group["weight_decay"])

    def _orthogonalized(self, updates, rms_scale: float) -> list[torch.Tensor]:
        """Scaled NS of every update's matrices: all matrices of one shape as one batch."""
        by_shape: dict[tuple, list[int]] = defaultdict(list)
        for i, (_, mats) in enumerate(updates):
            by_shape[tuple(mats.shape[1:])].append(i)
        ortho: list[torch.Tensor | None] = [None] * len(updates)
        for (rows, cols), idx in by_shape.items():
            out = self._ns(torch.cat([updates[i][1] for i in idx]))
            out = out * (rms_scale * math.sqrt(max(rows, cols)))
            for i, part in zip(idx, out.split([updates[i][1].shape[0] for i in idx])):
                ortho[i] = part
        return ortho

    def _step_group_zero(self, group: dict) -> None:
        """ZeRO-1: momentum, Newton-Schulz and the update for the pieces this rank owns; then each piece
        is broadcast from its owner."""
        import torch.distributed as dist

        beta, heads = group["momentum"], group["num_heads"]
        updates: list[tuple[torch.Tensor, torch.Tensor]] = []  # (piece of the flat param, G^ as matrices)
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
                g = p.grad.view(-1)[piece.start:piece.end]
                m = buf[at:at + piece.numel]
                at += piece.numel
                m.lerp_(g, 1 - beta)
                ghat = g.lerp(m, beta) if group["nesterov"] else m
                updates.append((p.view(-1)[piece.start:piece.end], ghat.view(-1, rows, cols)))
        ortho = self._orthogonalized(updates, group["rms_scale"])  # the owned pieces only
        self._apply(updates, ortho, group["lr"], group["weight_decay"])
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

    def _ns(self, batch: torch.Tensor) -> torch.Tensor:
        rows, cols = batch.shape[1:]
        per_chunk = max(1, self.ns_batch_elems // (rows * cols))  # bounds the NS temporaries
        return torch.cat([newton_schulz(part, self.ns_coefficients, self.ns_eps, self.ns_dtype, self.use_triton,
                                        self.ns_native) for part in batch.split(per_chunk)])

    @staticmethod
    def _apply(updates, ortho, lr: float, wd: float) -> None:
        for (p, _), o in zip(updates, ortho):
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(o.reshape(p.shape).to(p.dtype), alpha=-lr)
