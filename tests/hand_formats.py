"""Hand references of the release's weight and activation formats, block by block in Python floats, for
tests/test_formats.py and tests/test_fp8_linear.py (issue 35). Built on test_quant.py's literal format
definitions (`ref_pow2_ceil`, `ref_e4m3`, `ref_e2m1`, `f32`), independently of torch's float8 casts and of
model/quant.py.

A block's scale is the power of two at or above amax / max (amax floored as the public `act_quant` floors
it); every value is the format's nearest grid value (ties to the even code) of value / scale, times the scale.
"""

from __future__ import annotations

import torch
from test_quant import FP4_E8M0_AMAX_MIN, FP8_AMAX_MIN, f32, ref_e2m1, ref_e4m3, ref_pow2_ceil

from flashtrain.model.quant import FP4_MAX, FP8_MAX

BLOCK = 32


def fp8_scale(block: list[float]) -> float:
    return ref_pow2_ceil(f32(max(max(abs(v) for v in block), FP8_AMAX_MIN) / FP8_MAX))


def fp8_block(block: list[float]) -> tuple[list[float], float]:
    """(the E4M3 values of block / scale, the scale)."""
    s = fp8_scale(block)
    return [ref_e4m3(v / s) for v in block], s


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, C]: each row in blocks of 32 along C (a partial last block: the zeros it is padded with change
    nothing), dequantised (codes x scale), fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r, row in enumerate(x.tolist()):
        for c0 in range(0, len(row), BLOCK):
            codes, s = fp8_block(row[c0:c0 + BLOCK])
            out[r, c0:c0 + len(codes)] = torch.tensor([c * s for c in codes], dtype=torch.float64)
    return out


def fp8_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K]: every 32 x 32 tile (partial at the edges) on its E4M3 grid times its scale, fp64."""
    out = torch.zeros(w.shape, dtype=torch.float64)
    N, K = w.shape
    for r0 in range(0, N, BLOCK):
        for c0 in range(0, K, BLOCK):
            tile = w[r0:r0 + BLOCK, c0:c0 + BLOCK]
            s = fp8_scale(tile.flatten().tolist())
            out[r0:r0 + BLOCK, c0:c0 + BLOCK] = torch.tensor([[ref_e4m3(v / s) * s for v in row]
                                                               for row in tile.tolist()], dtype=torch.float64)
    return out


def fp4_rows(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (K a multiple of 32): every 32 inputs of a row on the E2M1 grid times their E8M0 scale, fp64."""
    out = torch.zeros(w.shape, dtype=torch.float64)
    for r, row in enumerate(w.tolist()):
        for c0 in range(0, len(row), BLOCK):
            block = row[c0:c0 + BLOCK]
            s = ref_pow2_ceil(f32(max(max(abs(v) for v in block), FP4_E8M0_AMAX_MIN) / FP4_MAX))
            out[r, c0:c0 + BLOCK] = torch.tensor([ref_e2m1(v / s) * s for v in block], dtype=torch.float64)
    return out


def adversarial(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Random fp32 [R, C] over six decades (a magnitude per block of 32 along C), with the cases a blockwise
    format gets wrong: a zero block, a block whose amax is its last element (at the block edge), a block whose
    amax is exactly 448 (scale 1) holding the E4M3 ties 1.0625 (-> 1.0, the even code) and 1.1875 (-> 1.25),
    values that fall to E4M3 subnormal codes, and a block whose amax / scale rounds down to 224 (so its
    quantised values would take the next smaller scale)."""
    g = torch.Generator().manual_seed(seed)
    R, C = shape
    blocks = -(-C // BLOCK)
    magnitude = torch.exp2(torch.randint(-12, 8, (R, blocks), generator=g).float()).repeat_interleave(BLOCK, 1)
    x = torch.randn(R, C, generator=g) * magnitude[:, :C]  # every block of 32 its own power of two
    x[0, :BLOCK] = 0.0  # a zero block
    if R > 1:
        x[1, :BLOCK] = torch.linspace(-0.5, 0.9, BLOCK)
        x[1, BLOCK - 1] = 3.0  # amax at the block edge
    if R > 2 and C >= 2 * BLOCK:
        x[2, BLOCK:2 * BLOCK] = torch.linspace(-1.0, 1.0, BLOCK)
        x[2, BLOCK], x[2, BLOCK + 1], x[2, BLOCK + 2] = 448.0, 1.0625, -1.1875  # ties at scale 1
        x[2, BLOCK + 3] = 3.0 * 2.0 ** -9  # an E4M3 subnormal code (3 x 2**-9)
    if R > 3:
        x[3, :BLOCK] = torch.linspace(-100.0, 100.0, BLOCK)
        x[3, 7] = 229.0  # s = pow2_ceil(229 / 448) = 1; 229 -> 224 (E4M3 step 16 in [128, 256))
    return x
