"""Step runners (DESIGN.md "Training"): the forward and backward of one optimizer step's micro-batches.

Two runners, one interface:
- `run(batches, routes) -> (StepValues, loads)`: zero the gradients, run every micro-batch's forward
  and backward, and finish the data-parallel gradient reduction (parallel/grad_reduce.py); returns the
  step's summed values on this rank (train/step_values.py: CE, aux losses, padding counts) and this
  rank's per-layer expert loads (not yet reduced). `routes`: per micro-batch, the routing indices to
  follow (Anticipatory Routing, train/stability/anticipatory.py), or None.
- `record_routes(batches) -> routes`: one forward without gradients over the micro-batches, recording
  the routing indices every local MoE layer picks.
- `evaluate(batches, token_bytes) -> scores`: one forward without gradients over held-out micro-batches
  (train/evaluation/heldout.py; a pipeline's count a multiple of `eval_group`): per micro-batch this rank's
  float64 [scores] sums (train/loss.py `heldout_sums`; zeros on a rank without the head's output), between
  steps (a pipeline's stats side channel is reset by the next step), leaving the gradients as they were.

The loss of a micro-batch is the head + cross-entropy tiled over the sequence (train/loss.py),
scaled by 1 / accumulation (the mean over micro-batches); the aux losses (balance, indexer KL) ride on
the backward with the same scale (model/aux.py). The gradient reduction starts buckets while the
step's last micro-batch completes them (the head's gradient in its loss forward, train/loss.py, the
others in its backward): the local runner marks every parameter before that micro-batch, the pipeline
runner hands the reducer to the step's last round (parallel/pipeline.py `Pipeline.run_round`), where
each stage marks its own parameters before its last backward and the last stage the head before its
last forward.

- `LocalRunner`: micro-batches one after another through the whole model (no pipeline).
- `PipelineRunner`: the micro-batches through the configured schedule in rounds of
  `round_microbatches`; every rank of a pipeline reads the same batches (its dp rank's), the last
  stage's losses give the CE, each stage reports the aux values and loads of its own layers, and the
  data counters are taken on pp rank 0 only.
Under context parallelism the cp ranks of a group read the same batches: only cp rank 0 counts
the padding (`counts_data`), so every all-reduce counts each quantity once per dp rank.
"""

from __future__ import annotations

import torch

from flashtrain.model.aux import StepStats
from flashtrain.parallel.dims import ParallelDims
from flashtrain.parallel.grad_reduce import GradReducer
from flashtrain.parallel.pipeline import Pipeline
from flashtrain.train.balancing import accumulate_loads
from flashtrain.train.loss import HELDOUT_SCORES, heldout_sums, tiled_lm_loss
from flashtrain.train.runtime.collectives import Operation
from flashtrain.train.step_values import MetricLayout, StepValues


class PipelineLoss:
    """The pipeline schedule's loss function: the last stage returns the final hidden states, not
    logits; head + cross-entropy tiled, scaled by 1 / accumulation (as `LocalRunner`'s). While
    `token_bytes` is set (`PipelineRunner.evaluate`), the held-out scores instead."""

    def __init__(self, model, loss_tile_tokens: int, accumulation: int, seq_len: int):
        self.model, self.tile, self.accumulation = model, loss_tile_tokens, accumulation
        self.split = model.sequence_split(seq_len)
        self.token_bytes: torch.Tensor | None = None
        # while set, per-source CE sums (a [B, S, 2] target: labels, sources)
        self.source_ce: torch.Tensor | None = None

    def __call__(self, hidden, labels):
        if self.token_bytes is not None:
            return heldout_sums(hidden, self.model.head, labels, self.token_bytes, self.tile, self.split)
        sources = None
        if labels.dim() == 3:  # the training target: labels and each label's data source (PipelineRunner)
            labels, sources = labels[..., 0], labels[..., 1]
        return tiled_lm_loss(hidden, self.model.head, labels, self.tile, 1.0 / self.accumulation, self.split,
                             sources, self.source_ce)



class StepBatches:
    """The step's micro-batches from the loader, `accumulation` of them per `next` (every rank of a
    pipeline reads the same ones: its dp rank's)."""

    def __init__(self, loader, accumulation: int):
        self.loader, self.accumulation = loader, accumulation

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        return [next(self.loader) for _ in range(self.accumulation)]


def _on(device, batch: dict):
    return (batch["tokens"].to(device), batch["token_types"].to(device),
            [[img.to(device) for img in row] for row in batch["images"]])


def n_sources(batches: list[dict]) -> int:
    """The data sources a step's batches count (data/loader.py `collate`); 0 for batches without them
    (the memory estimator's)."""
    return batches[0]["stream_tokens"].shape[1] if "stream_tokens" in batches[0] else 0


