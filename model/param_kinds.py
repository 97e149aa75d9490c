"""What kind of parameter each parameter is: the one table that partitioning, expert parallelism,
ZeRO-1, gradient reduction, clipping, the optimizer routing and the official import/export read
(DESIGN.md "Parallelism"; V41_SPEC §4, §5, §7).

| kind            | parameters                                                       | decided by                         |
|-----------------|------------------------------------------------------------------|------------------------------------|
| `ROUTED_EXPERT` | the stacked expert weights [E, out, in] (sharded over ep)        | owned by a `RoutedExperts` module  |
| `ENGRAM_TABLE`  | an Engram layer's hashed-n-gram table [rows, head_dim] (row-shardable over dp) | `Engram.embed.weight` |
| `EMBEDDING`     | the token embedding [vocab, dim]                                 | `Transformer.embed.weight`         |
| `HEAD`          | the LM head [vocab, dim]                                         | `Transformer.head.weight`          |
| `MATRIX`        | every other parameter of two or more dimensions that multiplies activations (projections, the gate, shared experts, mHC `hc_*_fn`, ViT, aligner) | ndim >= 2 |
| `VECTOR`        | the rest: norms, biases, sinks, mHC base / scale, the image vectors, and Engram's element-wise gate scales `q_weight` / `k_weight` ([hc, dim], used only as their product) | ndim < 2, or a parameter registered directly on an `Engram` |

The kind follows from the module that owns a parameter, never from its name, so it holds after the
model is pruned to pipeline stages, sharded to experts or to Engram rows, or built on the meta device.
"""  # noqa: E501 - markdown table rows cannot be wrapped

from __future__ import annotations

from enum import Enum

from torch import nn

from flashtrain.model.engram import Engram
from flashtrain.model.moe import RoutedExperts
from flashtrain.model.transformer import Transformer


class ParamKind(str, Enum):
    ROUTED_EXPERT = "routed_expert"
    ENGRAM_TABLE = "engram_table"
    EMBEDDING = "embedding"
    HEAD = "head"
    MATRIX = "matrix"
    VECTOR = "vector"


def parameter_kinds(model: nn.Module) -> dict[str, ParamKind]:
    """{name: kind} for every parameter of `model` (a Transformer, whole or pruned, or any module holding
    its pieces), in `named_parameters` order."""
    special: dict[int, ParamKind] = {}
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            special.update((id(p), ParamKind.ROUTED_EXPERT) for p in module.parameters(recurse=False))
        elif isinstance(module, Engram):
            special.update((id(p), ParamKind.VECTOR) for p in module.parameters(recurse=False))
            special[id(module.embed.weight)] = ParamKind.ENGRAM_TABLE
        elif isinstance(module, Transformer):
            for part, kind in ((module.embed, ParamKind.EMBEDDING), (module.head, ParamKind.HEAD)):
                if part is not None:  # None on a pipeline rank without the first / last stage
                    special[id(part.weight)] = kind
    return {name: special.get(id(p), ParamKind.MATRIX if p.dim() >= 2 else ParamKind.VECTOR)
            for name, p in model.named_parameters()}
