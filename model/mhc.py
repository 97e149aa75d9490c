"""Single-pass manifold-constrained hyper-connections (mHC), V41_SPEC §3.

The residual state is X in R^{4 x D} per token. Each block has two sites (attention, FFN); a site owns
`fn` [24, 4D], `base` [24] and `scale` [3] (fp32). From X it derives
    m    = (flatten(X) . fn^T) * rsqrt(mean(X^2) + eps)          one RMS statistic per token
    pre  = sigmoid(m[0:4]  * scale[0] + base[0:4]) + hc_eps       A: collapse weights
    post = 2 * sigmoid(m[4:8] * scale[1] + base[4:8])             C: expansion weights
    comb = Sinkhorn(row-softmax(m[8:24].view(4,4) * scale[2] + base[8:24]) + hc_eps)   B
and the sublayer update is X'_j = C_j * F(input) + sum_i B_ij X_i.

Single-pass shift: the `pre` a site computes is consumed by the *next* sublayer (the attention site
of block l uses the FFN site's pre of block l-1, the FFN site uses its own block's attention-site
pre); the first block starts from one-hot on stream 0 and the output collapse uses the last pending
pre. The functions here are the plain-PyTorch references; with `use_triton` (model/kernels/select.py:
None = on CUDA) `hc_mixes`, `hc_collapse` and `hc_expand` run the fused Triton kernels of
model/kernels/mhc.py instead (one kernel per site for the mixes, the 20 Sinkhorn rounds in registers).
"""

from __future__ import annotations

import torch

from flashtrain.model.kernels.mhc import hc_collapse_triton, hc_expand_triton, hc_mixes_triton
from flashtrain.model.kernels.select import use_triton as _use_triton


def hc_split_sinkhorn_reference(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                                hc_mult: int, iters: int, eps: float):
    """mixes [..., (2+n)n] fp32 -> pre [..., n], post [..., n], comb [..., n, n] (doubly stochastic).

    comb: row softmax (+eps), one column normalisation, then `iters - 1` rounds of (row, column)
    normalisation, each dividing by (sum + eps) -- the order of the public kernel.
    """
    n = hc_mult
    pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    comb = comb.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             norm_eps: float, hc_eps: float, iters: int, use_triton: bool | None = False):
    """h [B, S, n, D] -> (pre, post, comb) for one site."""
    if _use_triton(h, use_triton):
        return hc_mixes_triton(h, fn, scale, base, norm_eps, hc_eps, iters)
    x = h.flatten(2).float()
    rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(x, fn.float()) * rsqrt
    return hc_split_sinkhorn_reference(mixes, scale.float(), base.float(), h.shape[2], iters, hc_eps)


def hc_collapse(h: torch.Tensor, pre: torch.Tensor, use_triton: bool | None = False) -> torch.Tensor:
    """sum_i A_i X_i: [B, S, n, D] x [B, S, n] -> [B, S, D]."""
    if _use_triton(h, use_triton):
        return hc_collapse_triton(h, pre)
    return (pre.unsqueeze(-1) * h.float()).sum(dim=2).to(h.dtype)


def hc_expand(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
              use_triton: bool | None = False) -> torch.Tensor:
    """X'_j = C_j y + sum_i B_ij X_i: y [B, S, D], h [B, S, n, D] -> [B, S, n, D]."""
    if _use_triton(h, use_triton):
        return hc_expand_triton(y, h, post, comb)
    mixed = torch.einsum("bsij,bsid->bsjd", comb, h.float())
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(h.dtype)


def one_hot_pre(h: torch.Tensor) -> torch.Tensor:
    """The first block's pending pre: one-hot on stream 0."""
    pre = h.new_zeros(h.shape[0], h.shape[1], h.shape[2], dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre
