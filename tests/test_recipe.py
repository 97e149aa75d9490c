"""The whole recipe in one run (issue 48): the stages of train.recipe crossed by one command in the same
processes, a node lost and the run continued on fewer, with the data trace (data.trace) showing every
document read once -- checked against the shards' contents -- and the LR of every step the schedule's
value for the tokens seen. train/recipe.py, data/loader.py `relayout`, data/trace.py."""

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import warm_launch
from layer_plans import FOUR_LAYERS
from omegaconf import OmegaConf

from flashtrain.config.errors import ConfigError
from flashtrain.data.shards import Document, ReadStats, read_shard, write_shards
from flashtrain.data.tokenizer import train_tokenizer
from flashtrain.train.config import compose, model_config, token_spec
from flashtrain.train.recipe import check_fixed_batch, stage_at, stage_config, stage_list

ROOT = Path(__file__).resolve().parent.parent
PEAK, FINAL = 2.6e-4, 2.6e-5
# 12 steps of 512 tokens: warmup 3 steps, hold to 3072 tokens (step 6), cosine to 4608 (step 9), hold
SCHEDULE = ["schedule.total_tokens=6144", f"schedule.peak_lr={PEAK}", f"schedule.final_lr={FINAL}",
            "schedule.warmup_fraction=0.25", "schedule.decay_start_fraction=0.5", "schedule.decay_end_fraction=0.75"]
# dp=2 readers of 128-token rows; from 1024 tokens (after step 2) one 256-token sequence over cp=2 ranks (one
# reader); from 2048 tokens (after step 4) two readers of 128-token rows again
RECIPE = ("train.recipe.stages=[{name: long, from_tokens: 1024, overrides: ['data.seq_len=256', 'parallel.cp=2']}, "
          "{name: back, from_tokens: 2048, overrides: ['data.seq_len=128', 'parallel.cp=1']}]")


def lr_at(step: int) -> float:
    """The schedule of SCHEDULE, written out: step s (0-based) has seen 512 s tokens."""
    if step < 3:
        return PEAK * (step + 1) / 3
    t = 512 * step
    if t < 3072:
        return PEAK
    if t >= 4608:
        return FINAL
    return FINAL + (PEAK - FINAL) * 0.5 * (1 + math.cos(math.pi * (t - 3072) / 1536))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """48 text documents of 20-90 tokens in 6 shards (about 2,700 positions: 12 steps read 2 epochs), with
    the model's tokenizer beside them; {(shard, key): positions of [BOS] + text + [EOS]} read back."""
    out = tmp_path_factory.mktemp("recipe_shards")
    spec = token_spec(model_config(compose(["+exp=flash_tiny"])))
    train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 30, spec).save(str(out / "tokenizer.json"))
    rng = np.random.default_rng(1)
    docs = [Document([("text", rng.integers(10, 400, int(rng.integers(20, 90))).astype(np.int32))]) for _ in range(48)]
    write_shards(iter(docs), out, "text", 8)
    sizes = {(str(p), d.key): len(d.segments[0][1]) + 2 for p in sorted(out.glob("text-*.tar"))
             for d in read_shard(str(p), ReadStats())}
    return out, sizes


def _pretrain(run, shards_dir, *overrides, procs=2, env=None):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
           if procs > 1 else [sys.executable])
    cmd += [str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", *FOUR_LAYERS, f"hydra.run.dir={run}",
            f"data.text_shards=[{shards_dir}/text-*.tar]", "data.mm_shards=null", "data.batch_size=1",
            "data.pack_buffer=4",  # a small packing buffer: the first epoch drains within the run
            "data.trace=true", "train.global_batch_tokens=512", "train.eval.interval=0", "train.peak_tflops.cpu=1",
            "logging.wandb.mode=disabled", "logging.progress=false", "logging.heatmap_interval=0", *SCHEDULE,
            RECIPE, *overrides]
    return warm_launch.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                           env={**os.environ, **(env or {})})


def _trace(run):
    lines = [json.loads(line) for p in sorted((run / "data_trace").glob("*.jsonl"))
             for line in p.read_text().splitlines()]
    return sorted(lines, key=lambda r: (r["step"], r["dp_rank"], r["micro_batch"]))


