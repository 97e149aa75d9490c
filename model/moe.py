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

Also here: the sequence-wise balance loss L = alpha * sum_i f_i P_i (per sequence, averaged over the
batch) and the per-modality expert load counts for the trainer's bias update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from model.aux import StepStats, attach_aux_loss
from model.config import ModelConfig
from model.sequence_split import SequenceSplit


def balanced_split(total: int, parts: int) -> list[int]:
    """`total` items over `parts` as evenly as possible (the first ones get the remainder)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def expert_counts(flat_indices: torch.Tensor, n_experts: int) -> list[int]:
    """(token, expert) pairs per expert. A fake tensor (the memory estimator, train/estimate.py) has no
    values: it gets the balanced split that the bias update steers routing towards."""
    if is_fake(flat_indices):
        return balanced_split(flat_indices.numel(), n_experts)
    return torch.bincount(flat_indices, minlength=n_experts).tolist()


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit), in fp32 (limit <= 0 disables the clamps)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.topk = cfg.n_activated_experts
        self.route_scale = cfg.route_scale
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.register_buffer("bias_vl", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def reset_buffers(self) -> None:
        """Selection biases start at 0 (model/init.py; a checkpoint then loads the trained ones)."""
        self.bias.zero_()
        self.bias_vl.zero_()

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None):
        """x [N, D], image_mask [N] bool -> (scores [N, E] fp32, weights [N, k] fp32, indices [N, k])."""
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()
        bias = self.bias if image_mask is None else torch.where(image_mask.unsqueeze(-1), self.bias_vl, self.bias)
        with torch.no_grad():
            indices = (scores + bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.route_scale, indices


class RoutedExperts(nn.Module):
    """Stacked SwiGLU experts. Whole ([E, ...], dispatched locally: the ep=1 reference path) or, under
    expert parallelism, this rank's slice [E / ep, ...] of global experts [offset, offset + E / ep),
    with `dispatcher` (parallel/experts.py) moving tokens to the rank that holds their expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
        self.limit = cfg.swiglu_limit
        self.n_global = E
        self.offset = 0  # global index of local expert 0
        self.dispatcher = None
        self.w1 = nn.Parameter(torch.empty(E, I, D))
        self.w2 = nn.Parameter(torch.empty(E, D, I))
        self.w3 = nn.Parameter(torch.empty(E, I, D))

    def local_experts(self, xs: torch.Tensor, ws: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by local expert (`counts[e]` rows for expert e, in order) with their routing
        weights [n] -> the weighted expert outputs [n, D] (the weight multiplies before w2)."""
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                xe = xs[start:start + n]
                act = swiglu_clamped(xe @ self.w1[e].t(), xe @ self.w3[e].t(), self.limit) * ws[start:start + n, None]
                outs.append(act.to(xs.dtype) @ self.w2[e].t())
            start += n
        return torch.cat(outs) if outs else xs.new_zeros(0, self.w2.shape[1])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [N, D], weights/indices [N, k] (global expert ids) -> fp32 [N, D] = sum_k w_k * expert_{i_k}(x)."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x, weights, indices)
        flat = indices.flatten()
        order = flat.argsort(stable=True)
        token = order // indices.shape[1]
        counts = expert_counts(flat, self.w1.shape[0])
        ys = self.local_experts(x[token], weights.flatten()[order], counts)  # tokens grouped by expert
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add(0, token, ys.float())


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.w1 = nn.Linear(cfg.dim, cfg.moe_inter_dim, bias=False)
        self.w2 = nn.Linear(cfg.moe_inter_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.moe_inter_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu_clamped(self.w1(x), self.w3(x), self.limit).to(x.dtype))


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, n_experts: int,
                          split: SequenceSplit | None = None) -> torch.Tensor:
    """Unweighted sum_i f_i P_i per sequence, averaged over sequences.

    scores [B, T, E] (unbiased gate scores), indices [B, T, k] (selected experts);
    f_i = E / (k T) * #{t : i in topk(t)},  P_i = (1/T) sum_t s_it / sum_j s_jt.
    Under context parallelism (`split`) the T tokens here are this rank's part of each sequence: the
    selection counts are summed over the split (f has no gradient) and P is this rank's share of the
    sum over the whole sequence, so the ranks' values add up to the loss.
    """
    B, T, k = indices.shape
    sel = torch.zeros(B, n_experts, dtype=torch.float32, device=scores.device)
    sel.scatter_add_(1, indices.reshape(B, -1), torch.ones(B, T * k, device=scores.device))
    if split is not None:
        sel, T = split.sum(sel), split.seq_len
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
                aux_grad_scale: float = 1.0, split: SequenceSplit | None = None) -> torch.Tensor:
        B, S, D = x.shape
        flat = x.reshape(-1, D)
        flat_mask = None if image_mask is None else image_mask.reshape(-1)
        scores, weights, indices = self.gate(flat, flat_mask)
        y = self.experts(flat, weights, indices)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat).float()
        y = y.to(x.dtype).view(B, S, D)

        if stats is not None:
            with torch.no_grad():  # row 0 text, row 1 image; fixed shapes (no boolean indexing)
                row = torch.zeros_like(indices) if flat_mask is None else flat_mask.long().unsqueeze(-1).expand_as(indices)
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
