"""What one optimizer step reports (DESIGN.md "Training": metrics), through one call (OLMo-core's
`record_metric` is the model): `values.record(name, value, reduce)` where the value is known -- a step runner
per micro-batch, the train module once per step. The values stay on the device while the step runs (no host
read per micro-batch or per layer), are reduced over every rank in one all-reduce at its end (a second, MAX,
only when a `max` metric exists) and read back in one copy. Every metric goes into the step's record under
its name (train/module.py `record`); `report=False` keeps the parts of a record field that is built from
several (the per-source sums, `source_fields`; the DSpark stage's statistics, train/dspark/loss.py).

| reduce | over micro-batches and ranks | the record's value |
|---|---|---|
| `sum` | summed | the sum |
| `count` | summed | the sum, an integer |
| `mean` | summed | the sum over the global batch's micro-batches (`MetricLayout.micro_batches`) |
| `max` | the largest | the largest |
| `ratio` | numerator and denominator summed apart | numerator / denominator (null where it is 0) |

A value is a number or a tensor, summed down to one number; with `size=n`, a vector of n (a [..., n] tensor
summed down to [n]); a `ratio`'s value is the pair (numerator, denominator).

| metric | reduce | recorded by |
|---|---|---|
| `loss` | mean | every micro-batch's mean CE (the last pipeline stage; train/step_runner.py) |
| `balance_loss`, `indexer_loss` | mean | the aux side channel (model/aux.py), every stage its own layers |
| `padding_fraction` | ratio | PAD over every position of the packed rows (`record_data`, pipeline rank 0) |
| `skipped_samples`, `skipped_images`, `corrupt_shards` | count | the loader's counters (`loader_fields`) |
| `source_tokens`, `source_targets`, `source_ce` | sum, parts | the batches and the loss -> `per_source` |
| `dspark` | sum, parts | the DSpark stage's objective (train/dspark/stage.py) |

Ranks record different metrics (only the last pipeline stage has a loss), so a process's first all-reduce
agrees on the union of every rank's metrics (`MetricLayout.agree`: one `all_gather_object`), in name order;
a metric first recorded after that, or recorded two ways, is an error naming it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

LOADER_COUNTERS = ("skipped_empty", "skipped_bad_image", "skipped_oversized_image", "bad_samples", "corrupt_shards")
# the record's three loader fields (`loader_fields`): samples skipped for any reason, those skipped for an image
SAMPLE_COUNTERS = ("skipped_empty", "skipped_bad_image", "skipped_oversized_image", "bad_samples")
IMAGE_COUNTERS = ("skipped_bad_image", "skipped_oversized_image")
REDUCES = ("sum", "count", "mean", "max", "ratio")


def loader_fields(v: dict) -> dict:
    """The loader's counters as every metrics record carries them (cumulative since the run began, summed
    over the dp ranks; data/loader.py): `skipped_samples`, every sample skipped -- one that could not be
    parsed, an empty document, or one dropped for its image; `skipped_images`, the part of those dropped
    for an image (undecodable, or a span longer than a row); `corrupt_shards`, the distinct shards found
    truncated or unreadable, by the start-up check of their tar indexes or while reading."""
    return {"skipped_samples": int(sum(v.get(k, 0) for k in SAMPLE_COUNTERS)),
            "skipped_images": int(sum(v.get(k, 0) for k in IMAGE_COUNTERS)),
            "corrupt_shards": int(v.get("corrupt_shards", 0))}


def source_fields(sources, v: dict, tokens_seen: dict[str, int]) -> dict:
    """The record's `per_source`: for each data source with shards (data/sources.py; in `sources` order, as
    the step's per-source values), `tokens_seen`, the positions of its documents read so far (rows of
    seq_len + 1 positions, over every dp rank; added to `tokens_seen`, the run's running count by name: a
    rolled-back step's reads stay counted, the data moves on), and `loss`, this step's mean CE over the
    labels of its documents that are scored -- PAD and image positions are not (null: none in this step)."""
    out = {}
    for source, tokens, targets, ce in zip(sources, v.get("source_tokens", ()), v.get("source_targets", ()),
                                           v.get("source_ce", ())):
        if not source.shards:
            continue
        tokens_seen[source.name] = tokens_seen.get(source.name, 0) + int(tokens)
        out[source.name] = {"tokens_seen": tokens_seen[source.name], "loss": ce / targets if targets else None}
    return out


class Metric(NamedTuple):
    """How a metric is reduced, its length (None: one number) and whether the record reports it."""
    reduce: str
    size: int | None
    report: bool

    def width(self) -> int:
        """Its float64 slots in the reduced vector."""
        return (self.size or 1) * (2 if self.reduce == "ratio" else 1)

    def nothing(self, device: torch.device) -> torch.Tensor:
        """Its total before any value: 0 ([2, ...] for a ratio's two parts), -inf for a max."""
        shape = (2,) * (self.reduce == "ratio") + (() if self.size is None else (self.size,))
        return torch.full(shape, -math.inf if self.reduce == "max" else 0.0, dtype=torch.float64, device=device)


def _collective(group) -> bool:
    """Whether the values are reduced over other processes (not alone, not torch's fake process group)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1 and \
        dist.get_backend(group) != "fake"


class MetricLayout:
    """The metrics of every rank, agreed once per process and kept across its steps (module docstring), and
    `micro_batches`, the global batch's micro-batch count a `mean` is taken over."""

    def __init__(self, micro_batches: int = 1):
        self.micro_batches = micro_batches
        self.metrics: dict[str, Metric] | None = None

    def agree(self, local: dict[str, Metric], group=None) -> dict[str, Metric]:
        """Every rank's metrics in name order: the first call gathers them from every rank of `group` (a
        collective: each rank calls it at the same point of its first step), later calls check `local`."""
        if self.metrics is None:
            gathered = [local]
            if _collective(group):
                gathered = [None] * dist.get_world_size(group)
                dist.all_gather_object(gathered, local, group=group)
            union: dict[str, Metric] = {}
            for metrics in gathered:
                for name, metric in metrics.items():
                    _same(name, union.setdefault(name, metric), metric)
            self.metrics = dict(sorted(union.items()))
            return self.metrics
        for name, metric in local.items():
            if name not in self.metrics:
                raise RuntimeError(f"metric {name!r} was first recorded after this process's first step: record it "
                                   f"from the first step on (0 where it does not apply) so every rank agrees on it")
            _same(name, self.metrics[name], metric)
        return self.metrics


def _same(name: str, known: Metric, metric: Metric) -> None:
    if known != metric:
        raise ValueError(f"metric {name!r} is recorded as {metric} and as {known}: record it one way everywhere")


class StepValues:
    """One step's metrics on this rank (module docstring); `layout`: the run's (the step runner's)."""

    def __init__(self, device: torch.device, layout: MetricLayout | None = None):
        self.device = device
        self.layout = layout or MetricLayout()
        self.local: dict[str, Metric] = {}
        self.totals: dict[str, torch.Tensor] = {}
        self.reduced: tuple[torch.Tensor, torch.Tensor] | None = None  # (summed, largest) slots, after `all_reduce`

    def record(self, name: str, value, reduce: str = "sum", size: int | None = None, report: bool = True) -> None:
        """Add `value` (a number or a tensor; a ratio's (numerator, denominator)) to metric `name`."""
        if reduce not in REDUCES:
            raise ValueError(f"metric {name!r}: reduce={reduce!r}, use one of {', '.join(REDUCES)}")
        metric = Metric(reduce, size, report)
        _same(name, self.local.setdefault(name, metric), metric)
        total = self.totals.get(name)
        if total is None:
            total = self.totals[name] = metric.nothing(self.device)
        if reduce == "ratio":
            total[0] += self._collapsed(value[0], size)
            total[1] += self._collapsed(value[1], size)
        elif reduce == "max":
            value = self._collapsed(value, size, largest=True)
            if torch.is_tensor(value):
                torch.maximum(total, value, out=total)
            else:
                total.clamp_(min=value)
        else:
            total += self._collapsed(value, size)

    def _collapsed(self, value, size: int | None, largest: bool = False):
        """A tensor as float64 on the device, summed (or its largest taken) down to one number or to [size]."""
        if not torch.is_tensor(value):
            return value
        value = value.detach().to(self.device, torch.float64)
        if size is None:
            return value.max() if largest else value.sum()
        value = value.reshape(-1, size)
        return value.amax(0) if largest else value.sum(0)

    def _slots(self, metrics: dict[str, Metric]) -> tuple[torch.Tensor, torch.Tensor]:
        """The totals of `metrics` in their order, those not recorded here as nothing (0, or -inf for a max):
        (the summed metrics' slots, the largest's)."""
        parts: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        for name, metric in metrics.items():
            total = self.totals.get(name)
            total = total if total is not None else metric.nothing(self.device)
            parts[metric.reduce == "max"].append(total.reshape(-1))
        return tuple(torch.cat(p) if p else torch.zeros(0, dtype=torch.float64, device=self.device)
                     for p in (parts[False], parts[True]))

    def all_reduce(self, group=None) -> "StepValues":
        """Reduce over `group` (default: every rank): the one all-reduce of the step's summed metrics (and one
        MAX all-reduce of the largest, when a metric has them)."""
        summed, largest = self.reduced = self._slots(self.layout.agree(self.local, group))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(summed, group=group)
            if largest.numel():
                dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        return self

    def global_value(self, name: str) -> float:
        """The sum of metric `name` (one number) over every rank, on the host, before the step's reduction (the
        spike check needs the global loss before the optimizer step: one scalar all-reduce + host read); a rank
        that did not record it adds 0."""
        total = self.totals.get(name)
        v = torch.zeros(1, dtype=torch.float64, device=self.device) if total is None else total.clone().reshape(1)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(v)
        return v.item()

    def read(self, **extra: torch.Tensor | None) -> dict:
        """Every metric's value (the table in the module docstring; a vector as a list) from the one device-to-host
        copy of the step's values (reduced, or this rank's own before `all_reduce`), with any `extra` tensors read
        in the same copy (the gradient norm, the expert-load statistics): a 0-dim one as a number, others as
        nested lists of their shape; None stays None."""
        metrics = self._metrics()
        summed, largest = self.reduced if self.reduced is not None else self._slots(metrics)
        given = {k: t for k, t in extra.items() if t is not None}
        values = torch.cat([summed, largest, *(t.detach().to(summed.device, torch.float64).reshape(-1)
                                               for t in given.values())]).tolist()
        out: dict = {}
        at = {False: 0, True: summed.numel()}
        for name, metric in metrics.items():
            is_max = metric.reduce == "max"
            flat = values[at[is_max]:at[is_max] + metric.width()]
            at[is_max] += metric.width()
            out[name] = _value(metric, flat, self.layout.micro_batches)
        at = summed.numel() + largest.numel()
        for name, t in given.items():
            flat = values[at:at + t.numel()]
            at += t.numel()
            out[name] = flat[0] if t.dim() == 0 else _nested(flat, list(t.shape))
        out.update({k: None for k, t in extra.items() if t is None})
        return out

    def reported(self, v: dict) -> dict:
        """The metrics of `v` (`read`) that the step's record reports."""
        return {name: v[name] for name, metric in self._metrics().items() if metric.report}

    def _metrics(self) -> dict[str, Metric]:
        """The metrics in their order: every rank's as agreed after `all_reduce`, this rank's before."""
        return self.layout.metrics if self.reduced is not None else dict(sorted(self.local.items()))


def _value(metric: Metric, flat: list[float], micro_batches: int):
    """A metric's reduced slots as the record's value (module docstring)."""
    if metric.reduce == "ratio":
        n = len(flat) // 2
        out = [num / den if den else None for num, den in zip(flat[:n], flat[n:])]
    elif metric.reduce == "mean":
        out = [x / micro_batches for x in flat]
    elif metric.reduce == "count":
        out = [int(x) for x in flat]
    else:
        out = flat
    return out[0] if metric.size is None else out


def _nested(flat: list, shape: list[int]) -> list:
    """A flat row-major list as nested lists of `shape`."""
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0]
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
