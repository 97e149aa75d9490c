"""The block carry: its fields, their shapes and dtypes, and which layer role reads and writes each
(DESIGN.md "The model", the carry table; V41_SPEC §2).

This is the one declaration of the carry contract. Attention (model/attention.py) reads and writes the
CSA2 fields through it (`SharedKV.read` / `SharedKV.write`, which refuse anything the table does not
allow), activation recomputation (model/recompute.py) flattens and rebuilds the carry in its order
(`Carry.tensors` / `Carry.from_tensors`), and the pipeline (parallel/pipeline.py) derives what crosses
a stage boundary, and with which shape and dtype, from it.

| field        | shape                                                     | dtype | written by                      | read by                 |
|--------------|-----------------------------------------------------------|-------|---------------------------------|-------------------------|
| `h`          | [b, L, n_streams, dim]                                    | fp32  | every block                     | every block             |
| `pre_mix`    | [b, L, n_streams]                                         | fp32  | every block                     | every block             |
| `kv`         | [b, n, head_dim]                                          | fp32  | Full                            | Reuse, Reindex          |
| `index_k`    | [b, n, index_head_dim]                                    | fp32  | Full                            | Reindex                 |
| `topk`       | [b, L, min(index_topk, n)]                                | int64 | Full, Reindex                   | Reuse                   |
| `candidates` | [b, L, min(candidate_topk_blocks, ceil(n / block_size))]  | int32 | the candidate source; a Full layer resets it | Reindex with `uses_candidates` |

b sequences per micro-batch; L this rank's positions of each (the whole sequence S unless context
parallel); n = S // m compressed entries of the kv source (m its compress ratio; under context
parallelism the compressed KV / index-K are gathered whole, model/sequence_split.py). The dtypes are
those a field has where it crosses a pipeline boundary (on CUDA the float fields are bf16 inside a
stage). `topk` holds compressed indices, -1 for an empty slot; `candidates` block indices of the
candidate pool, -1 for an empty slot. SWA layers touch none of the CSA2 fields.
"""  # noqa: E501 - markdown table rows cannot be wrapped

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Callable

import torch

from flashtrain.model.config import ModelConfig
from flashtrain.model.layer_plan import LayerRole, Role


def _never(role: LayerRole) -> bool:
    return False


def _always(role: LayerRole) -> bool:
    return True


@dataclass(frozen=True)
class CarryField:
    """One row of the table above. `shape(cfg, b, L, n)`; `reads(role)`: the layer uses the value it
    receives; `writes(role)`: the layer publishes a new value; `resets(role)`: the layer clears it
    (to None) before it may publish."""

    name: str
    dtype: torch.dtype
    shape: Callable[[ModelConfig, int, int, int], tuple[int, ...]]
    reads: Callable[[LayerRole], bool]
    writes: Callable[[LayerRole], bool]
    resets: Callable[[LayerRole], bool] = _never


# The residual streams and the pending single-pass `pre` mix: every block reads and rewrites them.
BLOCK_FIELDS: tuple[CarryField, ...] = (
    CarryField("h", torch.float32, lambda cfg, b, L, n: (b, L, cfg.n_streams, cfg.dim), _always, _always),
    CarryField("pre_mix", torch.float32, lambda cfg, b, L, n: (b, L, cfg.n_streams), _always, _always),
)

