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
applying) in the Triton kernels; (K + 1) / 2 on the reference path, whose first pass also gathers row step
1's column statistic (row step 1's s is rho itself).

A column whose statistic is 0 (its unmasked entries all 0) keeps scale 0: Algorithm 1 leaves it 0, while
c_j / (0 + eps) would grow by 1/eps a column step to inf and turn the column into nan.

Row-sharded tables (`row_group`: the process group over which a table's rows are split, each rank
holding a slice): the row statistics are per row and stay local; the mean of rho and the column
statistics t are all-reduced over the group (one tiny all-reduce per column step), so every shard sees
the whole table's column scales -- the same update as on the unsharded table. Under ZeRO-1 each rank
updates its row block that way and the optimizer then broadcasts every block from its owner; these
exchanges are the optimizer's own, over the groups it is given (train/optim/__init__.py).

`sinkhorn_update_reference` is the plain-PyTorch path (rows in chunks, so its workspace is
chunk x n, never m x n; its row and column statistics are matrix-vector products on the chunk's G^ o G^, and
by default the optimizer lets it keep G^ in the gradient it consumes, so that a pass reads one m x n
tensor, not two: docs/kernels.md "The optimizer split's cost"); `sinkhorn_update_triton` fuses each pass
into one kernel.
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


# The squared path forms r_i^2 and c_j^2 (below); it runs while both stay far inside fp32's range: the unmasked
# rows' norms >= this and the column scales <= its inverse. Otherwise the update runs again from the row mask
# on with the scaled values themselves (`_scaled_passes`, which squares no scale, as the literal algorithm)
_SQUARED_FLOOR = 1e-15


