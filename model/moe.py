"""DeepSeekMoE with modality-specific balancing biases (V41_SPEC §4).

Gate: s = sqrt(softplus(x . W^T)) in fp32. Experts are *selected* with s + b, where b is `bias_vl`
at image positions and `bias` elsewhere; the routing weights are the *unbiased* s of the selected
experts, normalised to sum 1 (+1e-20) and multiplied by `route_scale`. The biases are buffers: no
optimizer touches them (the trainer's balancing rule does), checkpoints keep them.

Experts are SwiGLU with the up branch clamped to [-limit, limit] and the gate branch clamped above at
limit; the routing weight multiplies before `w2`. Routed experts are stacked [E, ...] tensors
(`experts.w1` [E, inter, dim], `experts.w2` [E, dim, inter], `experts.w3` [E, inter, dim]); the
public checkpoint's per-expert `experts.{j}.w1.weight` is row j of the stack. Output = routed sum +
shared expert, accumulated in fp32.

Weights (model/formats.py): the routed experts are the release's FP4 weights (on their grid in the forward
under `model.qat.experts_fp4`), the shared expert's are FP8 Linears, the gate's weight is BF16.

Also here: the sequence-wise balance loss L = alpha * sum_i f_i P_i (per sequence, averaged over the
batch) and the per-modality expert load counts for the trainer's bias update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashtrain.model.aux import StepStats, attach_aux_loss
from flashtrain.model.config import ModelConfig
from flashtrain.model.formats import Linear, Stored, as_trained, compute_dtype
from flashtrain.model.sequence_split import SequenceSplit
from flashtrain.model.simulation import simulated


def balanced_split(total: int, parts: int) -> list[int]:
    """`total` items over `parts` as evenly as possible (the first ones get the remainder)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def expert_sizes(flat_indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(token, expert) pairs per expert [E] int32, on the device: a scatter-add, not `bincount` (which
    reads the maximum back to the host on CUDA)."""
    ones = torch.ones_like(flat_indices, dtype=torch.int32)
    return torch.zeros(n_experts, dtype=torch.int32, device=flat_indices.device).scatter_add_(0, flat_indices, ones)


def host_sizes(sizes: torch.Tensor, total: int) -> list[int]:
    """The per-expert row counts of `total` rows as Python ints: a host synchronisation, taken by the
    looped reference path only. A fake tensor (the memory estimator, train/plan/estimate.py) has no values:
    it gets the balanced split that the bias update steers routing towards."""
    if simulated(sizes):
        return balanced_split(total, sizes.shape[0])
    return sizes.tolist()


def grouped_mm_supported(x: torch.Tensor, dtype: torch.dtype, *widths: int) -> bool:
    """`torch._grouped_mm` runs on x in `dtype`: fp32 or bf16 on the CPU, bf16 on CUDA (Hopper and newer)
    and on fake tensors (its shape function's rule), every row stride a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if simulated(x):
        ok = dtype == torch.bfloat16
    elif x.is_cuda:
        ok = dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        ok = dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"
    size = torch.empty((), dtype=dtype).element_size()
    return ok and all(w * size % 16 == 0 for w in widths)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit), in fp32 (limit <= 0 disables the clamps)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


class Gate(nn.Module):
    STORED = {"weight": Stored.BF16}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.topk = cfg.n_activated_experts
        self.route_scale = cfg.route_scale
        self.qat = cfg.qat
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.register_buffer("bias_vl", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def reset_buffers(self) -> None:
        """Selection biases start at 0 (model/init.py; a checkpoint then loads the trained ones)."""
        self.bias.zero_()
        self.bias_vl.zero_()

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None, indices: torch.Tensor | None = None):
        """x [N, D], image_mask [N] bool -> (scores [N, E] fp32, weights [N, k] fp32, indices [N, k]).
        `indices` given (Anticipatory Routing, V41_SPEC §9): the experts are those, not the top-k of
        s + b; the weights are still the current gate's s of those experts."""
        weight = as_trained(self.weight, self.STORED["weight"], self.qat)
        scores = F.softplus(F.linear(x.float(), weight.float())).sqrt()
        if indices is None:
            bias = self.bias if image_mask is None else torch.where(image_mask.unsqueeze(-1), self.bias_vl, self.bias)
            with torch.no_grad():
                indices = (scores + bias).topk(self.topk, dim=-1).indices
        elif indices.shape != (x.shape[0], self.topk):
            raise ValueError(f"cached routing indices have shape {tuple(indices.shape)}; this layer routes "
                             f"{x.shape[0]} tokens to {self.topk} experts each (was the cache made for another batch?)")
        weights = scores.gather(1, indices)
        if self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.route_scale, indices


class RoutedExperts(nn.Module):
    """Stacked SwiGLU experts. Whole ([E, ...], dispatched locally: the ep=1 reference path) or, under
    expert parallelism, this rank's slice [E / ep, ...] of global experts [offset, offset + E / ep),
    with `dispatcher` (parallel/experts.py) moving tokens to the rank that holds their expert.

    Rows sorted by expert run through `torch._grouped_mm` with the group ends as a device tensor: no
    host synchronisation (torchtitan's grouped-GEMM MoE). The looped per-expert reference
    (`model.use_triton=false`, or where grouped GEMM is unavailable) reads the counts to the host. The
    grouped path is the default on the CPU too: it runs the flash_small experts' forward+backward about
    3x faster than the loop (docs/kernels.md)."""

    STORED = {"w1": Stored.FP4, "w2": Stored.FP4, "w3": Stored.FP4}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
        self.limit = cfg.swiglu_limit
        self.n_global = E
        self.offset = 0  # global index of local expert 0
        self.dispatcher = None
        self.grouped = cfg.use_triton is not False
        self.qat = cfg.qat  # experts_fp4: the weights on the release's FP4 grid in the forward (model/formats.py)
        self.w1 = nn.Parameter(torch.empty(E, I, D))
        self.w2 = nn.Parameter(torch.empty(E, D, I))
        self.w3 = nn.Parameter(torch.empty(E, I, D))

    def weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) as the forward computes with them, in `dtype` (default theirs)."""
        return tuple(as_trained(getattr(self, n), self.STORED[n], self.qat, dtype) for n in ("w1", "w2", "w3"))

    def local_experts(self, xs: torch.Tensor, ws: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """Rows grouped by local expert (`sizes[e]` rows for expert e, in order; an int32 device tensor)
        with their routing weights [n] -> the weighted expert outputs [n, D] (the weight multiplies
        before w2)."""
        dtype = compute_dtype(xs)
        if self.grouped and grouped_mm_supported(xs, dtype, *self.w1.shape[1:]):
            if dtype != torch.bfloat16 and torch.compiler.is_compiling():
                return self._grouped_eager(xs, ws, sizes, dtype)
            return self._grouped(xs, ws, sizes, dtype)
        return self._looped(xs, ws, host_sizes(sizes, xs.shape[0]))

    @torch.compiler.disable
    def _grouped_eager(self, xs: torch.Tensor, ws: torch.Tensor, sizes: torch.Tensor, dtype: torch.dtype):
        """The grouped path outside torch.compile (train/compile.py), a graph break: `_grouped_mm`'s shape
        function takes bf16 only, while the CPU kernel runs fp32 too."""
        return self._grouped(xs, ws, sizes, dtype)

    def _grouped(self, xs: torch.Tensor, ws: torch.Tensor, sizes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ends = sizes.cumsum(0, dtype=torch.int32)
        xs = xs.to(dtype)
        w1, w2, w3 = self.weights(dtype)
        gate = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=ends)
        up = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=ends)
        act = (swiglu_clamped(gate, up, self.limit) * ws.unsqueeze(-1)).to(dtype)
        return torch._grouped_mm(act, w2.transpose(-2, -1), offs=ends)

    def _looped(self, xs: torch.Tensor, ws: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs, start = [], 0
        w1, w2, w3 = self.weights()
        for e, n in enumerate(counts):
            if n:
                xe = xs[start:start + n]
                act = swiglu_clamped(xe @ w1[e].t(), xe @ w3[e].t(), self.limit) * ws[start:start + n, None]
                outs.append(act.to(xs.dtype) @ w2[e].t())
            start += n
        return torch.cat(outs) if outs else xs.new_zeros(0, self.w2.shape[1])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [N, D], weights/indices [N, k] (global expert ids) -> fp32 [N, D] = sum_k w_k * expert_{i_k}(x)."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x, weights, indices)
        flat = indices.flatten()
        order = flat.argsort(stable=True)
        token = order // indices.shape[1]
        ys = self.local_experts(x[token], weights.flatten()[order], expert_sizes(flat, self.w1.shape[0]))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add(0, token, ys.float())


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.w1 = Linear(cfg.dim, cfg.moe_inter_dim, cfg, Stored.FP8)
        self.w2 = Linear(cfg.moe_inter_dim, cfg.dim, cfg, Stored.FP8)
        self.w3 = Linear(cfg.dim, cfg.moe_inter_dim, cfg, Stored.FP8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu_clamped(self.w1(x), self.w3(x), self.limit).to(x.dtype))


class DenseFFN(nn.Module):
    """`model.ffn: dense` (the MoE ablation, docs/training.md "What each component buys"): one SwiGLU, clamped
    as the experts are, of the MoE's activated width `cfg.dense_ffn_dim` ((n_activated_experts +
    n_shared_experts) x moe_inter_dim), every token through all of it. No gate, no balance loss, no expert
    loads; the arguments only routing uses are accepted and ignored."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.limit = cfg.swiglu_limit
        self.w1 = Linear(cfg.dim, cfg.dense_ffn_dim, cfg)
        self.w2 = Linear(cfg.dense_ffn_dim, cfg.dim, cfg)
        self.w3 = Linear(cfg.dim, cfg.dense_ffn_dim, cfg)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None, stats: StepStats | None = None,
                aux_grad_scale: float = 1.0, split: SequenceSplit | None = None, routes=None,
                recorded=None) -> torch.Tensor:
        return self.w2(swiglu_clamped(self.w1(x), self.w3(x), self.limit).to(x.dtype))


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, n_experts: int,
                          split: SequenceSplit | None = None) -> torch.Tensor:
    """Unweighted sum_i f_i P_i per sequence, averaged over sequences.

    scores [B, T, E] (unbiased gate scores), indices [B, T, k] (selected experts);
    f_i = E / (k T) * #{t : i in topk(t)},  P_i = (1/T) sum_t s_it / sum_j s_jt.
    Under context parallelism (`split`) the T tokens here are this rank's part of each sequence: the
    selection counts are summed over the split (f has no gradient) and P is this rank's share of the
    sum over the whole sequence, so the ranks' values add up to the loss. (The DSpark drafter routes
    `dspark_block_size` tokens per position: T / split.length of them, model/dspark.py.)
    """
    B, T, k = indices.shape
    sel = torch.zeros(B, n_experts, dtype=torch.float32, device=scores.device)
    sel.scatter_add_(1, indices.reshape(B, -1), torch.ones(B, T * k, device=scores.device))
    if split is not None:
        sel, T = split.sum(sel), split.seq_len * (T // split.length)
    f = sel * n_experts / (k * T)
    p = (scores / scores.sum(-1, keepdim=True)).sum(dim=1) / T
    return (f * p).sum(-1).mean()


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_experts = cfg.n_routed_experts
        self.alpha = cfg.balance_loss_alpha
        self.gate = Gate(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = SharedExpert(cfg) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None, stats: StepStats | None = None,
                aux_grad_scale: float = 1.0, split: SequenceSplit | None = None,
                routes: dict[int, torch.Tensor] | None = None,
                recorded: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """routes: cached routing indices by layer id, used instead of this layer's top-k; recorded: a
        dict this layer's indices [B x S, k] are written into (both Anticipatory Routing,
        train/stability/anticipatory.py)."""
        B, S, D = x.shape
        flat = x.reshape(-1, D)
        flat_mask = None if image_mask is None else image_mask.reshape(-1)
        scores, weights, indices = self.gate(flat, flat_mask, None if routes is None else routes[self.layer_id])
        if recorded is not None:
            recorded[self.layer_id] = indices.detach()
        y = self.experts(flat, weights, indices)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat).float()
        y = y.to(x.dtype).view(B, S, D)

        if stats is not None:
            with torch.no_grad():  # row 0 text, row 1 image; fixed shapes (no boolean indexing)
                row = (torch.zeros_like(indices) if flat_mask is None
                       else flat_mask.long().unsqueeze(-1).expand_as(indices))
                load = torch.zeros(2 * self.n_experts, dtype=torch.long, device=x.device)
                load.index_add_(0, (row * self.n_experts + indices).flatten(), torch.ones_like(indices).flatten())
                load = load.view(2, self.n_experts)
            stats.expert_load[self.layer_id] = load
        if self.alpha > 0 and torch.is_grad_enabled():
            loss = self.alpha * sequence_balance_loss(scores.view(B, S, -1), indices.view(B, S, -1), self.n_experts,
                                                      split)
            if stats is not None:
                stats.balance_loss[self.layer_id] = loss.detach()
            y = attach_aux_loss(y, loss, aux_grad_scale)
        return y
