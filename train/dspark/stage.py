"""The DSpark stage (`train.stage=dspark`, V41_SPEC §8b; docs/training.md "DSpark"): after pre-training, the
backbone is frozen and only the drafter (model/dspark.py) is trained, in the same loop, with the same
checkpoints and its own metrics.

- The backbone comes from `train.backbone`: a flashtrain run's checkpoint or an import of the release
  (launch/import_official.py). It is built for this rank (expert-sharded under ep, split under cp) and
  loaded, then frozen: `requires_grad_(False)` on every parameter, so autograd never computes a gradient
  for it and no optimizer, gradient reducer, clip or checkpoint sees it. Its forward runs under
  `torch.no_grad()` and keeps only what the drafter reads: the target layers' hc-means (the context), the
  final hidden states (the target distribution) and its embedding and head (shared, frozen).
- The drafter is what the loop trains: the "model" of the optimizers (the three-optimizer split,
  train/optim/routing.py), gradient reduction, clipping, the MoE bias update (its own routed experts,
  per modality as the backbone's), snapshots and checkpoints. A fresh stage starts the drafter from the
  backbone checkpoint's `mtp.*` tensors when it has them (an import of the release: continue DeepSeek's
  drafter), else from the seeded initialisation (model/init.py).
- Training data (DeepSpec's "online target" mode): the run's own data stream; each micro-batch goes
  through the frozen backbone first, so the context features and the target distribution are the
  backbone's on exactly these tokens. DeepSpec also regenerates chat answers with the target model
  (scripts/data/generate_train_data.py) for post-training data; for the pre-training corpus flashtrain
  uses the corpus text as it is, and the backbone's own distribution is the L1 / confidence target.
- The objective, its statistics and their sources: train/dspark/loss.py (DeepSpec `compute_dspark_loss`).
- Checkpoints hold the drafter (its `mtp.*` tensors as released, its MoE biases), its optimizer state, the
  data and RNG state, and `meta["backbone"]`: the backbone checkpoint's path and fingerprint (the SHA-256
  of its `checksums.json`, or of `.metadata` for a checkpoint without one). A resume against another
  backbone is refused, naming both.
- Metrics per step (train/dspark/loss.py `read_stats`): `loss` (the objective), `draft_loss` and
  `draft_loss_per_position`, `acceptance_length` {expected, measured}, `accept_rate_per_position`,
  `l1_loss`, `confidence_loss`, `confidence_ece`, `balance_loss` (the drafter's MoE).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path

import torch
from torch import nn

from flashtrain.config.errors import CheckpointError, ConfigError, InputNotFoundError
from flashtrain.model import Transformer
from flashtrain.model.aux import StepStats
from flashtrain.model.dspark import DSpark, block_tokens, context_features
from flashtrain.parallel.construct import build_rank_model
from flashtrain.parallel.context import ContextComm
from flashtrain.parallel.forward_pipeline import ForwardPipeline
from flashtrain.parallel.pipeline import local_stage_ranges
from flashtrain.train.balancing import accumulate_loads, global_loads
from flashtrain.train.checkpoint import load_weights, read_metadata
from flashtrain.train.dspark.loss import dspark_loss, read_stats, stat_size
from flashtrain.train.flops import dspark_flops_per_token
from flashtrain.train.module import RankParts, TrainModule, counts_data, optimizers_and_reducer
from flashtrain.train.official.layout import storage_format
from flashtrain.train.plan.stages import plan_stages, stage_units
from flashtrain.train.resume import check_model_config
from flashtrain.train.step_runner import StepRunner, _on, record_data
from flashtrain.train.step_values import StepValues

log = logging.getLogger(__name__)

STAGES = ("pretrain", "dspark")
# model fields a backbone checkpoint need not agree on with the DSpark stage's config: the drafter's own
DRAFTER_FIELDS = frozenset({"n_mtp_layers", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
                            "dspark_markov_rank", "dspark_n_routed_experts", "dspark_n_activated_experts"})


def validate_stage(c) -> None:
    """The stage's settings, before any process group or model exists (c: train/build.py RunConfigs); the
    backbone checkpoint itself is checked at a start (`check_backbone_path`), not by the memory estimator."""
    t = c.train
    if t.stage not in STAGES:
        raise ConfigError(f"train.stage={t.stage!r}: use one of {', '.join(STAGES)}")
    if t.stage == "pretrain":
        return
    c.model.validate_drafter()
    if c.model.dspark_n_routed_experts % c.parallel.ep:
        raise ConfigError(f"parallel.ep={c.parallel.ep} does not divide model.dspark_n_routed_experts="
                          f"{c.model.dspark_n_routed_experts} (the drafter's experts are sharded over ep too)")
    if c.parallel.pp > 1 and c.parallel.stages_per_rank != 1:
        raise ConfigError(f"parallel.pipeline_schedule={c.parallel.pipeline_schedule}: the DSpark stage pipelines the "
                          f"frozen backbone's forward with one stage per rank; use parallel.pipeline_schedule=1f1b")
    if t.spike.action == "rollback":
        raise ConfigError("train.spike.action=rollback: the rollback's Anticipatory Routing is not implemented for "
                          "the drafter; use train.spike.action=skip or none in the DSpark stage")


def check_backbone_path(c) -> None:
    """A start of the stage needs its backbone checkpoint (train/build.py `check_start`)."""
    t = c.train
    if t.stage != "dspark":
        return
    if not t.backbone:
        raise ConfigError("train.stage=dspark needs train.backbone=PATH: the checkpoint of the pre-trained backbone "
                          "(a run's checkpoints/step_XXXXXXXX, or launch/import_official.py's output)")
    if not (Path(t.backbone) / ".metadata").is_file():
        raise InputNotFoundError(f"train.backbone={t.backbone!r} is not a checkpoint (no .metadata); point it at a "
                                 f"checkpoints/step_XXXXXXXX directory or an import of the release")


def backbone_pointer(path: str | Path) -> dict:
    """{"path": absolute path, "fingerprint": SHA-256 of the checkpoint's checksums.json (its manifest,
    which holds every file's SHA-256), or of its .metadata when it has none}."""
    path = Path(path).resolve()
    manifest = path / "checksums.json"
    data = (manifest if manifest.is_file() else path / ".metadata").read_bytes()
    return {"path": str(path), "fingerprint": hashlib.sha256(data).hexdigest()}


def check_backbone(saved: dict | None, current: dict, checkpoint: str | Path) -> None:
    """A DSpark-stage checkpoint resumes only against the backbone it was trained against."""
    if saved is None:
        raise CheckpointError(f"checkpoint {checkpoint} records no backbone: it is not a DSpark-stage checkpoint "
                              f"(train.stage=dspark); resume it with train.stage=pretrain, or start the stage in a new "
                              f"run directory")
    if saved["fingerprint"] != current["fingerprint"]:
        raise CheckpointError(f"checkpoint {checkpoint} was trained against the backbone {saved['path']} (fingerprint "
                              f"{saved['fingerprint'][:12]}), but train.backbone={current['path']} is a different "
                              f"checkpoint (fingerprint {current['fingerprint'][:12]}); point train.backbone at the "
                              f"backbone the drafter was trained against, or start a new run directory")
    if saved["path"] != current["path"]:
        log.info(f"the backbone {saved['path']} is now at {current['path']} (same fingerprint)")


def has_drafter(path: str | Path) -> bool:
    """Does the checkpoint hold drafter tensors (`mtp.*`: an import of the release)?"""
    return any(k.startswith("model.mtp.") for k in read_metadata(path).state_dict_metadata)


def freeze(model: nn.Module, low_precision: bool = False) -> nn.Module:
    """The frozen backbone: no parameter requires a gradient (none is ever computed), eval mode.
    `low_precision` (CUDA, bf16 autocast): no fp32 master weights are needed, so every parameter is kept in
    bf16 but those the release stores in FP32 (sinks, mHC; train/official/layout.py), as the public inference
    code holds them: half the bytes of the largest part of the stage's memory."""
    model.requires_grad_(False)
    if low_precision:
        with torch.no_grad():
            for name, t in model.named_parameters():  # (buffers: RoPE tables stay fp32, the gate biases are FP32)
                if t.dtype == torch.float32 and storage_format(name, None, False) != "fp32":
                    t.data = t.data.to(torch.bfloat16)
    return model.eval()


def load_backbone(c, dims, device: torch.device, template: Transformer, path: str | Path,
                  tensor_mode=None, mixed_precision: bool = False, stages=None) -> Transformer:
    """This rank's backbone (its pipeline stage's blocks, experts sharded over ep, positions split under cp)
    with the weights of `path`, frozen; its model config must equal the run's but for the drafter's fields.
    The last pipeline stage keeps the embedding too: the drafter embeds its blocks with it."""
    keep_embed = stages is not None and stages[-1].is_last and template.embed is not None
    embed = template.embed if keep_embed else None
    model = build_rank_model(template, device, c.train.seed, stages, dims, tensor_mode)  # as build_rank's
    if keep_embed and model.embed is None:
        with tensor_mode or contextlib.nullcontext():
            model.embed = embed.to_empty(device=device)
    if dims.cp > 1:
        model.set_context_parallel(dims.cp, dims.cp_rank, c.parallel.cp_balance, ContextComm(dims.cp_group))
    if tensor_mode is None:
        meta = load_weights(path, model, dims.global_layout(model))
        saved = {k: v for k, v in meta["config"]["model"].items() if k not in DRAFTER_FIELDS}
        mine = {k: v for k, v in c.cfg_dict["model"].items() if k not in DRAFTER_FIELDS}
        saved["compress_ratios"] = saved.get("compress_ratios", [])[:c.model.n_layers]
        mine["compress_ratios"] = mine["compress_ratios"][:c.model.n_layers]
        check_model_config(saved, mine, path)
        if meta.get("config", {}).get("train", {}).get("stage", "pretrain") == "dspark":
            raise ConfigError(f"train.backbone={path} is a DSpark-stage checkpoint (a drafter); point train.backbone "
                              f"at the backbone checkpoint it names in its meta, or use train.resume_from")
    return freeze(model, low_precision=device.type == "cuda" or (tensor_mode is not None and mixed_precision))


def drafter_template(cfg) -> DSpark:
    with torch.device("meta"):
        return DSpark(cfg, init=False)


class DSparkRunner(StepRunner):
    """The step's micro-batches: the frozen backbone's no-grad forward (over the pipeline's stages under pp,
    `ForwardPipeline`), then, on the last stage, the drafter's forward over every anchor, the objective
    (train/dspark/loss.py) and its backward (the drafter only)."""

    def __init__(self, drafter: DSpark, backbone: Transformer, loss_cfg, reducer, accumulation: int,
                 pipe: ForwardPipeline | None = None, **common):
        super().__init__(drafter, reducer, accumulation, **common)
        self.backbone, self.loss_cfg, self.pipe = backbone, loss_cfg, pipe
        self.targets = list(drafter.cfg.dspark_target_layer_ids)
        self.K = drafter.block_size
        self.stat_size = stat_size(self.K, loss_cfg.ece_bins)

    def backbone_features(self, tokens, types, images):
        """The frozen backbone's forward (no gradient): (the context features [B, L, n_targets x dim] at this
        rank's positions, the final hidden states [B, S, dim] of the whole sequences); under pp this rank's
        stage only, and (None, None) but on the last stage."""
        bb, pipe = self.backbone, self.pipe
        with torch.no_grad():
            ctx = bb.context(tokens, types)
            ctx.captures = dict.fromkeys(self.targets)
            if pipe is None:
                carry = bb.run_blocks(bb.embed_inputs(tokens, types, images), ctx)
            else:
                carry, got = (bb.embed_inputs(tokens, types, images), {}) if pipe.first else pipe.receive(self.device)
                carry = bb.run_blocks(carry, ctx, pipe.stage.start, pipe.stage.end)
                got.update((t, v) for t, v in ctx.captures.items() if v is not None)
                if not pipe.last:
                    pipe.send(carry, got)
                    return None, None
                ctx.captures.update(got)
            final = bb.final_hidden(carry)
            split = bb.sequence_split(tokens.shape[1])
            if split is not None:  # the target distribution at every position (a block's may be another rank's)
                final = split.gather_entries([final[:, o:o + b - a] for (a, b), o in zip(split.chunks, split.offsets)],
                                             1)
            return context_features(ctx.captures, self.targets), final

    def micro_batch(self, batch: dict, stats: StepStats, scale: float):
        """One micro-batch's objective (scale x; with its graph) and statistics vector."""
        tokens, types, images = _on(self.device, batch)
        labels = batch["labels"].to(self.device)
        main_hidden, final = self.backbone_features(tokens, types, images)
        if main_hidden is None:  # a pipeline stage before the last: its part is done
            return None, None
        split = self.backbone.sequence_split(tokens.shape[1])
        positions = torch.arange(tokens.shape[1], device=self.device) if split is None else split.positions(
            self.device)
        first = labels[:, positions]
        blocks = block_tokens(first, self.K, self.model.cfg.dspark_noise_token_id)
        x = self.model.hidden(main_hidden, blocks, self.backbone.embed, stats, scale, split)
        return dspark_loss(x, self.model, self.backbone.head, final, labels, positions, self.loss_cfg,
                           self.loss_tile_tokens, scale, split)

    def _passes(self, batches: list[dict], routes) -> tuple[StepValues, dict]:
        if routes is not None:
            raise ConfigError("Anticipatory Routing is not implemented for the DSpark drafter")
        accum = self.accumulation
        loads: dict[int, torch.Tensor] = {}
        sums = StepValues(self.device, self.layout)
        for i, batch in enumerate(batches):
            if i == accum - 1:
                self.reducer.mark_final()
            if self.counts_data:  # (cp rank 0 of pipeline stage 0: each dp rank's batches counted once)
                record_data(sums, [batch], 0)
            stats = StepStats()
            loss, values = self.micro_batch(batch, stats, 1.0 / accum)
            if loss is None:  # a pipeline stage before the last
                continue
            loss.backward()
            accumulate_loads(loads, stats.expert_load)
            sums.record("loss", loss * accum, "mean")
            sums.record("balance_loss", stats.total("balance_loss"), "mean")
            sums.record("dspark", values, size=self.stat_size, report=False)
        return sums, loads

    def _record(self, batches) -> list[dict]:
        raise ConfigError("Anticipatory Routing is not implemented for the DSpark drafter")

    def _evaluate(self, batches, token_bytes) -> list[torch.Tensor]:
        raise ConfigError("the held-out LM evaluation does not apply to the DSpark stage (the backbone is frozen); "
                          "use launch/eval_dspark.py")


class DSparkModule(TrainModule):
    """The DSpark stage's train module (train/module.py): the drafter is the trained model (expert-sharded under
    ep; from the backbone checkpoint's `mtp.*` when it has them), with its optimizers and gradient reducer; the
    runner holds the frozen backbone. Its MoE layers are the drafter's (ids n_layers ..) with its own experts; no
    ViT to unfreeze, no held-out LM evaluation; its checkpoints name the backbone they were trained against."""
    evaluates = False  # the backbone is frozen: launch/eval_dspark.py measures the drafter

    @classmethod
    def build(cls, c, plan, dims, device, template, op, schedule, mixed_precision: bool, is_main: bool = True,
              tensor_mode=None) -> DSparkModule:
        stages, pipe = None, None
        if dims.pp > 1:  # the backbone's blocks in the pre-training partition, the drafter on the last stage
            units = stage_units(template, c.model, c.optim, c.parallel, c.data.seq_len, c.data.batch_size,
                                c.train.recompute, mixed_precision, dims.dp_cp, dims.cp, plan.round_inputs)
            stages = local_stage_ranges(c.parallel, plan_stages(units, c.parallel, plan.round_microbatches),
                                        dims.pp_rank)
            pipe = ForwardPipeline(c.model, stages[0], dims, c.data.batch_size, c.data.seq_len)
        backbone = load_backbone(c, dims, device, template, c.train.backbone, tensor_mode, mixed_precision, stages)
        drafter_meta = drafter_template(c.model)
        if pipe is not None and not pipe.last:
            drafter_meta.mtp = nn.ModuleList()  # only the last stage holds (and trains) the drafter
        drafter = build_rank_model(drafter_meta, device, c.train.seed, None, dims, tensor_mode)
        drafter.set_recompute(c.train.recompute)
        if tensor_mode is None and has_drafter(c.train.backbone) and len(drafter.mtp):
            load_weights(c.train.backbone, drafter, dims.global_layout(drafter))
            log.info(f"drafter initialised from the mtp.* tensors of {c.train.backbone}")
        with tensor_mode or contextlib.nullcontext():
            optim, reducer = optimizers_and_reducer(drafter, c, dims, schedule.lr(0))
        runner = DSparkRunner(drafter, backbone, c.train.dspark, reducer, plan.accumulation, device=device,
                              loss_tile_tokens=c.train.loss_tile_tokens, mixed_precision=mixed_precision,
                              counts_data=counts_data(dims) and dims.pp_rank == 0, op=op, pipe=pipe,
                              micro_batches=plan.global_microbatches)
        return cls(c, plan, dims, device, RankParts(drafter, None, optim, reducer, runner), op, schedule,
                   mixed_precision, is_main, guard=tensor_mode is None)

    def begin_step(self, step: int) -> None:
        self.optim.set_lr(self.schedule.lr(step))  # the backbone (its ViT included) is frozen

    def global_loads(self, loads: dict) -> dict[int, torch.Tensor]:
        m = self.cfg.model
        return global_loads(loads, m.n_layers + m.n_mtp_layers, m.dspark_n_routed_experts, device=self.device,
                            first=m.n_layers)

    def flops_per_token(self, seq_len: int) -> float:
        return dspark_flops_per_token(self.cfg.model, seq_len)

    def record(self, out, v: dict, step: int) -> dict:
        """The drafter's metrics (train/dspark/loss.py `read_stats`); the backbone is frozen (no indexer loss, no
        ViT)."""
        record = {k: x for k, x in super().record(out, v, step).items() if k != "vit_trainable"}
        return record | read_stats(v["dspark"], self.cfg.model.dspark_block_size, self.cfg.train.dspark.ece_bins)

    def frozen(self) -> list[nn.Module]:
        return [self.runner.backbone]

    def stages(self) -> list[int]:
        return [0] if self.runner.pipe is None else [self.runner.pipe.stage.index]  # the backbone's pipeline

    def checkpoint_meta(self) -> dict:
        hasher = getattr(self.model, "engram_hasher", None) or getattr(self.runner.backbone, "engram_hasher", None)
        return {"engram_compressed_vocab_size": None if hasher is None else hasher.compressed_vocab,
                "backbone": backbone_pointer(self.cfg.train.backbone)}  # the backbone the drafter is trained against

    def check_resume(self, meta: dict, path) -> None:
        super().check_resume(meta, path)
        check_backbone(meta.get("backbone"), backbone_pointer(self.cfg.train.backbone), path)
