"""Weighted data sources (DESIGN.md "Data"; data/README.md "Sources"): what the loader mixes.

A run reads one or more named sources, each a list of shards with a weight and a modality:

    data:
      sources:
        - {name: web,  shards: [/data/web/web-*.tar],   weight: 5, modality: text}
        - {name: code, shards: [/data/code/code-*.tar], weight: 3, modality: text}
        - {name: caps, shards: [/data/caps/caps-*.tar], weight: 2, modality: multimodal}

- The loader (data/loader.py) mixes the sources by weight **in tokens**: a row opens with the oldest
  buffered piece of the source furthest behind its share (emitted tokens / weight smallest; ties to the
  earlier source), then is filled by best fit over every source's buffer.
- Without `data.sources`, `data.text_shards` / `data.mm_shards` (or the default corpus) and `data.mix`
  give today's two sources, `text` (modality text) and `mm` (multimodal), weighted `data.mix` (7 : 1):
  the same batches as before sources had names.
- `modality` says which held-out source a source's weight counts towards (data/heldout.py scores
  `text` and `mm` documents, weighted by the sum of the weights of each modality's sources) and how the
  per-source metrics group; the documents of any source may hold images.
- A resume keeps every source's position (by name). Changed weights are allowed: the mix counts restart
  at the resume so that the new shares hold from there on (logged); a source added at a resume starts
  at its beginning, a removed one is dropped (logged).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from flashtrain.config.errors import DataError

MODALITIES = ("text", "multimodal")
DEFAULT_MIX = (7, 1)  # text : multimodal in tokens without data.sources (V41_SPEC §8)
SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class SourceConfigError(DataError):
    """A data.sources entry is invalid; the message names it and the fix."""


@dataclass
class SourceConfig:
    """One entry of `data.sources`."""

    name: str = ""  # names the source in metrics, checkpoints and prepare_data's files (letters, digits, _ . -)
    shards: list[str] = field(default_factory=list)  # paths, globs or webdataset URLs, as data.text_shards
    weight: float = 1.0  # share of the emitted tokens, relative to the other sources' weights
    modality: str = "text"  # text | multimodal: the held-out source its weight counts towards

    def validate(self) -> None:
        where = f"data.sources[{self.name or '?'}]"
        if not isinstance(self.name, str) or not SOURCE_NAME.match(self.name):
            raise SourceConfigError(f"{where}.name={self.name!r}: give a name of letters, digits, '_', '.', '-' "
                                    f"(e.g. name: web)")
        if not self.shards or isinstance(self.shards, str) or not all(isinstance(s, str) for s in self.shards):
            raise SourceConfigError(f"{where}.shards={self.shards!r}: give a list of shard paths, globs or URLs "
                                    f"(e.g. shards: [/data/{self.name}/{self.name}-*.tar])")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not (
                math.isfinite(self.weight) and self.weight > 0):
            raise SourceConfigError(f"{where}.weight={self.weight!r}: must be a positive number (a share of the "
                                    f"tokens relative to the other sources' weights); remove the source to stop "
                                    f"reading it")
        if self.modality not in MODALITIES:
            raise SourceConfigError(f"{where}.modality={self.modality!r}: must be one of {', '.join(MODALITIES)}")


@dataclass(frozen=True)
class Source:
    """A source as the loader reads it: shards resolved (sorted paths or URLs; [] for an absent default
    stream), `setting` the config key that named them (for messages)."""

    name: str
    shards: tuple[str, ...]
    weight: float
    modality: str
    setting: str


def source_configs(values) -> list[SourceConfig]:
    """`data.sources` as typed entries (names unique), from the list of mappings Hydra gives."""
    from flashtrain.config.typed import typed_config

    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values:
        raise SourceConfigError(f"data.sources={values!r}: give a non-empty list of {{name, shards, weight, "
                                f"modality}} entries, or null for data.text_shards / data.mm_shards")
    out = []
    for i, entry in enumerate(values):
        if isinstance(entry, SourceConfig):
            entry.validate()
            out.append(entry)
            continue
        if not isinstance(entry, dict):
            raise SourceConfigError(f"data.sources[{i}]={entry!r}: each entry is a mapping {{name, shards, weight, "
                                    f"modality}}")
        out.append(typed_config(SourceConfig, entry, f"data.sources[{entry.get('name', i)}]"))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise SourceConfigError(f"data.sources: the name(s) {', '.join(twice)} appear more than once; give each "
                                f"source its own name")
    return out


def default_sources(text: list[str], mm: list[str], mix=DEFAULT_MIX) -> list[Source]:
    """The two sources without `data.sources`: `text` and `mm`, weighted `mix` (either may have no shards)."""
    return [Source("text", tuple(sorted(text)), mix[0], "text", "text_shards"),
            Source("mm", tuple(sorted(mm)), mix[1], "multimodal", "mm_shards")]


def modality_weights(cfg) -> tuple[float, float]:
    """(text, multimodal) weight of a DataConfig: `data.mix`, or the sums over `data.sources` by modality
    (the held-out set's shares, data/heldout.py)."""
    if cfg.sources is None:
        return tuple(cfg.mix if cfg.mix is not None else DEFAULT_MIX)
    return tuple(sum(s.weight for s in cfg.sources if s.modality == m) for m in MODALITIES)
