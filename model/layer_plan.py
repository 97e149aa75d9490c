"""LayerPlan: the per-layer role table of CSA2 and CED (V41_SPEC §2).

One pure function, `layer_plan(cfg)`, turns the config into a tuple of `LayerRole`s. Attention, the
pipeline partitioner, `launch/plan.py` and the tests read it; nothing else re-derives roles.

Roles:
- SWA:     compress ratio 0; sliding window only (every layer, its window the whole prefix, with
           `model.attention: dense`: the CSA2 ablation).
- FULL:    a kv source: own compressor, own indexer (with its own index-K projection), own top-k.
- REUSE:   reads the nearest kv source's compressed KV and the nearest index source's top-k.
- REINDEX: an index source that is not a kv source: own indexer query, the kv source's KV and
           index-K, scoring restricted to the candidate pool when one is active.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from flashtrain.model.config import ModelConfig


class Role(str, Enum):
    SWA = "swa"
    FULL = "full"
    REUSE = "reuse"
    REINDEX = "reindex"


@dataclass(frozen=True)
class LayerRole:
    id: int
    role: Role
    compress_ratio: int
    kv_source: int | None  # layer whose compressed KV / index-K this layer reads (itself for FULL)
    index_source: int | None  # layer whose top-k this layer uses (itself for FULL / REINDEX)
    is_candidate_source: bool  # ranks blocks and publishes the candidate pool
    uses_candidates: bool  # indexer scores only inside the candidate pool
    engram: bool

    @property
    def has_compressor(self) -> bool:
        return self.role is Role.FULL

    @property
    def has_indexer(self) -> bool:
        return self.role in (Role.FULL, Role.REINDEX)

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "role": self.role.value,
            "compress_ratio": self.compress_ratio,
            "kv_source": self.kv_source,
            "index_source": self.index_source,
            "candidate_source": self.is_candidate_source,
            "uses_candidates": self.uses_candidates,
            "engram": self.engram,
        }


def _latest_at_or_before(ids: list[int], layer: int) -> int | None:
    found = [i for i in ids if i <= layer]
    return found[-1] if found else None


def layer_plan(cfg: ModelConfig) -> tuple[LayerRole, ...]:
    """Derive every layer's role from `compress_ratios`, `kv_source_layers`, `index_source_layers`,
    `candidate_source_layer` and `engram_layer_ids` (the config is validated first)."""
    cfg.validate()
    cand = cfg.candidate_source_layer
    roles = []
    for l, ratio in enumerate(cfg.backbone_compress_ratios):
        engram = l in cfg.engram_layer_ids
        if ratio == 0:
            roles.append(LayerRole(l, Role.SWA, 0, None, None, False, False, engram))
            continue
        kv_src = _latest_at_or_before(cfg.kv_source_layers, l)
        idx_src = _latest_at_or_before(cfg.index_source_layers, l)
        if l == kv_src:
            role = Role.FULL
        elif l == idx_src:
            role = Role.REINDEX
        else:
            role = Role.REUSE
        uses_candidates = (
            role is Role.REINDEX and cfg.candidate_restriction and 0 <= cand == kv_src
        )
        roles.append(LayerRole(l, role, ratio, kv_src, idx_src, l == cand, uses_candidates, engram))
    return tuple(roles)
