"""model/quant.py against hand-computed numbers and plain-Python references of the formats.

The references below (`ref_pow2_ceil`, `ref_e4m3`, `ref_e2m1`, `f32`) are written from the format
definitions with Python floats, independently of torch's float8 casts and of the module under test.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from flashtrain.model.quant import (
    E2M1_GRID,
    FP4_MAX,
    FP8_MAX,
    e2m1_decode,
    e2m1_encode,
    e2m1_round,
    fake_quant_fp4,
    fake_quant_fp8,
    fp4_block_dequant,
    fp4_block_quant,
    fp8_block_dequant,
    fp8_block_quant,
    fp8_weight_dequant,
    fp8_weight_quant,
    pack_fp4,
    pow2_ceil,
    unpack_fp4,
)

E8M0_BIAS = 127  # e8m0 byte = log2(scale) + 127
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL = 2.0 ** -6
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # smallest e4m3fn subnormal
E4M3_HALF_ULP_REL = 2.0 ** -4  # half an ulp relative to a normal value (3 mantissa bits)
FP8_AMAX_MIN = 1e-4
FP4_E8M0_AMAX_MIN = FP4_MAX * 2.0 ** -126
FP4_E4M3_AMAX_MIN = FP4_MAX * 2.0 ** -9
KV_BLOCK = 16  # compressed-KV fp4 block (e4m3 scales)


# --------------------------------------------------------------------------------------------------
# independent references (plain Python floats)


def f32(v: float) -> float:
    """Round a Python float to the nearest fp32 (what an fp32 torch op returns)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def ref_pow2_ceil(v: float) -> float:
    """2**ceil(log2(v)) from math.frexp: v = m * 2**e, m in [0.5, 1); m == 0.5 means v is a power of two."""
    m, e = math.frexp(v)
    return 2.0 ** (e - 1) if m == 0.5 else 2.0 ** e


def ref_e4m3(v: float) -> float:
    """Nearest float8_e4m3fn value, ties to even mantissa, saturating at +-448."""
    a = abs(v)
    if a < E4M3_MIN_NORMAL:
        ulp = E4M3_SUBNORMAL_STEP
    else:
        _, e = math.frexp(a)  # a in [2**(e-1), 2**e)
        ulp = 2.0 ** (e - 1 - E4M3_MANTISSA_BITS)
    q = min(round(a / ulp) * ulp, FP8_MAX)  # round() is half-to-even: even multiple = even mantissa
    return math.copysign(q, v)


def ref_e2m1(v: float) -> float:
    """Nearest E2M1 grid value of clamp(v, +-6), ties to the even code."""
    a = min(abs(v), FP4_MAX)
    code = min(range(len(E2M1_GRID)), key=lambda c: (abs(a - E2M1_GRID[c]), c % 2))
    return math.copysign(E2M1_GRID[code], v)


def ref_fp4_scale(amax: float, e4m3: bool) -> float:
    if e4m3:
        return ref_e4m3(f32(max(amax, FP4_E4M3_AMAX_MIN) / FP4_MAX))
    return ref_pow2_ceil(f32(max(amax, FP4_E8M0_AMAX_MIN) / FP4_MAX))


def block_with(values: list[float], block: int) -> torch.Tensor:
    """A [1, block] fp32 row starting with `values`, padded with small distinct values below them."""
    filler = [0.01 * (i % 7) - 0.03 for i in range(block - len(values))]
    return torch.tensor([values + filler], dtype=torch.float32)


def multi_magnitude(lead: tuple[int, ...], n_blocks: int, block: int, spread: int,
                    g: torch.Generator) -> torch.Tensor:
    """randn [*lead, n_blocks * block], each block scaled by its own 2**k, k uniform in [-spread, spread]."""
    k = torch.randint(-spread, spread + 1, (*lead, n_blocks, 1), generator=g).float()
    return (torch.randn(*lead, n_blocks, block, generator=g) * torch.exp2(k)).flatten(-2)


# --------------------------------------------------------------------------------------------------
# pow2_ceil


def test_pow2_ceil_hand_values():
    """Powers of two are fixed points; others go up to the next power (the e8m0 cast would round 0.3 down)."""
    powers = [2.0 ** k for k in (-126, -22, -1, 0, 1, 5, 127)]
    x = torch.tensor(powers + [3.0, 0.3, 1e-4 / 448, 1.0000001, 2.0 ** -140 * 3])
    expected = powers + [4.0, 0.5, ref_pow2_ceil(f32(1e-4 / 448)), 2.0, 2.0 ** -138]
    assert ref_pow2_ceil(1e-4 / 448) == 2.0 ** -22  # by hand: 1e-4/448 = 2.23e-7 in (2**-23, 2**-22]
    assert pow2_ceil(x).tolist() == expected
    assert pow2_ceil(torch.tensor([3.0], dtype=torch.bfloat16)).dtype == torch.float32