@pytest.mark.slow
def test_the_recipe_runs_its_stages_and_survives_a_lost_node_reading_each_document_once(tmp_path, shards):
    """One command: 2 steps at dp=2, 2 at cp=2 (one reader of 256-token rows), then dp=2 again to step 6, in
    the same two processes. Then a rank is killed after step 9 (its checkpoint is step 8) and the run goes
    on in one process (one reader) to step 12. Over the whole run: each step traced once with its rows
    (dp=2: 2 readers x 2 one-row micro-batches of 128 positions + 1; cp=2: 2 micro-batches of 257), every
    document's positions read at most once per epoch and every document of the first epoch read whole
    (from the trace files and the shards, not the loader's counters); metrics.jsonl holds steps 1-12 once,
    each with 512 tokens more and the schedule's LR."""
    shards_dir, sizes = shards
    run = tmp_path / "run"
    first = _pretrain(run, shards_dir, "train.max_steps=6", "train.checkpoint.interval=10")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    out = first.stdout + first.stderr
    assert "recipe stage 'first' (1 of 3): the exp as composed; next: 'long' from 1024 tokens" in out
    assert "recipe stage 'long' from 1024 tokens: saved step 2 (1,024 tokens)" in out
    assert "recipe stage 'long' (2 of 3): data.seq_len=256 parallel.cp=2; next: 'back' from 2048 tokens" in out
    assert "2 process(es) on cpu, pp=1 dp=1 ep=1 cp=2" in out
    assert "re-split over 2 reader(s) x 1 worker(s), rows of 129" in out
    killed = _pretrain(run, shards_dir, "train.max_steps=12", "train.checkpoint.interval=2",
                       env={"FLASHTRAIN_FAULT": "kill:rank=1:step=9:point=after_step"})
    assert killed.returncode != 0
    alone = _pretrain(run, shards_dir, "train.max_steps=12", "train.checkpoint.interval=2", procs=1)
    assert alone.returncode == 0, alone.stdout[-4000:] + alone.stderr[-4000:]
    assert f"resumed from {run}/checkpoints/step_00000008 at step 8" in alone.stdout + alone.stderr

    trace = _trace(run)
    # (readers, micro-batches per reader) of each step: the global batch of 512 tokens in one-row micro-batches
    layout = {**dict.fromkeys((1, 2, 5, 6, 7, 8), (2, 2)), 3: (1, 2), 4: (1, 2), **dict.fromkeys(range(9, 13), (1, 4))}
    for step, (n, micro) in layout.items():
        lines = [r for r in trace if r["step"] == step]
        assert [(r["dp_rank"], r["micro_batch"], r["readers"]) for r in lines] == [
            (d, m, n) for d in range(n) for m in range(micro)], step
        width = 257 if step in (3, 4) else 129
        assert all(len(r["rows"]) == 1 and sum(p[5] - p[4] for p in r["rows"][0]) <= width for r in lines), step
    ranges: dict = {}
    for r in trace:
        for source, shard, key, epoch, start, end in r["rows"][0]:
            assert source == "text"
            ranges.setdefault((shard, key, epoch), []).append((start, end))
    for (shard, key, epoch), got in ranges.items():  # no position of a document read twice in an epoch
        got.sort()
        assert all(b[0] >= a[1] for a, b in zip(got, got[1:])) and got[-1][1] <= sizes[(shard, key)], got
    assert {0, 1} <= {k[2] for k in ranges}  # the run went past its first epoch (each reader group its own)
    for (shard, key), n in sizes.items():  # the first epoch: every document, whole
        got = ranges[(shard, key, 0)]
        assert [a for a, _ in got] == [0] + [b for _, b in got[:-1]] and got[-1][1] == n, (shard, key, got)

    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert [r["tokens_seen"] for r in recs] == [512 * s for s in range(1, 13)]
    assert [r["lr"] for r in recs] == pytest.approx([lr_at(s) for s in range(12)], rel=1e-12)


def test_a_recipe_is_checked_when_it_is_read():
    """Stages by hand: the stage of a token count, the cumulative overrides, and the refusals -- a change of
    the model or of the schedule, an unknown key, stages out of order, a fixed batch that would change."""
    cfg = compose(["+exp=flash_tiny", "train.global_batch_tokens=512", RECIPE])
    stages = stage_list(cfg)
    assert [(s.name, s.from_tokens) for s in stages] == [("long", 1024.0), ("back", 2048.0)]
    assert [stage_at(stages, t) for t in (0, 1023, 1024, 2047, 2048, 1e9)] == [0, 0, 1, 1, 2, 2]
    assert [(stage_config(cfg, k).data.seq_len, stage_config(cfg, k).parallel.cp) for k in range(3)] == [
        (128, 1), (256, 2), (128, 1)]
    check_fixed_batch(cfg)  # 4 x 128 = 2 x 256

    def refused(stages_yaml, *more):
        c = compose(["+exp=flash_tiny", "train.global_batch_tokens=512", *more])
        c.train.recipe.stages = OmegaConf.create(stages_yaml)
        with pytest.raises(ConfigError) as e:
            check_fixed_batch(c)
            for k in range(len(stage_list(c)) + 1):
                stage_config(c, k)
        return str(e.value)

    assert refused([{"name": "wide", "from_tokens": 10, "overrides": ["model.dim=128"]}]).startswith(
        "train.recipe.stages[0] (wide): model.dim cannot change at a stage")
    assert "schedule.peak_lr cannot change" in refused(
        [{"name": "s", "from_tokens": 10, "overrides": ["schedule.peak_lr=1"]}])
    assert refused([{"name": "a", "from_tokens": 10, "overrides": []},
                    {"name": "b", "from_tokens": 5, "overrides": []}]) == (
        "train.recipe.stages[1] (b): from_tokens=5 must be above 10 (the stages start in order, after 0)")
    assert refused([{"name": "t", "from_tokens": 10, "overrides": ["data.seq_lenn=64"]}]).startswith(
        "train.recipe.stages (t): data.seq_lenn=64:")
    assert refused([{"name": "odd", "from_tokens": 10, "overrides": ["data.seq_len=96"]}]) == (
        "train.recipe.stages (odd): train.global_batch_tokens=512 is 480 tokens per step in sequences of "
        "data.seq_len=96, 512 in the first stage's of 128: the fixed batch would change at the boundary; use a global "
        "batch that both lengths divide (a multiple of 384 tokens)")
