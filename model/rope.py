"""Rotary position embedding on the last `rope_head_dim` channels, pairs = adjacent channels (V41_SPEC §1).

Ratio-0 (SWA-only) layers use `rope_theta` without YaRN; every compressing layer uses
`compress_rope_theta` with YaRN (factor, original length, beta_fast/beta_slow, no mscale), following
the public inference code's `precompute_freqs_cis`. The same rotation applies to queries, the window
KV, compressed KV (at group position j*m) and the indexer's q/k; the attention output gets the inverse
rotation at the query position.
"""

from __future__ import annotations

import math

import torch


def rope_frequencies(rot_dim: int, theta: float, original_seq_len: int = 0, factor: float = 1.0,
                     beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """Angular frequency of each of the rot_dim/2 channel pairs, YaRN-corrected when original_seq_len > 0.

    float32 throughout, operation for operation as the public `precompute_freqs_cis`, so a model trained
    here sees the rotations the official inference code applies (float64 here would differ in the last bits
    of the frequencies, and through them by up to 2e-2 in cos/sin at 1M positions)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    if original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:
            return rot_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rot_dim - 1)
        ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp  # 1: unchanged (high frequency), 0: fully interpolated (divided by factor)
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


def rope_angles(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [*positions.shape, rot_dim/2] for integer positions: the angle is the float32 product
    of the position and the float32 frequency, and cos/sin are taken of that float32 angle, as the public
    code's `torch.outer(arange, freqs)` + `torch.polar` do."""
    ang = positions.to(torch.float32).unsqueeze(-1) * freqs.to(positions.device, torch.float32)
    rot = torch.polar(torch.ones_like(ang), ang)  # not ang.cos(): the vectorised cos differs in the last bit
    return rot.real.contiguous(), rot.imag.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*cos.shape[-1] channels of x (out of place, fp32 math).

    x: [B, S, D] or [B, S, H, D]; cos/sin: [S, R/2], shared by the batch (and the heads).
    """
    rd = cos.shape[-1] * 2
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    nope, rot = x[..., :-rd], x[..., -rd:].float()
    a, b = rot[..., 0::2], rot[..., 1::2]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((nope, rot), dim=-1)
