"""Sinkhorn-balanced momentum update for embeddings, the LM head and Engram tables (V41_SPEC §7,
Algorithm 1), for W in R^{m x n} (rows = tokens or n-grams, columns = features):

1. M <- beta M + (1 - beta) G;  G^ = beta M + (1 - beta) G
2. rho_i = ||G^_i||_2; rows with rho_i <= tau * mean(rho) are set to 0
3. K (odd) alternating normalisations of U, starting and ending on rows: odd steps divide each row by
   its l2 norm + eps, even steps each column
4. W <- W - gamma * lr * sqrt(n) * U

U is never materialised: U = diag(r) G^ diag(c) with a row-scale vector r and a column-scale vector c.
A row step needs s_i = ||G^_i * c||, giving r_i <- r_i / (r_i s_i + eps); a column step needs
t_j = sum_i r_i^2 G^_ij^2, giving c_j <- c_j / (c_j sqrt(t_j) + eps). Each row pass reads G^ (recomputed
on load from M and G) once for s and a second time, in the same pass, to accumulate t for the column
step that follows -- so column steps are vector operations, and the last row pass applies the update
to W in place. Passes over the m x n data: 1 (momentum + rho) + (K + 1) / 2 (row steps, the last one
applying).

Row-sharded tables (`row_group`: the process group over which a table's rows are split, each rank
holding a slice): the row statistics are per row and stay local; the mean of rho and the column
statistics t are all-reduced over the group (one tiny all-reduce per column step), so every shard sees
the whole table's column scales -- the same update as on the unsharded table. Under ZeRO-1 each rank
updates its row block that way and the optimizer then broadcasts every block from its owner; these
exchanges are the optimizer's own, over the groups it is given (train/optim/__init__.py).

`sinkhorn_update_reference` is the plain-PyTorch path (rows in chunks, so its workspace is
chunk x n, never m x n); `sinkhorn_update_triton` fuses each pass into one kernel.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from flashtrain.model.kernels.select import HAS_TRITON, interpreting, launch, use_triton
from flashtrain.train.optim.base import GroupwiseOptimizer


def _row_mean(rho: torch.Tensor, row_group) -> torch.Tensor:
    if row_group is None:
        return rho.mean()
    stats = torch.stack([rho.sum(), torch.tensor(float(rho.numel()), device=rho.device)])
    dist.all_reduce(stats, group=row_group)
    return stats[0] / stats[1]


def _sum_over_shards(t: torch.Tensor, row_group) -> torch.Tensor:
    if row_group is not None:
        dist.all_reduce(t, group=row_group)
    return t


def _check_steps(num_steps: int) -> None:
    if num_steps < 1 or num_steps % 2 == 0:
        raise ValueError(f"SinkhornBalanced num_steps={num_steps}: the normalisations start and end on rows, "
                         f"so an odd count >= 1 is needed (V4.1 uses 11)")


@torch.no_grad()
def sinkhorn_update_reference(W: torch.Tensor, G: torch.Tensor, M: torch.Tensor, lr: float, beta: float,
                              num_steps: int, tau: float, eps: float, gamma: float,
                              chunk_elems: int = 1 << 18, row_group=None) -> None:
    """In place: M <- momentum, W <- W - gamma lr sqrt(n) U (Algorithm 1)."""
    _check_steps(num_steps)
    m, n = W.shape
    rows = max(1, chunk_elems // max(n, 1))
    chunks = [(r0, min(m, r0 + rows)) for r0 in range(0, m, rows)]

    def ghat(r0, r1):
        return G[r0:r1].float().lerp(M[r0:r1].float(), beta)

    rho = torch.empty(m, dtype=torch.float32, device=W.device)
    for r0, r1 in chunks:
        M[r0:r1].lerp_(G[r0:r1].to(M.dtype), 1 - beta)
        rho[r0:r1] = ghat(r0, r1).norm(dim=1)
    r = (rho > tau * _row_mean(rho, row_group)).float()  # masked rows: r_i = 0 keeps them 0 forever
    c = torch.ones(n, dtype=torch.float32, device=W.device)
    scale = gamma * lr * math.sqrt(n)
    for step in range(1, num_steps + 1, 2):  # row steps; the column step after each is a vector op
        last = step == num_steps
        t = torch.zeros(n, dtype=torch.float32, device=W.device)
        for r0, r1 in chunks:
            gh = ghat(r0, r1)
            s = (gh * c).norm(dim=1)
            r[r0:r1] = r[r0:r1] / (r[r0:r1] * s + eps)
            if last:
                W[r0:r1] -= (scale * (r[r0:r1, None] * gh * c)).to(W.dtype)
            else:
                t += (r[r0:r1, None] * gh).square().sum(0)
        if not last:
            t = _sum_over_shards(t, row_group)
            c = c / (c * t.sqrt() + eps)


if HAS_TRITON:
    import triton
    import triton.language as tl

    # (32, 256, 8 warps) spilled 12 bytes in the row pass on sm_90a (compile gate, docs/kernels.md): dropped
    _CONFIGS = ([triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})] if interpreting() else
                [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w)
                 for bm, bn, w in ((16, 256, 4), (32, 128, 4), (8, 512, 4))])

    @triton.autotune(configs=_CONFIGS, key=["m", "n"], restore_value=["M"])
    @triton.jit
    def _momentum_rownorm_kernel(G, M, RHO, m, n, sgm, sgn, smm, smn, beta,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(0, n, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < m) & (cols[None, :] < n)
            g = tl.load(G + rows[:, None] * sgm + cols[None, :] * sgn, mask=mask, other=0.0).to(tl.float32)
            mm = tl.load(M + rows[:, None] * smm + cols[None, :] * smn, mask=mask, other=0.0).to(tl.float32)
            mm = beta * mm + (1 - beta) * g
            tl.store(M + rows[:, None] * smm + cols[None, :] * smn, mm.to(M.dtype.element_ty), mask=mask)
            gh = beta * mm + (1 - beta) * g
            acc += tl.sum(gh * gh, axis=1)
        tl.store(RHO + rows, tl.sqrt(acc), mask=rows < m)

    @triton.autotune(configs=_CONFIGS, key=["m", "n"], reset_to_zero=["T"], restore_value=["W", "R"])
    @triton.jit
    def _row_pass_kernel(G, M, W, R, C, T, m, n, sgm, sgn, smm, smn, swm, swn, beta, eps, scale,
                         LAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """One row step: r <- r / (r ||G^ c|| + eps) for a block of rows; then either accumulate the
        column statistics t_j += sum_i (r_i G^_ij)^2 (atomically) or, on the last step, apply
        W -= scale * r_i G^_ij c_j in place."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < m
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(0, n, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            mask = rmask[:, None] & (cols[None, :] < n)
            g = tl.load(G + rows[:, None] * sgm + cols[None, :] * sgn, mask=mask, other=0.0).to(tl.float32)
            mm = tl.load(M + rows[:, None] * smm + cols[None, :] * smn, mask=mask, other=0.0).to(tl.float32)
            c = tl.load(C + cols, mask=cols < n, other=0.0)
            v = (beta * mm + (1 - beta) * g) * c[None, :]
            acc += tl.sum(v * v, axis=1)
        r = tl.load(R + rows, mask=rmask, other=0.0)
        r = r / (r * tl.sqrt(acc) + eps)
        tl.store(R + rows, r, mask=rmask)
        for n0 in range(0, n, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            mask = rmask[:, None] & (cols[None, :] < n)
            g = tl.load(G + rows[:, None] * sgm + cols[None, :] * sgn, mask=mask, other=0.0).to(tl.float32)
            mm = tl.load(M + rows[:, None] * smm + cols[None, :] * smn, mask=mask, other=0.0).to(tl.float32)
            u = r[:, None] * (beta * mm + (1 - beta) * g)
            if LAST:
                c = tl.load(C + cols, mask=cols < n, other=0.0)
                wp = W + rows[:, None] * swm + cols[None, :] * swn
                w = tl.load(wp, mask=mask, other=0.0).to(tl.float32)
                tl.store(wp, (w - scale * u * c[None, :]).to(W.dtype.element_ty), mask=mask)
            else:
                tl.atomic_add(T + cols, tl.sum(u * u, axis=0), mask=cols < n)


@torch.no_grad()
def sinkhorn_update_triton(W: torch.Tensor, G: torch.Tensor, M: torch.Tensor, lr: float, beta: float,
                           num_steps: int, tau: float, eps: float, gamma: float, row_group=None) -> None:
    _check_steps(num_steps)
    m, n = W.shape
    dev = W.device
    rho = torch.empty(m, dtype=torch.float32, device=dev)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]),)

    launch(_momentum_rownorm_kernel, grid, G, M, rho, m, n, *G.stride(), *M.stride(), beta)
    r = (rho > tau * _row_mean(rho, row_group)).float()
    c = torch.ones(n, dtype=torch.float32, device=dev)
    t = torch.zeros(n, dtype=torch.float32, device=dev)
    scale = gamma * lr * math.sqrt(n)
    for step in range(1, num_steps + 1, 2):
        last = step == num_steps
        t.zero_()
        launch(_row_pass_kernel, grid, G, M, W, r, c, t, m, n, *G.stride(), *M.stride(), *W.stride(), beta, eps,
               scale, LAST=last)
        if not last:
            _sum_over_shards(t, row_group)
            c = c / (c * t.sqrt() + eps)


