"""Number formats of the released V4.1-Flash checkpoint and inference kernels, in plain PyTorch.

One concept: how a tensor becomes FP8 (e4m3) or FP4 (e2m1) codes with per-block scales, and back.
These are the formats of V41_SPEC §2.4.4 (FP4 KV) and of the public inference code's `act_quant`
(scale_fmt "ue8m0"), `fp4_act_quant` and weight formats:

- FP8 activations: 1-D blocks along the last dim, e4m3fn codes, power-of-two (e8m0) scales.
- FP8 weights: `block x block` tiles of a 2-D weight, e4m3fn codes, e8m0 scales.
- FP4 (MXFP4): 1-D blocks, e2m1 codes packed two per byte (low nibble = even element), scales either
  e8m0 (indexer q/k and released expert weights, block 32) or e4m3fn (compressed KV, block 16).
- BF16: round to nearest even (the release's unquantised weights).
- `fake_quant_*`: quantise-dequantise in the forward pass, identity gradient (straight-through); the
  weight formats (`fake_quant_fp8_weight`, `fake_quant_fp4_weight`) one matrix of a stack at a time.

Power-of-two scales are computed exactly from the float bits (`pow2_ceil`), not by casting to
float8_e8m0fnu: torch's fp32 -> e8m0 cast rounds to the *nearest* power of two (and drops the sign),
so a cast would sometimes give a scale below amax / max and overflow the codes.

Everything is elementwise or per-block tensor code (CPU and CUDA, fp32 / bf16 input, any leading dims),
with no host synchronisation, no I/O and no torch.distributed.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from flashtrain.model.simulation import simulated

FP8_MAX = 448.0  # float8_e4m3fn largest finite
FP4_MAX = 6.0  # e2m1 largest
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code c (0..7) has magnitude E2M1_GRID[c]; c | 8 is its negative

FP8_AMAX_MIN = 1e-4  # act_quant's clamp on a block's amax (all-zero blocks get a finite scale)
FP4_E8M0_AMAX_MIN = FP4_MAX * 2.0 ** -126  # amax floor for e8m0 scales: amax / 6 stays an fp32 normal
FP4_E4M3_AMAX_MIN = FP4_MAX * 2.0 ** -9  # amax floor for e4m3 scales: amax / 6 >= smallest e4m3 subnormal

_F32_MANTISSA_BITS = 23
_F32_EXPONENT_MASK = 0xFF
_F32_MANTISSA_MASK = (1 << _F32_MANTISSA_BITS) - 1
_SUBNORMAL_LIFT = 64  # subnormal inputs are multiplied by 2**64 (exact) to make them normal, then scaled back
_E2M1_SIGN = 8  # sign bit of a 4-bit e2m1 code
_E2M1_MAGNITUDE = 7  # magnitude bits of a 4-bit e2m1 code
_NIBBLE = 4  # bits per packed fp4 code
_LOW_NIBBLE = 0xF


# --------------------------------------------------------------------------------------------------
# helpers


def _check_float(x: Tensor, name: str) -> None:
    if not x.is_floating_point() or x.element_size() == 1:  # 1-byte floats are codes / scales, not inputs
        raise ValueError(f"{name} must be a floating-point tensor (fp32 / bf16 / fp16), got dtype {x.dtype}; "
                         f"cast it with .float() first")


def _check_blocks(shape: torch.Size, block: int, name: str) -> int:
    """Number of blocks along the last dim; ValueError if `shape` cannot be cut into `block`s."""
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if len(shape) == 0:
        raise ValueError(f"{name} must have at least one dim to cut into blocks of {block}, got a scalar")
    if shape[-1] % block != 0:
        raise ValueError(f"{name} of shape {tuple(shape)}: last dim {shape[-1]} is not a multiple of block={block}; "
                         f"pad the last dim to a multiple of {block} or choose a block that divides it")
    return shape[-1] // block


def _check_scales(scales: Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not match {what}: expected {expected}; "
                         f"pass the scales returned by the quantiser with the same block")


def _blocked(x: Tensor, block: int) -> Tensor:
    """[..., n] -> [..., n // block, block] (a view when possible)."""
    return x.unflatten(-1, (x.shape[-1] // block, block))


# --------------------------------------------------------------------------------------------------
# powers of two


def pow2_ceil(x: Tensor) -> Tensor:
    """fp32 2**ceil(log2(x)) for x > 0, exact: from the fp32 exponent field, +1 if any mantissa bit is set.

    Powers of two map to themselves; subnormals are handled exactly (lifted by 2**64 first). The sign
    is ignored (the result is for |x|); 0 -> 0, inf -> inf, NaN -> NaN; finite values above 2**127
    give inf (2**128 is not an fp32).
    """
    _check_float(x, "pow2_ceil input")
    x = x.float()
    bits = x.view(torch.int32)
    exponent = (bits >> _F32_MANTISSA_BITS) & _F32_EXPONENT_MASK
    subnormal = (exponent == 0) & ((bits & _F32_MANTISSA_MASK) != 0)
    lifted = torch.where(subnormal, x * 2.0 ** _SUBNORMAL_LIFT, x)
    bits = lifted.view(torch.int32)
    exponent = (bits >> _F32_MANTISSA_BITS) & _F32_EXPONENT_MASK
    exponent = exponent + ((bits & _F32_MANTISSA_MASK) != 0).to(torch.int32)
    out = (exponent << _F32_MANTISSA_BITS).view(torch.float32)  # exponent 256 only for inf/NaN, replaced below
    out = torch.where(subnormal, out * 2.0 ** -_SUBNORMAL_LIFT, out)
    return torch.where(torch.isfinite(x), out, x.abs())


# --------------------------------------------------------------------------------------------------
# FP8 e4m3 with e8m0 scales


def _fp8_codes(x: Tensor, scale: Tensor) -> Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _fp8_scale(amax: Tensor) -> Tensor:
    return pow2_ceil(amax.clamp_min(FP8_AMAX_MIN) / FP8_MAX)


def fp8_block_quant(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """1-D blocks of `block` along the last dim -> (e4m3fn codes like x, e8m0 scales [..., n // block]).

    Per block: amax = max |x| (fp32) clamped to >= 1e-4, s = pow2_ceil(amax / 448),
    codes = clamp(x / s, +-448) rounded to e4m3 (nearest even), as act_quant with scale_fmt "ue8m0".
    """
    _check_float(x, "fp8_block_quant input")
    _check_blocks(x.shape, block, "fp8_block_quant input")
    xb = _blocked(x.float(), block)
    scale = _fp8_scale(xb.abs().amax(-1))
    codes = _fp8_codes(xb, scale.unsqueeze(-1)).flatten(-2)
    return codes, scale.to(torch.float8_e8m0fnu)


def fp8_block_dequant(codes: Tensor, scales: Tensor, block: int = 32) -> Tensor:
    """fp32 codes * scale, the scale broadcast over its block of `block` along the last dim."""
    n_blocks = _check_blocks(codes.shape, block, "fp8_block_dequant codes")
    _check_scales(scales, (*codes.shape[:-1], n_blocks), f"codes {tuple(codes.shape)} with block={block}")
    return (_blocked(codes.float(), block) * scales.float().unsqueeze(-1)).flatten(-2)


def _check_weight(w: Tensor, block: int, name: str) -> tuple[int, int]:
    if w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D weight [out, in], got shape {tuple(w.shape)}; "
                         f"reshape it to 2-D or use the 1-D block functions")
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")
    return -(-w.shape[0] // block), -(-w.shape[1] // block)


def _tile_view(w: Tensor, block: int) -> Tensor:
    """[out, in] zero-padded to whole tiles, viewed as [rows, block, cols, block]."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    padded = torch.nn.functional.pad(w, (0, cols * block - w.shape[1], 0, rows * block - w.shape[0]))
    return padded.view(rows, block, cols, block)


def fp8_weight_quant(w: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """2-D weight [out, in] -> (e4m3fn codes [out, in], e8m0 scales [ceil(out/block), ceil(in/block)]).

    One scale per `block x block` tile (edge tiles partial), same rule as `fp8_block_quant`.
    """
    _check_float(w, "fp8_weight_quant weight")
    _check_weight(w, block, "fp8_weight_quant weight")
    tiles = _tile_view(w.float(), block)
    scale = _fp8_scale(tiles.abs().amax(dim=(1, 3)))
    codes = _fp8_codes(tiles, scale[:, None, :, None]).flatten(2).flatten(0, 1)
    return codes[: w.shape[0], : w.shape[1]].contiguous(), scale.to(torch.float8_e8m0fnu)


def fp8_weight_dequant(codes: Tensor, scales: Tensor, block: int = 32) -> Tensor:
    """fp32 [out, in]: codes times their tile's scale."""
    expected = _check_weight(codes, block, "fp8_weight_dequant codes")
    _check_scales(scales, expected, f"codes {tuple(codes.shape)} with block={block}")
    rows, cols = expected
    full = scales.float()[:, None, :, None].expand(rows, block, cols, block).reshape(rows * block, cols * block)
    return codes.float() * full[: codes.shape[0], : codes.shape[1]]


# --------------------------------------------------------------------------------------------------
# FP4 e2m1


@functools.lru_cache(maxsize=None)
def _e2m1_tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """(grid, boundaries) on `device`, built once per device (no host-to-device copy per call).

    Boundary i is the midpoint between codes i and i + 1; `bucketize` counts boundaries < |x|. A tie
    goes to the even code: where i + 1 is even the tie must step up, so that boundary is moved one
    fp32 ulp down (then |x| == midpoint is above it).
    """
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
    mid = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    up = torch.arange(1, len(E2M1_GRID)) % 2 == 0
    boundaries = torch.where(up, torch.nextafter(mid, torch.zeros_like(mid)), mid)
    return grid.to(device), boundaries.to(device)


def _tables(t: Tensor) -> tuple[Tensor, Tensor]:
    """`_e2m1_tables` for t's device; built afresh for a fake tensor (the memory estimator), so that no fake
    table is ever cached for the real computations of the same process."""
    return _e2m1_tables.__wrapped__(t.device) if simulated(t) else _e2m1_tables(t.device)


def _e2m1_magnitude_code(x: Tensor) -> Tensor:
    """Index into E2M1_GRID of round-to-nearest-even(|x|), saturating at 6 (int64)."""
    return torch.bucketize(x.float().abs().contiguous(), _tables(x)[1])


def e2m1_round(x: Tensor) -> Tensor:
    """fp32 x (already divided by its scale) -> nearest E2M1 grid value, ties to the even code, sign kept.

    Clamps to [-6, 6] first; NaN stays NaN.
    """
    _check_float(x, "e2m1_round input")
    x = x.float()
    grid = _tables(x)[0]
    rounded = torch.copysign(grid[_e2m1_magnitude_code(x)], x)
    return torch.where(torch.isnan(x), x, rounded)


def e2m1_encode(values: Tensor) -> Tensor:
    """Grid values -> uint8 codes 0..15 (index in E2M1_GRID, | 8 when the sign bit is set; -0.0 -> 8).

    Off-grid values are rounded as by `e2m1_round` (e2m1 has no NaN: do not pass one).
    """
    _check_float(values, "e2m1_encode input")
    magnitude = _e2m1_magnitude_code(values).to(torch.uint8)
    return magnitude | (torch.signbit(values).to(torch.uint8) * _E2M1_SIGN)


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 codes -> fp32 values (bits above the low nibble are ignored)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"e2m1_decode expects uint8 codes, got dtype {codes.dtype}; "
                         f"unpack int8 bytes with unpack_fp4 first")
    grid = _tables(codes)[0]
    magnitude = grid[(codes & _E2M1_MAGNITUDE).long()]
    return torch.where((codes & _E2M1_SIGN) != 0, -magnitude, magnitude)


def pack_fp4(codes: Tensor) -> Tensor:
    """uint8 codes [..., n] (n even) -> int8 bytes [..., n // 2]: byte i = codes[2i] | codes[2i+1] << 4."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4 expects uint8 codes, got dtype {codes.dtype}; encode with e2m1_encode first")
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_fp4 needs an even last dim, got shape {tuple(codes.shape)}; pad it by one code")
    low = codes[..., 0::2] & _LOW_NIBBLE
    high = (codes[..., 1::2] & _LOW_NIBBLE) << _NIBBLE
    return (low | high).view(torch.int8)


def unpack_fp4(packed: Tensor) -> Tensor:
    """int8 or uint8 bytes [..., m] -> uint8 codes [..., 2m] (low nibble first)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"unpack_fp4 expects int8 or uint8 bytes, got dtype {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("unpack_fp4 needs at least one dim, got a scalar; unsqueeze it")
    raw = packed.view(torch.uint8)
    return torch.stack((raw & _LOW_NIBBLE, raw >> _NIBBLE), dim=-1).flatten(-2)


def _fp4_scale(amax: Tensor, scale_dtype: torch.dtype) -> Tensor:
    """fp32 per-block scale, exactly representable in `scale_dtype`."""
    if scale_dtype == torch.float8_e8m0fnu:
        return pow2_ceil(amax.clamp_min(FP4_E8M0_AMAX_MIN) / FP4_MAX)
    # e4m3 scales: the scale itself is rounded to nearest e4m3 (may round down; codes then saturate at 6)
    return (amax.clamp_min(FP4_E4M3_AMAX_MIN) / FP4_MAX).to(torch.float8_e4m3fn).float()


def _check_fp4_scale_dtype(scale_dtype: torch.dtype) -> None:
    if scale_dtype not in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
        raise ValueError(f"fp4 scale_dtype must be torch.float8_e8m0fnu (MXFP4, block 32) or torch.float8_e4m3fn "
                         f"(compressed KV, block 16), got {scale_dtype}")


def fp4_block_quant(x: Tensor, block: int = 32,
                    scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple[Tensor, Tensor]:
    """1-D blocks along the last dim -> (packed int8 [..., n // 2], scales in scale_dtype [..., n // block]).

    e8m0 scales: s = pow2_ceil(max(amax, 6 * 2**-126) / 6); e4m3 scales: s = e4m3(max(amax, 6 * 2**-9) / 6).
    Values = e2m1_round(clamp(x / s, +-6)), encoded and packed low nibble first.
    """
    _check_float(x, "fp4_block_quant input")
    _check_fp4_scale_dtype(scale_dtype)
    _check_blocks(x.shape, block, "fp4_block_quant input")
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"fp4_block_quant input of shape {tuple(x.shape)}: last dim must be even to pack two "
                         f"codes per byte; use an even block")
    xb = _blocked(x.float(), block)
    scale = _fp4_scale(xb.abs().amax(-1), scale_dtype)
    values = e2m1_round((xb / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return pack_fp4(e2m1_encode(values)), scale.to(scale_dtype)


def fp4_block_dequant(packed: Tensor, scales: Tensor, block: int = 32) -> Tensor:
    """fp32 [..., 2m] from packed bytes [..., m] and per-block scales (e8m0 or e4m3)."""
    values = e2m1_decode(unpack_fp4(packed))
    n_blocks = _check_blocks(values.shape, block, "fp4_block_dequant unpacked codes")
    _check_scales(scales, (*values.shape[:-1], n_blocks), f"packed {tuple(packed.shape)} with block={block}")
    return (_blocked(values, block) * scales.float().unsqueeze(-1)).flatten(-2)


# --------------------------------------------------------------------------------------------------
# quantisation-aware training


class _StraightThrough(torch.autograd.Function):
    """forward: quantise(x) (any function of x, computed without autograd, in any float dtype); backward:
    identity (the gradient cast back to x's dtype)."""

    @staticmethod
    def forward(ctx, x: Tensor, quantise: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.dtype = x.dtype
        return quantise(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad.to(ctx.dtype), None


def fake_quant_fp8(x: Tensor, block: int = 32, dtype: torch.dtype | None = None) -> Tensor:
    """dequant(fp8_block_quant(x)) in `dtype` (default x.dtype); gradient passes unchanged (straight-through).

    bf16 output is exact: an e4m3 code times a power of two fits bf16's 8-bit mantissa.
    """
    _check_float(x, "fake_quant_fp8 input")
    _check_blocks(x.shape, block, "fake_quant_fp8 input")

    def quantise(t: Tensor) -> Tensor:
        return fp8_block_dequant(*fp8_block_quant(t, block), block).to(dtype or t.dtype)

    return _StraightThrough.apply(x, quantise)


def fake_quant_fp4(x: Tensor, block: int = 32, scale_dtype: torch.dtype = torch.float8_e8m0fnu,
                   dtype: torch.dtype | None = None) -> Tensor:
    """dequant(fp4_block_quant(x)) in `dtype` (default x.dtype); gradient passes unchanged (straight-through)."""
    _check_float(x, "fake_quant_fp4 input")
    _check_fp4_scale_dtype(scale_dtype)
    _check_blocks(x.shape, block, "fake_quant_fp4 input")

    def quantise(t: Tensor) -> Tensor:
        return fp4_block_dequant(*fp4_block_quant(t, block, scale_dtype), block).to(dtype or t.dtype)

    return _StraightThrough.apply(x, quantise)


def fake_quant_fp4_weight(w: Tensor, block: int = 32, dtype: torch.dtype | None = None) -> Tensor:
    """`fake_quant_fp4` with E8M0 scales (the release's FP4 experts) of a weight [out, in] or a stack
    [E, out, in], one matrix at a time (the temporaries of one matrix, not of the stack)."""
    _check_float(w, "fake_quant_fp4_weight weight")
    _check_blocks(w.shape, block, "fake_quant_fp4_weight weight")
    if w.dim() < 2:
        raise ValueError(f"fake_quant_fp4_weight needs a weight [out, in] (or a stack of them), got shape "
                         f"{tuple(w.shape)}; use fake_quant_fp4 for activations")

    def quantise(t: Tensor) -> Tensor:
        return _per_matrix(t, lambda m: fp4_block_dequant(*fp4_block_quant(m, block), block), dtype or t.dtype)

    return _StraightThrough.apply(w, quantise)


def fake_quant_fp8_weight(w: Tensor, block: int = 32, dtype: torch.dtype | None = None) -> Tensor:
    """dequant(fp8_weight_quant(w)) in `dtype` (default w.dtype): every `block x block` tile of a weight
    [out, in] (or of each matrix of a stack [..., out, in]) on its E4M3 grid times its E8M0 scale;
    gradient passes unchanged (straight-through)."""
    _check_float(w, "fake_quant_fp8_weight weight")
    if w.dim() < 2:
        raise ValueError(f"fake_quant_fp8_weight needs a weight [out, in] (or a stack of them), got shape "
                         f"{tuple(w.shape)}; use fake_quant_fp8 for 1-D blocks")

    def quantise(t: Tensor) -> Tensor:
        return _per_matrix(t, lambda m: fp8_weight_dequant(*fp8_weight_quant(m, block), block), dtype or t.dtype)

    return _StraightThrough.apply(w, quantise)


def fake_quant_bf16(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """x rounded to bf16 (nearest even), in `dtype` (default x.dtype); gradient passes unchanged."""
    _check_float(x, "fake_quant_bf16 input")
    return _StraightThrough.apply(x, lambda t: t.to(torch.bfloat16).to(dtype or t.dtype))


def _per_matrix(t: Tensor, fn: Callable[[Tensor], Tensor], dtype: torch.dtype) -> Tensor:
    """fn over each matrix t[i, ..., :, :] into one output of `dtype` (fn of the whole when t is 2-D)."""
    if t.dim() == 2:
        return fn(t).to(dtype)
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    for i in range(t.shape[0]):
        out[i] = _per_matrix(t[i], fn, dtype)
    return out