def test_pow2_ceil_random_against_frexp():
    """Many random positives over a wide exponent range against the Python frexp loop."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2000, generator=g) * torch.exp2(torch.randint(-60, 60, (2000,), generator=g).float())
    x = x[x > 0]
    assert pow2_ceil(x).tolist() == [ref_pow2_ceil(v) for v in x.tolist()]


# --------------------------------------------------------------------------------------------------
# FP8 activations


def test_fp8_block_quant_hand_block():
    """amax 100 -> s = pow2_ceil(100/448 = 0.223) = 0.25; codes x / 0.25 rounded to e4m3 by hand."""
    values = [100.0, 17.0, 18.0, 24.0, 1.3, -3.0, 0.5, 0.001, 0.0002]
    # e4m3 steps: [256, 448) step 32, [64, 128) step 8, [8, 16) step 1, [4, 8) step 0.5, below 2**-6 step 2**-9
    expected = [384.0,  # 400 is the tie 384 | 416 -> even mantissa 384 (1.100b)
                64.0,  # 68 is the tie 64 | 72 -> even 64
                72.0, 96.0,  # exact
                5.0,  # 5.2 -> nearer 5.0 than 5.5
                -12.0, 2.0,  # exact
                2 * E4M3_SUBNORMAL_STEP,  # 0.004 = 2.05 subnormal steps -> 2
                0.0]  # 0.0008 = 0.41 steps -> 0
    x = block_with(values, 32)
    codes, scales = fp8_block_quant(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (1, 32)
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (1, 1)
    assert scales.float().item() == 0.25 and scales.view(torch.uint8).item() == E8M0_BIAS - 2
    assert codes.float()[0, : len(values)].tolist() == expected
    deq = fp8_block_dequant(codes, scales)
    assert deq.dtype == torch.float32
    assert deq[0, : len(values)].tolist() == [c * 0.25 for c in expected]


def test_fp8_block_quant_zero_block_uses_amax_floor():
    """All-zero block: amax clamps to 1e-4, s = pow2_ceil(1e-4/448) = 2**-22, every code 0."""
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-1.0, 2.0, 32)  # a non-zero block beside it: amax 2 -> s = pow2_ceil(2/448) = 2**-7
    codes, scales = fp8_block_quant(x)
    assert scales.float().tolist() == [[2.0 ** -22, 2.0 ** -22], [2.0 ** -22, 2.0 ** -7]]
    assert codes.float()[0].eq(0).all() and codes.float()[1, :32].eq(0).all()


def test_fp8_block_quant_random_against_reference():
    """Every scale and code of a multi-block, multi-magnitude tensor against the Python reference."""
    g = torch.Generator().manual_seed(1)
    block = 16
    x = multi_magnitude((3, 2), 4, block, 12, g)
    codes, scales = fp8_block_quant(x, block)
    assert codes.shape == x.shape and scales.shape == (3, 2, 4)
    rows = x.reshape(-1, block).tolist()
    ref_s = [ref_pow2_ceil(f32(max(max(abs(v) for v in r), FP8_AMAX_MIN) / FP8_MAX)) for r in rows]
    assert scales.float().flatten().tolist() == ref_s
    ref_c = [ref_e4m3(v / s) for r, s in zip(rows, ref_s) for v in r]
    assert codes.float().flatten().tolist() == ref_c
    # round-trip bound: half an e4m3 ulp, relative for normals, absolute s * 2**-10 for subnormals
    deq = fp8_block_dequant(codes, scales, block)
    s = scales.float().repeat_interleave(block, -1)
    assert ((deq - x).abs() <= E4M3_HALF_ULP_REL * x.abs() + s * E4M3_SUBNORMAL_STEP / 2).all()


def test_fp8_block_quant_bf16_input():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    codes, scales = fp8_block_quant(x)
    codes32, scales32 = fp8_block_quant(x.float())
    assert torch.equal(codes.float(), codes32.float()) and torch.equal(scales.float(), scales32.float())


# --------------------------------------------------------------------------------------------------
# FP8 weights


def test_fp8_weight_quant_tiles():
    """[40, 70] with block 32 -> 2 x 3 tiles (partial at the edges), each scale from its own tile's amax."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 70, generator=g) * 0.1
    w[5, 9] = 1000.0  # tile (0, 0): 1000/448 = 2.23 -> s = 4
    w[35, 66] = -5.0  # tile (1, 2), the 8 x 6 corner: 5/448 = 0.0112 in (2**-7, 2**-6] -> s = 2**-6
    codes, scales = fp8_weight_quant(w)
    assert codes.shape == (40, 70) and codes.dtype == torch.float8_e4m3fn
    assert scales.shape == (2, 3) and scales.dtype == torch.float8_e8m0fnu
    assert scales.float()[0, 0].item() == 4.0 and scales.float()[1, 2].item() == 2.0 ** -6
    for r in range(2):
        for c in range(3):
            tile = w[32 * r: 32 * (r + 1), 32 * c: 32 * (c + 1)]
            s = ref_pow2_ceil(f32(max(tile.abs().max().item(), FP8_AMAX_MIN) / FP8_MAX))
            assert scales.float()[r, c].item() == s
            tile_codes = codes.float()[32 * r: 32 * (r + 1), 32 * c: 32 * (c + 1)]
            assert tile_codes.flatten().tolist() == [ref_e4m3(v / s) for v in tile.flatten().tolist()]
    deq = fp8_weight_dequant(codes, scales)
    s_full = torch.tensor([[scales.float()[i // 32, j // 32].item() for j in range(70)] for i in range(40)])
    assert ((deq - w).abs() <= E4M3_HALF_ULP_REL * w.abs() + s_full * E4M3_SUBNORMAL_STEP / 2).all()


# --------------------------------------------------------------------------------------------------
# e2m1


E2M1_TABLE = [  # (input, expected): midpoints tie to the even code, others to the nearest
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    (0.1, 0.0), (0.3, 0.5), (0.74, 0.5), (0.76, 1.0), (1.3, 1.5), (2.2, 2.0), (2.6, 3.0), (3.4, 3.0),
    (4.9, 4.0), (5.1, 6.0), (6.0, 6.0), (6.5, 6.0), (100.0, 6.0), (math.inf, 6.0),
] + [(g, g) for g in E2M1_GRID]


def test_e2m1_round_table():
    x = torch.tensor([v for v, _ in E2M1_TABLE])
    assert e2m1_round(x).tolist() == [e for _, e in E2M1_TABLE]
    assert e2m1_round(-x).tolist() == [-e for _, e in E2M1_TABLE]  # negatives mirror (-0.0 == 0.0)
    assert torch.isnan(e2m1_round(torch.tensor([math.nan]))).all()


def test_e2m1_round_random_against_reference():
    """Random values and every exact midpoint, fp32 and bf16, against the Python nearest-even search."""
    mids = [(a + b) / 2 for a, b in zip(E2M1_GRID, E2M1_GRID[1:])]
    x = torch.cat([torch.rand(500, generator=torch.Generator().manual_seed(4)) * 16 - 8, torch.tensor(mids)])
    assert e2m1_round(x).tolist() == [ref_e2m1(v) for v in x.tolist()]
    xb = x.to(torch.bfloat16)
    assert e2m1_round(xb).tolist() == [ref_e2m1(v) for v in xb.float().tolist()]


def test_e2m1_encode_decode():
    grid = torch.tensor(E2M1_GRID)
    assert e2m1_encode(grid).tolist() == list(range(8))
    assert e2m1_encode(-grid[1:]).tolist() == list(range(9, 16))
    assert e2m1_encode(torch.tensor([-0.0])).item() in (0, 8)
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_encode(torch.tensor([0.0])).dtype == torch.uint8
    assert e2m1_decode(codes).tolist() == list(E2M1_GRID) + [-g for g in E2M1_GRID]
    assert e2m1_decode(codes).dtype == torch.float32


def test_pack_unpack():
    """Low nibble = even element; the byte is reinterpreted as int8, not value-cast."""
    packed = pack_fp4(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    assert packed.dtype == torch.int8 and packed.view(torch.uint8).tolist() == [0x21, 0x43]
    assert pack_fp4(torch.tensor([0, 15], dtype=torch.uint8)).tolist() == [-16]  # 0xF0 as int8
    assert unpack_fp4(torch.tensor([-16], dtype=torch.int8)).tolist() == [0, 15]
    assert unpack_fp4(torch.tensor([0xF0, 0x21], dtype=torch.uint8)).tolist() == [0, 15, 1, 2]
    codes = torch.randint(0, 16, (3, 5, 8), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 4)
    flat = codes.flatten().tolist()
    assert packed.view(torch.uint8).flatten().tolist() == [lo | hi << 4 for lo, hi in zip(flat[0::2], flat[1::2])]
    assert torch.equal(unpack_fp4(packed), codes)


# --------------------------------------------------------------------------------------------------
# FP4 blocks


def test_fp4_e8m0_hand_block():
    """amax 3.0 -> s = pow2_ceil(3/6 = 0.5) = 0.5 (exact power: no bump); codes hand-rounded from x / 0.5."""
    values = [1.1, 3.0, -0.3, 0.625, 1.25, 1.75, 2.5, 0.1, -2.2]
    # x/s:    2.2  6.0  -0.6  1.25(tie) 2.5(tie) 3.5(tie) 5.0(tie) 0.2  -4.4
    grid_vals = [2.0, 6.0, -0.5, 1.0, 2.0, 4.0, 4.0, 0.0, -4.0]
    codes = [4, 7, 9, 2, 4, 6, 6, 0, 14]
    x = block_with(values, 32)
    packed, scales = fp4_block_quant(x)
    assert packed.dtype == torch.int8 and packed.shape == (1, 16)
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (1, 1)
    assert scales.view(torch.uint8).item() == E8M0_BIAS - 1  # 0.5
    raw = packed.view(torch.uint8)[0].tolist()
    assert raw[:4] == [codes[0] | codes[1] << 4, codes[2] | codes[3] << 4, codes[4] | codes[5] << 4,
                       codes[6] | codes[7] << 4]
    assert raw[4] & 0xF == codes[8]
    deq = fp4_block_dequant(packed, scales)
    assert deq[0, : len(values)].tolist() == [0.5 * v for v in grid_vals]


@pytest.mark.parametrize("amax, scale", [(5.0, 1.0), (6.0, 1.0), (7.0, 2.0), (12.0, 2.0), (0.0, 2.0 ** -126)])
def test_fp4_e8m0_scales(amax: float, scale: float):
    """s = pow2_ceil(max(amax, 6 * 2**-126) / 6): 5/6 -> 1, 6/6 = 1 exactly, 7/6 -> 2, 12/6 = 2, zeros -> 2**-126."""
    x = torch.zeros(2, 32)
    x[1, 7] = -amax
    _, scales = fp4_block_quant(x)
    assert scales.float()[1, 0].item() == scale


def test_fp4_e4m3_scale_hand_block():
    """Block 16, amax 1.0 -> s = e4m3(1/6): in [2**-3, 2**-2) step 2**-6, 1/6 = 0.1667 lies between 0.15625 and
    0.171875 and is nearer 0.171875 (= 1.011b * 2**-3, byte 0b0_0100_011)."""
    s = 0.171875
    assert ref_e4m3(1 / 6) == s
    values = [1.0, 0.5, -0.3, 0.25]
    # x/s:   5.818 -> 6, 2.909 -> 3, -1.745 -> -1.5 (just below the 1.75 midpoint), 1.4545 -> 1.5
    grid_vals = [6.0, 3.0, -1.5, 1.5]
    x = torch.cat([torch.zeros(1, KV_BLOCK), block_with(values, KV_BLOCK)], dim=-1)  # first block all zero
    packed, scales = fp4_block_quant(x, KV_BLOCK, torch.float8_e4m3fn)
    assert packed.shape == (1, KV_BLOCK) and scales.dtype == torch.float8_e4m3fn and scales.shape == (1, 2)
    # all-zero block: amax floor 6 * 2**-9 -> s = e4m3(2**-9) = 2**-9, the smallest subnormal (byte 0x01)
    assert scales.view(torch.uint8).tolist() == [[0x01, 0b0_0100_011]]
    assert scales.float().tolist() == [[2.0 ** -9, s]]
    deq = fp4_block_dequant(packed, scales, KV_BLOCK)
    assert deq[0, :KV_BLOCK].eq(0).all()
    assert deq[0, KV_BLOCK: KV_BLOCK + len(values)].tolist() == [s * v for v in grid_vals]


@pytest.mark.parametrize("e4m3", [False, True])
def test_fp4_random_against_reference(e4m3: bool):
    """Every scale and value of a multi-block tensor against the Python reference, and the error bound
    |x - deq| <= s (half of the largest grid step, 4 -> 6)."""
    block = KV_BLOCK if e4m3 else 32
    scale_dtype = torch.float8_e4m3fn if e4m3 else torch.float8_e8m0fnu
    g = torch.Generator().manual_seed(6)
    x = multi_magnitude((2, 3), 4, block, 5, g)
    packed, scales = fp4_block_quant(x, block, scale_dtype)
    assert packed.shape == (2, 3, 2 * block) and scales.shape == (2, 3, 4) and scales.dtype == scale_dtype
    rows = x.reshape(-1, block).tolist()
    ref_s = [ref_fp4_scale(max(abs(v) for v in r), e4m3) for r in rows]
    assert scales.float().flatten().tolist() == ref_s
    deq = fp4_block_dequant(packed, scales, block)
    ref = [s * ref_e2m1(f32(v / s)) for r, s in zip(rows, ref_s) for v in r]
    assert deq.flatten().tolist() == ref
    s = scales.float().repeat_interleave(block, -1)
    assert ((deq - x).abs() <= s).all()


@pytest.mark.parametrize("e4m3", [False, True])
def test_fp4_exact_on_grid(e4m3: bool):
    """Grid values times a power-of-two scale (amax 6 * 0.25 -> s = 0.25 in both scale formats) round-trip exactly."""
    block = KV_BLOCK if e4m3 else 32
    scale_dtype = torch.float8_e4m3fn if e4m3 else torch.float8_e8m0fnu
    idx = torch.randint(0, 16, (3, 2 * block), generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
    idx[:, 0::block] = 7  # every block holds +6, so amax = 6 * 0.25
    x = torch.tensor([[math.copysign(E2M1_GRID[c & 7], -1.0 if c & 8 else 1.0) * 0.25 for c in row]
                      for row in idx.tolist()])
    packed, scales = fp4_block_quant(x, block, scale_dtype)
    assert scales.float().eq(0.25).all()
    assert torch.equal(fp4_block_dequant(packed, scales, block), x)


# --------------------------------------------------------------------------------------------------
# fake quantisation


FAKE_QUANT_KINDS = {  # kind -> (block, fp4 scale dtype or None for fp8)
    "fp8": (32, None), "fp4_e8m0": (32, torch.float8_e8m0fnu), "fp4_e4m3": (KV_BLOCK, torch.float8_e4m3fn)}


def fake_quant(x: torch.Tensor, kind: str) -> torch.Tensor:
    block, scale_dtype = FAKE_QUANT_KINDS[kind]
    return fake_quant_fp8(x, block) if scale_dtype is None else fake_quant_fp4(x, block, scale_dtype)


def quant_dequant(x: torch.Tensor, kind: str) -> torch.Tensor:
    block, scale_dtype = FAKE_QUANT_KINDS[kind]
    if scale_dtype is None:
        return fp8_block_dequant(*fp8_block_quant(x, block), block)
    return fp4_block_dequant(*fp4_block_quant(x, block, scale_dtype), block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(FAKE_QUANT_KINDS))
def test_fake_quant_forward_and_straight_through(kind: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(2, 3, 64, generator=g) * 3).to(dtype).requires_grad_()
    y = fake_quant(x, kind)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.detach().float(), quant_dequant(x.detach(), kind))  # exact: dequantised values fit bf16
    assert not torch.equal(y.detach(), x.detach())  # the forward really quantised
    y.sum().backward()
    assert x.grad.dtype == dtype and torch.equal(x.grad, torch.ones_like(x))
    x.grad = None
    upstream = torch.randn(x.shape, generator=g).to(dtype)
    (fake_quant(x, kind) * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)  # the gradient passes unchanged


def test_no_host_syncs():
    """Nothing reads a device value back (CUDA would stall): counted on the CPU as in test_experts.py."""
    from host_syncs import HostSyncs

    x = torch.randn(4, 64)
    with HostSyncs() as syncs:
        fp8_block_dequant(*fp8_block_quant(x))
        fp8_weight_dequant(*fp8_weight_quant(x[:, :50]))
        fp4_block_dequant(*fp4_block_quant(x))
        fp4_block_dequant(*fp4_block_quant(x, KV_BLOCK, torch.float8_e4m3fn), KV_BLOCK)
        fake_quant_fp8(x.requires_grad_()).sum().backward()
    assert syncs.events == []


# --------------------------------------------------------------------------------------------------
# errors


def test_errors():
    with pytest.raises(ValueError, match=r"\(4, 33\).*block=32"):
        fp8_block_quant(torch.randn(4, 33))
    with pytest.raises(ValueError, match="block=16"):
        fp4_block_quant(torch.randn(4, 40), KV_BLOCK, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block=32"):
        fake_quant_fp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="scale_dtype"):
        fp4_block_quant(torch.randn(4, 32), 32, torch.float16)
    with pytest.raises(ValueError, match="scale_dtype"):
        fake_quant_fp4(torch.randn(4, 32), 32, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        fp8_block_quant(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        fp8_weight_quant(torch.randn(2, 4, 32))
    with pytest.raises(ValueError, match="scales"):
        fp8_block_dequant(*fp8_block_quant(torch.randn(4, 64)), block=16)
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