def record_data(sums: StepValues, batches: list[dict], n: int) -> None:
    """The metrics of the data that `batches` read (train/step_values.py): `padding_fraction`, the PAD positions over
    every position of the packed rows, B x (seq_len + 1) each (inputs and the last label; data/loader.py `collate`),
    and with `n` data sources their positions read and labels scored (the parts of `per_source`)."""
    sums.record("padding_fraction", (sum(b["pad_tokens"] for b in batches),
                                     sum(b["tokens"].numel() + b["tokens"].shape[0] for b in batches)), "ratio")
    if n:
        sums.record("source_tokens", torch.stack([b["stream_tokens"].sum(0) for b in batches]), size=n, report=False)
        sums.record("source_targets", torch.stack([b["source_targets"] for b in batches]), size=n, report=False)


class StepRunner:
    """What both runners share: the model, the gradient reducer, the micro-batch count, autocast."""

    eval_group = 1  # held-out micro-batches per `evaluate` call divide by this

    def __init__(self, model, reducer: GradReducer, accumulation: int, device: torch.device, loss_tile_tokens: int,
                 mixed_precision: bool, counts_data: bool, op: Operation, micro_batches: int = 1):
        self.model, self.reducer, self.accumulation, self.device = model, reducer, accumulation, device
        # the step's metrics, agreed over the ranks once (train/step_values.py); `micro_batches`: the global batch's
        self.layout = MetricLayout(micro_batches)
        self.loss_tile_tokens = loss_tile_tokens
        self.mixed_precision = mixed_precision
        self.counts_data = counts_data  # the cp ranks of a group read the same batches: count them once
        self.op = op

    def autocast(self):
        """bf16 autocast on CUDA (and when simulating it, train/plan/estimate.py); fp32 on the CPU."""
        if self.mixed_precision:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    def run(self, batches: list[dict], routes: list[dict] | None = None) -> tuple[StepValues, dict]:
        """Forward/backward of every micro-batch of the step and the finished gradient reduction."""
        self.reducer.zero_grad()
        self.op.name = "the forward/backward passes (pipeline transfers, expert all-to-all, gradient buckets)"
        with self.autocast():
            sums, loads = self._passes(batches, routes)
        self.op.name = "the gradient reduction"
        self.reducer.finish()
        return sums, loads

    def record_routes(self, batches: list[dict]) -> list[dict]:
        """Anticipatory Routing's extra forward (no gradients) over a step's micro-batches with the current
        parameters: per micro-batch, {MoE layer id: routing indices} of this rank's layers."""
        self.op.name = "the anticipatory-routing forward (pipeline transfers, expert all-to-all)"
        with torch.no_grad(), self.autocast():
            return self._record(batches)

    def evaluate(self, batches: list[dict], token_bytes: torch.Tensor) -> list[torch.Tensor]:
        """Held-out scores of `batches` (module docstring) with the current parameters."""
        self.op.name = "the held-out evaluation forward (pipeline transfers, expert all-to-all)"
        with torch.no_grad(), self.autocast():
            return self._evaluate(batches, token_bytes)

    def _passes(self, batches, routes) -> tuple[StepValues, dict]:
        raise NotImplementedError

    def _record(self, batches) -> list[dict]:
        raise NotImplementedError

    def _evaluate(self, batches, token_bytes) -> list[torch.Tensor]:
        raise NotImplementedError


