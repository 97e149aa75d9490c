"""What one optimizer step reports (DESIGN.md "Training": metrics): named values accumulated on the
device while the step runs -- no host read per micro-batch or per layer -- and summed over every rank
in one all-reduce at its end.

| field | added by | per |
|---|---|---|
| `ce` | the loss of every micro-batch (its mean CE; the last pipeline stage) | micro-batch |
| `balance_loss`, `indexer_loss` | the aux side channel (model/aux.py), every stage its own layers | micro-batch |
| `pad_tokens`, `positions` | the batches (pipeline rank 0 only, so each is counted once per dp rank) | micro-batch |
| loader counters (`LOADER_COUNTERS`) | the data loader's skip counts (pipeline rank 0) | step |
| per source (`SOURCE_FIELDS`): `source_tokens`, `source_targets` | the batches (pp rank 0) | micro-batch |
| `source_ce` (each source's CE sum) | the loss (the last stage; every cp rank its positions) | micro-batch |
| named vectors (`vectors`): `dspark` (train/dspark/loss.py) | the DSpark stage's objective | micro-batch |

`source_tokens` counts the positions read, `source_targets` the scored labels.

The metrics record reports the loader counters as three fields (`loader_fields`), the padding as
`padding_fraction` and the per-source values as `per_source` (`source_fields`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LOADER_COUNTERS = ("skipped_empty", "skipped_bad_image", "skipped_oversized_image", "bad_samples", "corrupt_shards")
# the record's three loader fields (`loader_fields`): samples skipped for any reason, those skipped for an image
SAMPLE_COUNTERS = ("skipped_empty", "skipped_bad_image", "skipped_oversized_image", "bad_samples")
IMAGE_COUNTERS = ("skipped_bad_image", "skipped_oversized_image")
FIELDS = ("ce", "balance_loss", "indexer_loss", "pad_tokens", "positions") + LOADER_COUNTERS
SOURCE_FIELDS = ("source_tokens", "source_targets", "source_ce")
_INDEX = {name: i for i, name in enumerate(FIELDS)}


def loader_fields(v: dict) -> dict:
    """The loader's counters as every metrics record carries them (cumulative since the run began, summed
    over the dp ranks; data/loader.py): `skipped_samples`, every sample skipped -- one that could not be
    parsed, an empty document, or one dropped for its image; `skipped_images`, the part of those dropped
    for an image (undecodable, or a span longer than a row); `corrupt_shards`, the distinct shards found
    truncated or unreadable, by the start-up check of their tar indexes or while reading."""
    return {"skipped_samples": int(sum(v[k] for k in SAMPLE_COUNTERS)),
            "skipped_images": int(sum(v[k] for k in IMAGE_COUNTERS)),
            "corrupt_shards": int(v["corrupt_shards"])}


def padding_fraction(v: dict) -> float:
    """The record's `padding_fraction`: the PAD positions over every position of the step's packed rows,
    B x (seq_len + 1) per micro-batch (inputs and the last label; data/loader.py `collate`), over every dp
    rank."""
    return v["pad_tokens"] / max(v["positions"], 1.0)


def source_fields(sources, v: dict, tokens_seen: dict[str, int]) -> dict:
    """The record's `per_source`: for each data source with shards (data/sources.py; in `sources` order, as
    the step's per-source values), `tokens_seen`, the positions of its documents read so far (rows of
    seq_len + 1 positions, over every dp rank; added to `tokens_seen`, the run's running count by name: a
    rolled-back step's reads stay counted, the data moves on), and `loss`, this step's mean CE over the
    labels of its documents that are scored -- PAD and image positions are not (null: none in this step)."""
    out = {}
    for source, tokens, targets, ce in zip(sources, v["source_tokens"], v["source_targets"], v["source_ce"]):
        if not source.shards:
            continue
        tokens_seen[source.name] = tokens_seen.get(source.name, 0) + int(tokens)
        out[source.name] = {"tokens_seen": tokens_seen[source.name], "loss": ce / targets if targets else None}
    return out


class StepValues:
    def __init__(self, device: torch.device, n_sources: int = 0, vectors: dict[str, int] | None = None):
        self.n_sources = n_sources
        self.vectors: dict[str, slice] = {}
        at = len(FIELDS) + len(SOURCE_FIELDS) * n_sources
        for name, size in (vectors or {}).items():
            self.vectors[name] = slice(at, at + size)
            at += size
        self.values = torch.zeros(at, dtype=torch.float64, device=device)

    def add(self, name: str, value) -> None:
        """Add a number or a (device) tensor to field `name`."""
        if torch.is_tensor(value):
            value = value.detach().to(self.values.device, torch.float64).sum()
        self.values[_INDEX[name]] += value

    def add_sources(self, name: str, values: torch.Tensor) -> None:
        """Add a per-source vector ([n_sources]; a [..., n_sources] tensor is summed down to it) to `name`
        of SOURCE_FIELDS."""
        at = len(FIELDS) + SOURCE_FIELDS.index(name) * self.n_sources
        values = values.detach().to(self.values.device, torch.float64).reshape(-1, self.n_sources).sum(0)
        self.values[at:at + self.n_sources] += values

    def add_vector(self, name: str, values: torch.Tensor) -> None:
        """Add a vector to the named vector `name` (given at construction)."""
        self.values[self.vectors[name]] += values.detach().to(self.values.device, torch.float64)

    def all_reduce(self, group=None) -> "StepValues":
        """Sum over `group` (default: every rank), in place; the one collective of the step's values."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.values, group=group)
        return self

    def global_value(self, name: str) -> float:
        """One field summed over every rank, on the host, leaving the step's own sums as they are (the
        spike check needs the global loss before the optimizer step: one scalar all-reduce + host read)."""
        v = self.values[_INDEX[name]].clone().reshape(1)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(v)
        return v.item()

    def read(self, **extra: torch.Tensor | None) -> dict:
        """The values on the host: the one device-to-host copy of the step's values (a per-source field
        as a list), with any `extra` tensors read in the same copy (the gradient norm, the expert-load
        statistics): a 0-dim one as a number, others as nested lists of their shape; None stays None."""
        given = {k: t for k, t in extra.items() if t is not None}
        values = torch.cat([self.values, *(t.detach().to(self.values.device, torch.float64).reshape(-1)
                                           for t in given.values())]).tolist()
        out: dict = dict(zip(FIELDS, values))
        at = self.values.numel()
        for name, t in given.items():
            flat = values[at:at + t.numel()]
            at += t.numel()
            out[name] = flat[0] if t.dim() == 0 else _nested(flat, list(t.shape))
        out.update({k: None for k, t in extra.items() if t is None})
        for i, name in enumerate(SOURCE_FIELDS):
            at = len(FIELDS) + i * self.n_sources
            out[name] = values[at:at + self.n_sources]
        for name, where in self.vectors.items():
            out[name] = values[where]
        return out


def _nested(flat: list, shape: list[int]) -> list:
    """A flat row-major list as nested lists of `shape`."""
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0]
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
