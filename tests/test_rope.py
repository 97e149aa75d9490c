"""RoPE (V41_SPEC §1, model/rope.py) against scalar complex arithmetic written from the spec: the last
`rope_head_dim` channels rotate as adjacent pairs (x[2i] + i x[2i+1]) by e^{i p f_i}, the first channels
are untouched, the inverse rotates by e^{-i p f_i}; YaRN frequencies follow the public
`precompute_freqs_cis` formula. Also the attention's inverse rotation of its output, through a layer whose
output would depend on the position if the inverse were wrong."""

import cmath
import dataclasses
import math

import pytest
import torch

from flashtrain.model.rope import apply_rope, rope_angles, rope_frequencies


def literal_frequencies(rot_dim, theta, original_seq_len=0, factor=1.0, beta_fast=32.0, beta_slow=1.0):
    """One pair at a time, in Python floats."""
    freqs = [theta ** (-(2 * i) / rot_dim) for i in range(rot_dim // 2)]
    if not original_seq_len:
        return freqs

    def dim_for(rotations):  # the pair index whose wavelength fits `rotations` times into original_seq_len
        return rot_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), rot_dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep f, 1: f / factor
        out.append(f / factor * ramp + f * (1 - ramp))
    return out


def literal_rope(x, positions, freqs, inverse=False):
    """x [S, H, D] (float64 list math): rotate the last 2 len(freqs) channels pairwise."""
    S, H, D = x.shape
    rd = 2 * len(freqs)
    out = x.clone().double()
    for s in range(S):
        for h in range(H):
            for i, f in enumerate(freqs):
                c = D - rd + 2 * i
                z = complex(x[s, h, c].item(), x[s, h, c + 1].item())
                z *= cmath.exp((-1j if inverse else 1j) * positions[s] * f)
                out[s, h, c], out[s, h, c + 1] = z.real, z.imag
    return out


def test_plain_frequencies_by_hand():
    f = rope_frequencies(8, 10000.0)
    torch.testing.assert_close(f, torch.tensor([1.0, 0.1, 0.01, 0.001]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("rot_dim, theta", [(64, 160000.0), (16, 160000.0), (64, 10000.0)])
def test_yarn_frequencies_follow_the_published_ramp(rot_dim, theta):
    got = rope_frequencies(rot_dim, theta, original_seq_len=65536, factor=16.0, beta_fast=32.0, beta_slow=1.0)
    want = torch.tensor(literal_frequencies(rot_dim, theta, 65536, 16.0, 32.0, 1.0), dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    plain = torch.tensor(literal_frequencies(rot_dim, theta))
    # the highest frequency is kept, the lowest is interpolated, and some pair lies on the ramp in between
    ratio = got / plain.float()
    assert ratio[0] == pytest.approx(1.0, rel=1e-6) and ratio[-1] < 0.5
    assert ((ratio < 0.999) & (ratio > 1 / 16 + 1e-3)).any()


@pytest.mark.parametrize("shape", [(7, 3, 12), (5, 1, 8)])
def test_last_channels_rotate_as_adjacent_pairs(shape):
    S, H, D = shape
    rd = 6 if D == 12 else 8
    torch.manual_seed(0)
    x = torch.randn(1, S, H, D)
    freqs = rope_frequencies(rd, 37.0)  # a small theta: every pair turns visibly
    positions = torch.tensor([0, 3, 1, 100, 7, 2, 5][:S])
    cos, sin = rope_angles(freqs, positions)
    got = apply_rope(x, cos, sin)
    want = literal_rope(x[0], positions.tolist(), freqs.double().tolist())
    torch.testing.assert_close(got[0].double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[..., :D - rd], x[..., :D - rd])  # the first channels are untouched
    back = apply_rope(got, cos, sin, inverse=True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rope(x, cos, sin, inverse=True)[0].double(),
                               literal_rope(x[0], positions.tolist(), freqs.double().tolist(), inverse=True),
                               atol=1e-5, rtol=1e-5)
    # [B, S, D] (the shared KV) rotates like one head
    torch.testing.assert_close(apply_rope(x[:, :, 0], cos, sin), got[:, :, 0])


def test_attention_output_gets_the_inverse_rotation_at_the_query_position(tiny_cfg):
    """A SWA layer with window 1 and a sink at -inf attends only to its own position, so each head's
    output is the query position's own RoPE'd KV; the inverse rotation at that position must give back
    the un-rotated kv_norm(wkv(x)), and the layer output is then wo_b(block-diagonal wo_a(...)) of it,
    independent of the position. A missing, doubled or misplaced inverse rotation breaks this."""
    from flashtrain.model.attention import Attention, SharedKV
    from flashtrain.model.layer_plan import layer_plan

    cfg = dataclasses.replace(tiny_cfg, window_size=1)
    role = layer_plan(cfg)[0]
    assert role.compress_ratio == 0
    torch.manual_seed(0)
    attn = Attention(cfg, role)
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
        attn.attn_sink.fill_(float("-inf"))
        attn.rope_freqs.copy_(rope_frequencies(cfg.rope_head_dim, 7.0))  # strong rotation at every position
    S = 9
    x = torch.randn(1, S, cfg.dim)
    with torch.no_grad():
        out = attn(x, SharedKV())
        latent = attn.kv_norm(attn.wkv(x))  # [1, S, head_dim], no rotation
        per_head = latent.unsqueeze(2).expand(1, S, cfg.n_heads, cfg.head_dim).reshape(1, S, cfg.o_groups, -1)
        wo_a = attn.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)
        grouped = torch.stack([per_head[:, :, g] @ wo_a[g].T for g in range(cfg.o_groups)], dim=2)
        want = attn.wo_b(grouped.flatten(2))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_angles_are_float32_products_as_in_the_public_code():
    """Divergence (c) of issue 16: the public `precompute_freqs_cis` multiplies the position by the float32
    frequency in float32 (`torch.outer(arange, freqs)`) and takes cos/sin of that float32 angle. At 1M
    positions this differs from a float64 angle by ~1e-2, so training must use the float32 angle."""
    import numpy as np

    freqs = rope_frequencies(64, 160000.0, 65536, 16.0, 32.0, 1.0)
    positions = torch.tensor([0, 1, 777, 65535, 65536, 1_000_003, (1 << 20) - 1])
    cos, sin = rope_angles(freqs, positions)
    f32 = freqs.numpy().astype(np.float32)
    for row, p in enumerate(positions.tolist()):
        angle = np.float32(p) * f32  # float32 x float32 -> float32, rounded once
        assert angle.dtype == np.float32
        want_cos = np.cos(angle.astype(np.float64))  # exact cos of the float32 angle, then compared at fp32 ulp
        want_sin = np.sin(angle.astype(np.float64))
        np.testing.assert_allclose(cos[row].double().numpy(), want_cos, rtol=0, atol=3e-7)
        np.testing.assert_allclose(sin[row].double().numpy(), want_sin, rtol=0, atol=3e-7)
    # the test can tell the two apart: float64 angles at 1M positions are far from the float32 ones
    exact = np.cos(np.float64(1_000_003) * f32.astype(np.float64))
    assert np.abs(exact - cos[5].double().numpy()).max() > 1e-3