def _column_step(c: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """c_j <- c_j / (||U_:j|| + eps), given the column norms ||U_:j|| = c_j sqrt(t_j). A column of norm 0 (its
    unmasked entries all 0) gets scale 0, which leaves U's column 0 as Algorithm 1 does; c_j / eps instead
    would grow by 1/eps a step to inf, and inf * 0 is nan."""
    return torch.where(norm > 0, c / (norm + eps), 0.0)


class _Rows:
    """G^ by row chunks into one fp32 chunk buffer. Consuming (fp32 G and M): the first pass leaves G^ in G
    itself, so later passes read one m x n tensor instead of two and recompute nothing."""

    def __init__(self, G: torch.Tensor, M: torch.Tensor, beta: float, rows: int, consume: bool):
        self.G, self.M, self.beta = G, M, beta
        self.consume = consume and G.dtype == M.dtype == torch.float32
        self.buf = torch.empty(rows, G.shape[1], dtype=torch.float32, device=G.device)

    def momentum(self, a: int, b: int) -> torch.Tensor:
        """M <- beta M + (1 - beta) G on rows a:b; returns S = G^ o G^ (in the buffer)."""
        G, M = self.G[a:b], self.M[a:b]
        M.lerp_(G.to(M.dtype), 1 - self.beta)
        if self.consume:
            return torch.mul(G.lerp_(M, self.beta), G, out=self.buf[:b - a])
        return self.ghat(a, b).square_()

    def ghat(self, a: int, b: int) -> torch.Tensor:  # G^ rows a:b, in the buffer
        if self.consume:
            return self.buf[:b - a].copy_(self.G[a:b])
        G, M = self.G[a:b], self.M[a:b]
        if G.dtype != torch.float32 or M.dtype != torch.float32:
            G, M = G.float(), M.float()
        return torch.lerp(G, M, self.beta, out=self.buf[:b - a])

    def squares(self, a: int, b: int) -> torch.Tensor:  # G^ o G^
        if self.consume:
            return torch.mul(self.G[a:b], self.G[a:b], out=self.buf[:b - a])
        return self.ghat(a, b).square_()

    def scaled(self, a: int, b: int, c: torch.Tensor) -> torch.Tensor:  # G^ diag(c)
        if self.consume:
            return torch.mul(self.G[a:b], c, out=self.buf[:b - a])
        return self.ghat(a, b).mul_(c)

    def gather(self, idx: torch.Tensor) -> torch.Tensor:  # G^ of some rows, a new tensor
        if self.consume:
            return self.G[idx]
        return torch.lerp(self.G[idx].float(), self.M[idx].float(), self.beta)


@torch.no_grad()
def sinkhorn_update_reference(W: torch.Tensor, G: torch.Tensor, M: torch.Tensor, lr: float, beta: float,
                              num_steps: int, tau: float, eps: float, gamma: float,
                              chunk_elems: int = 1 << 18, row_group=None, consume_grad: bool = False) -> None:
    """In place: M <- momentum, W <- W - gamma lr sqrt(n) U (Algorithm 1). `consume_grad` (fp32 G and M): G is
    left holding G^ (the first pass writes it there; the later passes read it instead of G and M).

    Rows in chunks of `chunk_elems` elements, one fp32 chunk buffer reused by every pass. With S = G^ o G^
    (element-wise), a row step's norms are a matrix-vector product, s_i^2 = (S c^2)_i, and the column
    statistic that follows another one on the same chunk of S while it is in cache, t_j = ((r^2)^T S)_j
    (BLAS gemv). The first pass (momentum, rho) also accumulates the statistic of row step 1, whose s is rho
    itself (c = 1), with the row mask of the rows seen so far (tau times their running mean), then corrects
    it row by row where the whole table's mask disagrees: K normalisations take 1 + (K - 1) / 2 passes. Off the
    host (`_decides_on_host`) it runs the literal passes on scaled values instead, 1 + (K + 1) / 2 of them."""
    _check_steps(num_steps)
    m, n = W.shape
    dev, f32 = W.device, torch.float32
    squared = num_steps > 1 and _decides_on_host(W)
    rows = max(1, min(m, chunk_elems // max(n, 1)))
    spans = [(a, min(m, a + rows)) for a in range(0, m, rows)]
    data = _Rows(G, M, beta, rows, consume_grad)
    rho = torch.empty(m, dtype=f32, device=dev)
    seen = torch.empty(m, dtype=torch.bool, device=dev)  # the rows the running mask counted in t
    x = torch.empty(m, dtype=f32, device=dev)  # per-row scratch: their weights in t, then s
    t = torch.zeros(n, dtype=f32, device=dev)
    total = torch.zeros((), dtype=f32, device=dev)
    for a, b in spans:
        S = data.momentum(a, b)
        rc = torch.sum(S, 1, out=rho[a:b]).sqrt_()
        if squared:
            total += rc.sum()
            sc = torch.gt(rc, (total * (tau / b)).clamp_min_(_SQUARED_FLOOR), out=seen[a:b])
            t.addmv_(S.T, torch.div(sc, torch.add(rc, eps, out=x[a:b]), out=x[a:b]).square_())
    mean = _row_mean(rho, row_group)
    keep = rho > tau * mean
    r = keep.float()  # masked rows: r_i = 0 keeps them 0 forever
    if squared and tau * float(mean) >= _SQUARED_FLOOR:
        wrong = (keep != seen).nonzero().squeeze(1)
        if wrong.numel():  # rows the running mask counted wrongly: add or take back their share of t
            t.addmv_(data.gather(wrong).square_().T,
                     (rho[wrong] + eps).reciprocal().square_().mul_(keep[wrong].float() * 2 - 1))
        r.div_(r * rho + eps)  # row step 1: s = rho
        c = _column_step(torch.ones(n, dtype=f32, device=dev), _sum_over_shards(t, row_group).sqrt(), eps)
        if _squared_passes(W, data, spans, r, c, x, t, lr, num_steps, eps, gamma, row_group):
            return
        r = keep.float()  # a column scale left the squared path's range: again from the mask, scaled
    _scaled_passes(W, data, spans, r, lr, num_steps, eps, gamma, row_group)


def _decides_on_host(W: torch.Tensor) -> bool:
    """The squared path picks its rows to correct and its range by reading values (`nonzero`, `float`): free
    where the table lives on the host, a device synchronisation each elsewhere. On an accelerator (where the
    Triton path is the norm) the reference runs the literal passes, which read nothing back
    (tests/test_host_syncs.py)."""
    return W.device.type == "cpu"


def _squared_passes(W, data: _Rows, spans, r, c, s, t, lr, num_steps, eps, gamma, row_group) -> bool:
    """Row steps 3..K after row step 1 and column step 2, one pass each, the last applying the update. False
    (nothing applied) when a column scale leaves the squared path's range."""
    scale = gamma * lr * math.sqrt(W.shape[1])
    for step in range(3, num_steps + 1, 2):
        if float(c.max()) > 1 / _SQUARED_FLOOR:
            return False
        if step == num_steps:
            for a, b in spans:
                u, rc = data.scaled(a, b, c), r[a:b]
                rc.div_(torch.linalg.vector_norm(u, dim=1, out=s[a:b]).mul_(rc).add_(eps))
                W[a:b].addcmul_(u, rc[:, None], value=-scale)
            return True
        c2 = c * c
        t.zero_()
        for a, b in spans:
            S, rc, sc = data.squares(a, b), r[a:b], s[a:b]
            rc.div_(torch.mv(S, c2, out=sc).sqrt_().mul_(rc).add_(eps))
            t.addmv_(S.T, torch.mul(rc, rc, out=sc))
        c = _column_step(c, c * _sum_over_shards(t, row_group).sqrt(), eps)
    return True


def _scaled_passes(W, data: _Rows, spans, r, lr, num_steps, eps, gamma, row_group) -> None:
    """All K normalisations from the row mask on, a pass per row step, on the scaled values r_i G^_ij c_j
    themselves (never r^2 or c^2): for tables whose norms lie far below fp32's normal range."""
    n = W.shape[1]
    c = torch.ones(n, dtype=torch.float32, device=W.device)
    scale = gamma * lr * math.sqrt(n)
    for step in range(1, num_steps + 1, 2):
        last = step == num_steps
        t = torch.zeros(n, dtype=torch.float32, device=W.device)
        for a, b in spans:
            u, rc = data.scaled(a, b, c), r[a:b]
            rc.div_(torch.linalg.vector_norm(u, dim=1).mul_(rc).add_(eps))
            if last:
                W[a:b].addcmul_(u, rc[:, None], value=-scale)
            else:
                t += u.mul_(rc[:, None]).square_().sum(0)  # ||U_:j||^2
        if not last:
            c = _column_step(c, _sum_over_shards(t, row_group).sqrt(), eps)


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
            c = _column_step(c, c * t.sqrt(), eps)


@torch.no_grad()
def sinkhorn_update_shapes(W: torch.Tensor, num_steps: int, row_group=None) -> None:
    """What the fused path allocates (row vectors rho and r, column vectors c and t, the column
    all-reduces), without the passes over the table: for fake tensors (the memory estimator,
    train/plan/estimate.py), which have no values to update and on which the chunked reference would run
    thousands of operators per table for nothing."""
    _check_steps(num_steps)
    m, n = W.shape
    rho = torch.empty(m, dtype=torch.float32, device=W.device)
    r = (rho > _row_mean(rho, row_group)).float()
    c = torch.ones(n, dtype=torch.float32, device=W.device)
    t = _sum_over_shards(torch.zeros(n, dtype=torch.float32, device=W.device), row_group)
    del r, c, t


def sinkhorn_update(W, G, M, lr, beta, num_steps, tau, eps, gamma, triton: bool | None = None,
                    chunk_elems: int = 1 << 18, row_group=None, consume_grad: bool = False) -> None:
    if use_triton(W, triton) and W.shape[0]:  # fake tensors: only while the compile gate records launches
        sinkhorn_update_triton(W, G, M, lr, beta, num_steps, tau, eps, gamma, row_group)
    elif is_fake(W):
        sinkhorn_update_shapes(W, num_steps, row_group)
    else:
        sinkhorn_update_reference(W, G, M, lr, beta, num_steps, tau, eps, gamma, chunk_elems, row_group, consume_grad)


class SinkhornBalanced(GroupwiseOptimizer):
    ZERO_SPLIT = "rows"  # ZeRO-1 pieces of whole rows (the row-sharded update)
    STATE_BUFFERS = 1  # momentum

    """Algorithm 1 per 2-D parameter; no weight decay; one momentum buffer per parameter.
    `row_group_of(param)`: the process group a row-sharded table is split over (None: whole here).
    ZeRO-1 (`zero_of(param)` -> `parallel.zero.Ownership` of row blocks over the replica group): each
    rank updates its row block as a row shard of the table (momentum for those rows only, column
    statistics all-reduced over the group), then every block is broadcast from its owner.
    `consume_grad` (default): the step may use `p.grad` as its workspace -- on the reference path (CPU) an fp32
    gradient holds G^ afterwards, which saves re-reading G and M in every pass (docs/kernels.md "The optimizer
    split's cost"); the Triton path leaves it as it was. The trainer reads no gradient after the step (the next
    step zeroes them); `consume_grad=False` leaves every gradient as it came."""

    def __init__(self, params, lr: float = 2.6e-4, momentum: float = 0.95, num_steps: int = 11,
                 tau: float = 1e-3, eps: float = 1e-20, gamma: float = 0.18, use_triton: bool | None = None,
                 chunk_elems: int = 1 << 18, row_group_of=None, zero_of=None, consume_grad: bool = True):
        _check_steps(num_steps)
        if lr < 0 or not 0 <= momentum < 1:
            raise ValueError(f"SinkhornBalanced: invalid lr={lr} or momentum={momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, num_steps=num_steps, tau=tau, eps=eps, gamma=gamma))
        self.use_triton, self.chunk_elems, self.consume_grad = use_triton, chunk_elems, consume_grad
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
                            self.chunk_elems, row_group, self.consume_grad)
            if own is not None and own.group is not None:
                works += [dist.broadcast(p.view(-1)[q.start:q.end], group=own.group, group_src=q.owner,
                                         async_op=True) for q in own.pieces if q.numel]
        for w in works:
            w.wait()