class LocalRunner(StepRunner):
    """The micro-batches one after another through the whole local model."""

    def _passes(self, batches: list[dict], routes: list[dict] | None) -> tuple[StepValues, dict]:
        accum = self.accumulation
        loads: dict[int, torch.Tensor] = {}
        sums, n = StepValues(self.device, self.layout), n_sources(batches)
        source_ce = torch.zeros(n, dtype=torch.float64, device=self.device)
        for i, batch in enumerate(batches):
            if i == accum - 1:  # the gradients complete in this micro-batch (the head's in the loss forward,
                self.reducer.mark_final()  # train/loss.py; the rest in the backward): reduce buckets as they do
            stats = StepStats()
            tokens, types, images = _on(self.device, batch)
            hidden = self.model.final_hidden(self.model.run(tokens, types, images, stats, aux_grad_scale=1.0 / accum,
                                                            routes=None if routes is None else routes[i]))
            sources = batch["label_sources"].to(self.device) if n else None
            loss = tiled_lm_loss(hidden, self.model.head, batch["labels"].to(self.device), self.loss_tile_tokens,
                                 1.0 / accum, self.model.sequence_split(tokens.shape[1]), sources, source_ce)
            loss.backward()
            accumulate_loads(loads, stats.expert_load)  # on the device: no host sync per micro-batch
            sums.record("loss", loss * accum, "mean")
            sums.record("balance_loss", stats.total("balance_loss"), "mean")
            sums.record("indexer_loss", stats.total("indexer_loss"), "mean")
            if self.counts_data:
                record_data(sums, [batch], n)
        if n:
            sums.record("source_ce", source_ce, size=n, report=False)
        return sums, loads

    def _record(self, batches: list[dict]) -> list[dict]:
        out: list[dict] = []
        for batch in batches:
            recorded: dict = {}
            self.model.run(*_on(self.device, batch), StepStats(), recorded=recorded)
            out.append(recorded)
        return out

    def _evaluate(self, batches: list[dict], token_bytes: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for batch in batches:
            tokens, types, images = _on(self.device, batch)
            hidden = self.model.final_hidden(self.model.run(tokens, types, images, StepStats()))
            out.append(heldout_sums(hidden, self.model.head, batch["labels"].to(self.device), token_bytes,
                                    self.loss_tile_tokens, self.model.sequence_split(tokens.shape[1])))
        return out


class PipelineRunner(StepRunner):
    """The micro-batches through this rank's pipeline stages, `round_microbatches` per schedule round."""

    def __init__(self, model, pipe: Pipeline, reducer: GradReducer, accumulation: int, round_microbatches: int,
                 device: torch.device, loss_tile_tokens: int, mixed_precision: bool, counts_data: bool, op: Operation,
                 dims: ParallelDims, loss_fn: PipelineLoss, micro_batches: int = 1):
        super().__init__(model, reducer, accumulation, device, loss_tile_tokens, mixed_precision, counts_data, op,
                         micro_batches)
        self.pipe, self.round_microbatches, self.pp_rank = pipe, round_microbatches, dims.pp_rank
        self.rounds = accumulation // round_microbatches
        self.eval_group = round_microbatches
        self.loss_fn = loss_fn  # the schedule's: switched to the held-out scores while evaluating

    def _round_inputs(self, batches: list[dict], with_sources: bool = False):
        """A round's inputs concatenated; `with_sources`: the target [B, S, 2] holds each label's data
        source beside it (the per-source loss, `PipelineLoss`)."""
        tokens = torch.cat([b["tokens"] for b in batches]).to(self.device)
        types = torch.cat([b["token_types"] for b in batches]).to(self.device)
        labels = torch.cat([b["labels"] for b in batches])
        if with_sources:
            labels = torch.stack([labels, torch.cat([b["label_sources"] for b in batches])], dim=-1)
        labels = labels.to(self.device)
        images = [[img.to(self.device) for img in row] for b in batches for row in b["images"]]
        return tokens, types, labels, images

    def _passes(self, batches: list[dict], routes: list[dict] | None) -> tuple[StepValues, dict]:
        accum, m = self.accumulation, self.round_microbatches
        self.pipe.set_aux_grad_scale(1.0 / accum)
        self.pipe.stats.reset()
        sums, n = StepValues(self.device, self.layout), n_sources(batches)
        if n:
            self.loss_fn.source_ce = torch.zeros(n, dtype=torch.float64, device=self.device)
        try:
            for r in range(self.rounds):
                mine = batches[r * m:(r + 1) * m]
                tokens, types, labels, images = self._round_inputs(mine, with_sources=bool(n))
                losses = self.pipe.run_round(tokens, types, labels, images,
                                             None if routes is None else routes[r * m:(r + 1) * m],
                                             reducer=self.reducer if r == self.rounds - 1 else None)
                if losses:  # the schedule's losses are CE / accum
                    sums.record("loss", torch.stack(losses) * accum, "mean")
                if self.pp_rank == 0 and self.counts_data:
                    record_data(sums, mine, n)
            if n:
                sums.record("source_ce", self.loss_fn.source_ce, size=n, report=False)
        finally:
            self.loss_fn.source_ce = None
        sums.record("balance_loss", self.pipe.stats.balance, "mean")
        sums.record("indexer_loss", self.pipe.stats.indexer, "mean")
        return sums, dict(self.pipe.stats.expert_load)

    def _record(self, batches: list[dict]) -> list[dict]:
        out: list[dict] = []
        m = self.round_microbatches
        for r in range(self.rounds):
            tokens, types, labels, images = self._round_inputs(batches[r * m:(r + 1) * m])
            out += self.pipe.record_round(tokens, types, labels, images)
        return out

    def _evaluate(self, batches: list[dict], token_bytes: torch.Tensor) -> list[torch.Tensor]:
        m = self.round_microbatches
        out: list[torch.Tensor] = []
        self.loss_fn.token_bytes = token_bytes
        try:
            for r in range(0, len(batches), m):
                scores = self.pipe.eval_round(*self._round_inputs(batches[r:r + m]))
                out += scores or [torch.zeros(len(HELDOUT_SCORES), dtype=torch.float64, device=self.device)] * m
        finally:
            self.loss_fn.token_bytes = None
        return out