# The CSA2 sharing (V41_SPEC §2): a Full layer publishes its compressed KV, index-K and top-k; Reuse
# layers read the KV and top-k; a Reindex layer scores the Full layer's index-K (inside its candidate
# pool when restricted) and publishes its own top-k for the Reuse layers after it.
SHARED_FIELDS: tuple[CarryField, ...] = (
    CarryField("kv", torch.float32, lambda cfg, b, L, n: (b, n, cfg.head_dim),
               reads=lambda r: r.role in (Role.REUSE, Role.REINDEX), writes=lambda r: r.role is Role.FULL),
    CarryField("index_k", torch.float32, lambda cfg, b, L, n: (b, n, cfg.index_head_dim),
               reads=lambda r: r.role is Role.REINDEX, writes=lambda r: r.role is Role.FULL),
    CarryField("topk", torch.long, lambda cfg, b, L, n: (b, L, min(cfg.index_topk, n)),
               reads=lambda r: r.role is Role.REUSE, writes=lambda r: r.has_indexer),
    CarryField("candidates", torch.int32,
               lambda cfg, b, L, n: (b, L, min(cfg.candidate_topk_blocks, -(-n // cfg.candidate_block_size))),
               reads=lambda r: r.role is Role.REINDEX and r.uses_candidates,
               writes=lambda r: r.has_indexer and r.is_candidate_source,
               resets=lambda r: r.role is Role.FULL),
)

CARRY_FIELDS: tuple[CarryField, ...] = BLOCK_FIELDS + SHARED_FIELDS
SHARED_NAMES: tuple[str, ...] = tuple(f.name for f in SHARED_FIELDS)
FIELDS: dict[str, CarryField] = {f.name: f for f in CARRY_FIELDS}


def shared_reads(role: LayerRole) -> frozenset[str]:
    """The CSA2 fields layer `role` reads from the carry it receives."""
    return frozenset(f.name for f in SHARED_FIELDS if f.reads(role))


def shared_writes(role: LayerRole) -> frozenset[str]:
    """The CSA2 fields layer `role` may publish."""
    return frozenset(f.name for f in SHARED_FIELDS if f.writes(role))


def shared_resets(role: LayerRole) -> frozenset[str]:
    """The CSA2 fields layer `role` clears before it may publish them."""
    return frozenset(f.name for f in SHARED_FIELDS if f.resets(role))


def _read(self, role: LayerRole) -> dict[str, torch.Tensor | None]:
    """The fields `role` reads, by name (the only ones a layer may use from the carry it receives)."""
    reads = shared_reads(role)
    return {name: getattr(self, name) for name in SHARED_NAMES if name in reads}


def _write(self, role: LayerRole, made: dict[str, torch.Tensor]) -> None:
    """Publish what layer `role` made: its reset fields become None, then `made` is stored. A field
    the table does not let `role` write is refused."""
    wrong = set(made) - shared_writes(role)
    if wrong:
        raise RuntimeError(f"layer {role.id} ({role.role.value}) wrote {sorted(wrong)}, which the carry contract "
                           f"(model/carry.py) does not let it write")
    for name in shared_resets(role):
        setattr(self, name, None)
    for name, t in made.items():
        setattr(self, name, t)


# The CSA2 part of the block carry: one attribute per row of SHARED_FIELDS (None: not published).
SharedKV = make_dataclass(
    "SharedKV", [(f.name, "torch.Tensor | None", field(default=None)) for f in SHARED_FIELDS],
    namespace={"__doc__": "The CSA2 part of the block carry (model/carry.py: SHARED_FIELDS).", "read": _read,
               "write": _write, "__module__": __name__})


@dataclass
class Carry:
    """What one block hands the next (BLOCK_FIELDS, then the CSA2 fields in `shared`)."""

    h: torch.Tensor
    pre_mix: torch.Tensor
    shared: SharedKV = field(default_factory=SharedKV)

    def get(self, name: str) -> torch.Tensor | None:
        """The field `name` of the table (a block field or a CSA2 one)."""
        return getattr(self, name) if name in (f.name for f in BLOCK_FIELDS) else getattr(self.shared, name)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every field, in CARRY_FIELDS order (None for an unpublished CSA2 field)."""
        return tuple(self.get(f.name) for f in CARRY_FIELDS)

    @classmethod
    def from_tensors(cls, tensors) -> Carry:
        """The inverse of `tensors`."""
        values = dict(zip((f.name for f in CARRY_FIELDS), tensors, strict=True))
        shared = SharedKV(**{n: values[n] for n in SHARED_NAMES})
        return cls(**{f.name: values[f.name] for f in BLOCK_FIELDS}, shared=shared)
