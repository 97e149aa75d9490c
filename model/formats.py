"""How a weight enters the forward: the format the release stores it in (the public inference code's
parameter dtypes, `ModelArgs.dtype = "fp8"`, `expert_dtype = "fp4"`; train/official/layout.py writes them)
and the switches that put the trained value on that format's grid (`model.qat.experts_fp4`,
`weights_fp8`, `weights_bf16`; issue 35).

| format (`Stored`) | weights | on the format's grid in the forward when |
|---|---|---|
| `FP8`      | attention `wq_a`, `wq_b`, `wkv`, `wo_b`; indexer `wq_b`; shared expert `w1`-`w3`; Engram `wkv`: E4M3, an E8M0 scale per 32 x 32 tile | `qat.weights_fp8`, or `fp8.enabled` (the FP8 GEMM multiplies exactly these codes, model/fp8_linear.py) |
| `FP4`      | routed experts `w1`, `w2`, `w3` [E, out, in]: E2M1, an E8M0 scale per 32 inputs | `qat.experts_fp4` |
| `FP8_ROWS` | Engram tables (each looked-up row): E4M3, an E8M0 scale per 32 channels | `qat.weights_fp8` |
| `BF16`     | every other weight: embedding, head, norms, `wo_a`, compressor, indexer `wk` / `weights_proj`, gate, Engram `q_weight` / `k_weight`, ViT, aligner, image vectors | `qat.weights_bf16` |
| `FP32`     | `attn_sink`, the mHC `hc_*` parameters (and the gate's bias buffers) | always: the master is the stored value |

The value is computed from the fp32 master weight in every forward, with a straight-through gradient into
the master (which keeps the updates below the grid's resolution). The export quantises the same master
with the same functions (model/quant.py), so with the switch on the released tensor dequantises to exactly
the value trained with; and that value is a fixed point of the quantiser, so an import of the export
computes with the same numbers again (docs/official_formats.md "Exact export").

The value comes in the matmul's dtype (autocast's bf16 on CUDA): exact, since every one of these grids fits
in bf16. `Linear`, `Embedding` (and `RMSNorm`, model/norm.py) carry their format; a module that holds a
weight itself declares its format in a class attribute `STORED` ({parameter: format}) and reads it through
`as_trained`. `weight_formats(model)` lists every parameter's format from those declarations
(tests/test_formats.py checks it against the export's table, train/official/layout.py).
"""  # noqa: E501 - markdown table rows cannot be wrapped

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from flashtrain.model.config import ModelConfig, QATConfig
from flashtrain.model.fp8_linear import fp8_linear
from flashtrain.model.quant import fake_quant_bf16, fake_quant_fp4_weight, fake_quant_fp8, fake_quant_fp8_weight


class Stored(str, Enum):
    FP8 = "fp8"
    FP4 = "fp4"
    FP8_ROWS = "fp8_rows"
    BF16 = "bf16"
    FP32 = "fp32"


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x runs in: autocast's when it is on (bf16 on CUDA), else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def on_grid(fmt: Stored, qat: QATConfig) -> bool:
    """Whether the forward computes with a `fmt` weight on its format's grid under these switches."""
    return {Stored.FP8: qat.weights_fp8, Stored.FP4: qat.experts_fp4, Stored.FP8_ROWS: qat.weights_fp8,
            Stored.BF16: qat.weights_bf16, Stored.FP32: False}[fmt]


def as_trained(w: torch.Tensor, fmt: Stored, qat: QATConfig, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The value of weight `w` (stored in the release as `fmt`) that the forward computes with, in `dtype`
    (default w's): on the format's grid when its switch is on (straight-through gradient), else w itself.
    `FP8_ROWS` quantises the last dim in blocks of 32, so it applies to looked-up rows as to the table."""
    if not on_grid(fmt, qat):
        return w if dtype in (None, w.dtype) else w.to(dtype)
    block = QATConfig.WEIGHT_BLOCK
    if fmt is Stored.FP8:
        return fake_quant_fp8_weight(w, block, dtype)
    if fmt is Stored.FP4:
        return fake_quant_fp4_weight(w, block, dtype)
    if fmt is Stored.FP8_ROWS:
        return fake_quant_fp8(w, block, dtype)
    return fake_quant_bf16(w, dtype)


class Linear(nn.Linear):
    """`nn.Linear` whose weight (and bias) enter the forward as `as_trained` says for `fmt`; an `FP8` Linear
    under `model.fp8.enabled` runs its forward and backward GEMMs in FP8 (model/fp8_linear.py: its forward
    weight is the release's FP8 value, so the FP8 QAT holds for it too)."""

    def __init__(self, in_features: int, out_features: int, cfg: ModelConfig, fmt: Stored = Stored.BF16,
                 bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.fmt = fmt
        self.qat = cfg.qat
        self.fp8_gemm = cfg.fp8.enabled and fmt is Stored.FP8
        self.use_triton = cfg.use_triton
        if fmt is Stored.FP8 and bias:
            raise ValueError("the release's FP8 Linears have no bias")

    def value(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as the forward computes with it."""
        return as_trained(self.weight, self.fmt, self.qat, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_gemm:
            return fp8_linear(x, self.weight, self.use_triton)
        if not on_grid(self.fmt, self.qat):
            return F.linear(x, self.weight, self.bias)
        dtype = compute_dtype(x)
        bias = None if self.bias is None else as_trained(self.bias, Stored.BF16, self.qat, dtype)
        return F.linear(x, self.value(dtype), bias)


class Embedding(nn.Embedding):
    """`nn.Embedding` whose looked-up rows are as `as_trained` says for `fmt` (`BF16` or `FP8_ROWS`: formats
    of single rows, so quantising the rows looked up equals looking up the quantised table)."""

    def __init__(self, rows: int, dim: int, cfg: ModelConfig, fmt: Stored = Stored.BF16):
        super().__init__(rows, dim)
        if fmt not in (Stored.BF16, Stored.FP8_ROWS):
            raise ValueError(f"an Embedding's rows are stored BF16 or FP8_ROWS, not {fmt}")
        self.fmt = fmt
        self.qat = cfg.qat

    def rows(self, looked_up: torch.Tensor) -> torch.Tensor:
        """Rows of this table (looked up here or by a row-sharded lookup) as the forward computes with them."""
        return as_trained(looked_up, self.fmt, self.qat)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(super().forward(ids))


def weight_formats(model: nn.Module) -> dict[str, Stored | None]:
    """{parameter name: the format the release stores it in} for every parameter of `model`, from the owning
    module (`Linear` / `Embedding`: their `fmt`, a bias BF16; a module's `STORED` declaration); None where
    nothing declares one."""
    out = {}
    for mname, module in model.named_modules():
        declared = dict(getattr(module, "STORED", {}))
        if isinstance(module, (Linear, Embedding)):
            declared.update(weight=module.fmt, bias=Stored.BF16)
        for leaf, _ in module.named_parameters(recurse=False):
            out[f"{mname}.{leaf}" if mname else leaf] = declared.get(leaf)
    return out