@torch.no_grad()
def sinkhorn_update_shapes(W: torch.Tensor, num_steps: int, row_group=None) -> None:
    """What the fused path allocates (row vectors rho and r, column vectors c and t, the column
    all-reduces), without the passes over the table: for fake tensors (the memory estimator,
    train/estimate.py), which have no values to update and on which the chunked reference would run
    thousands of operators per table for nothing."""
    _check_steps(num_steps)
    m, n = W.shape
    rho = torch.empty(m, dtype=torch.float32, device=W.device)
    r = (rho > _row_mean(rho, row_group)).float()
    c = torch.ones(n, dtype=torch.float32, device=W.device)
    t = _sum_over_shards(torch.zeros(n, dtype=torch.float32, device=W.device), row_group)
    del r, c, t


def sinkhorn_update(W, G, M, lr, beta, num_steps, tau, eps, gamma, triton: bool | None = None,
                    chunk_elems: int = 1 << 18, row_group=None) -> None:
    if use_triton(W, triton) and W.shape[0]:  # fake tensors: only while the compile gate records launches
        sinkhorn_update_triton(W, G, M, lr, beta, num_steps, tau, eps, gamma, row_group)
    elif is_fake(W):
        sinkhorn_update_shapes(W, num_steps, row_group)
    else:
        sinkhorn_update_reference(W, G, M, lr, beta, num_steps, tau, eps, gamma, chunk_elems, row_group)


class SinkhornBalanced(GroupwiseOptimizer):
    """Algorithm 1 per 2-D parameter; no weight decay; one momentum buffer per parameter.
    `row_group_of(param)`: the process group a row-sharded table is split over (None: whole here).
    ZeRO-1 (`zero_of(param)` -> `parallel.zero.Ownership` of row blocks over the replica group): each
    rank updates its row block as a row shard of the table (momentum for those rows only, column
    statistics all-reduced over the group), then every block is broadcast from its owner."""

    def __init__(self, params, lr: float = 2.6e-4, momentum: float = 0.95, num_steps: int = 11,
                 tau: float = 1e-3, eps: float = 1e-20, gamma: float = 0.18, use_triton: bool | None = None,
                 chunk_elems: int = 1 << 18, row_group_of=None, zero_of=None):
        _check_steps(num_steps)
        if lr < 0 or not 0 <= momentum < 1:
            raise ValueError(f"SinkhornBalanced: invalid lr={lr} or momentum={momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, num_steps=num_steps, tau=tau, eps=eps, gamma=gamma))
        self.use_triton, self.chunk_elems = use_triton, chunk_elems
        self.row_group_of = row_group_of
        self.zero_of = zero_of

    def _state_shape(self, p: torch.Tensor) -> tuple:
        return (-1, p.shape[1])

    def _step_group(self, group: dict) -> None:
        works = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.dim() != 2:
                raise ValueError(f"SinkhornBalanced takes [rows, features] matrices, got {tuple(p.shape)}")
            own = self.zero_of(p) if self.zero_of is not None else None
            W, G, row_group = p, p.grad, self.row_group_of(p) if self.row_group_of else None
            if own is not None and own.group is not None:  # ZeRO-1: this rank's row block
                n = p.shape[1]
                piece = own.pieces[own.rank]
                W, G, row_group = p[piece.start // n:piece.end // n], p.grad[piece.start // n:piece.end // n], own.group
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(W, memory_format=torch.contiguous_format)
            sinkhorn_update(W, G, state["momentum_buffer"], group["lr"], group["momentum"],
                            group["num_steps"], group["tau"], group["eps"], group["gamma"], self.use_triton,
                            self.chunk_elems, row_group)
            if own is not None and own.group is not None:
                works += [dist.broadcast(p.view(-1)[q.start:q.end], group=own.group, group_src=q.owner,
                                         async_op=True) for q in own.pieces if q.numel]
        for w in works:
            w.wait()
