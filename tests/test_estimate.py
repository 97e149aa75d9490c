"""launch/estimate.py is a measurement: its simulated per-rank peak matches what a real run of the same
layout keeps. flash_tiny (8 layers, no ViT), pp=2 x dp=2 with ep=2 on 4 gloo processes (pipeline P2P,
expert all-to-all, data-parallel reductions, the three optimizers): the measured step's live tensor
bytes at its start plus the peak of what it allocates (tests/dist/measure_step.py) against the
estimator's figure for the same rank, within 10%."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import warm_launch
from layer_plans import EIGHT_LAYERS, FOUR_LAYERS

ROOT = Path(__file__).resolve().parent.parent
# the 8-layer plan without the ViT: the estimator's batches are text only, so the measured step gives the
# ViT no gradients and its optimizer no state for it, which the estimator (rightly, for a multimodal run)
# counts: 116 KB on rank 0, within 5% of 40 layers' state but 7% of 8 layers'
LAYOUT = ["+exp=flash_tiny", *EIGHT_LAYERS, "model.vision_n_layers=0", "parallel.pp=2", "parallel.ep=2",
          "data.batch_size=1"]


@pytest.mark.slow
def test_estimate_within_ten_percent_of_a_real_step(tmp_path):
    corpus = [f"data.corpus_dir={tmp_path / 'corpus'}", "data.corpus_text_bytes=400000", "data.corpus_mm_docs=50",
              "data.corpus_shards=4", "data.mix=[1,0]"]  # text only, as the estimator's batches
    env = {**os.environ, "MEASURE_OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    real = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                             str(ROOT / "tests" / "dist" / "measure_step.py"), *LAYOUT, *corpus, "run_name=measure",
                             "logging.wandb.mode=disabled"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert real.returncode == 0, real.stdout[-3000:] + real.stderr[-3000:]
    est = warm_launch.run([sys.executable, str(ROOT / "launch" / "estimate.py"), *LAYOUT, "--world", "4", "--device",
                            "cpu", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert est.returncode == 0, est.stderr[-3000:]
    report = json.loads(est.stdout.strip().splitlines()[-1])
    assert report["world"] == 4 and [r["rank"] for r in report["ranks"]] == [0, 2]  # one rank per pp position
    assert [r["stages"] for r in report["ranks"]] == [[0], [1]]
    assert report["max_peak_bytes"] == max(r["peak_bytes"] for r in report["ranks"])
    for r in report["ranks"]:
        measured = json.loads((tmp_path / f"rank{r['rank']}.json").read_text())
        parts = sum(r[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                                   "temporaries_bytes", "buffers_bytes"))
        assert parts <= r["peak_bytes"] * 1.0001, r
        assert r["peak_bytes"] == pytest.approx(measured["peak_bytes"], rel=0.10), (r, measured)
        # what exists between steps (parameters, buffers, optimizer state) is built, not guessed
        held = r["params_bytes"] + r["buffers_bytes"] + r["optimizer_bytes"]
        assert held == pytest.approx(measured["base_bytes"], rel=0.05), (r, measured)


def test_query_chunks_skip_repeated_shapes_on_fake_tensors_only():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashtrain.model.chunks import query_chunks

    real = torch.zeros(1)
    assert list(query_chunks(200, 64, real, window=16)) == [(0, 64), (64, 128), (128, 192), (192, 200)]
    with FakeTensorMode():
        fake = torch.zeros(1)
    # chunk 0 has a short key band, chunks 1-2 the same full one, the last is shorter
    assert list(query_chunks(200, 64, fake, window=16)) == [(0, 64), (64, 128), (192, 200)]
    assert list(query_chunks(200, 64, fake)) == [(0, 64), (192, 200)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "full"])
def test_skipping_repeated_chunks_keeps_the_simulated_memory(mode, monkeypatch):
    """The estimator's shortcut (model/chunks.py) against simulating all 16 chunks of each pass, for the
    roles with chunk loops: Full (indexer selection, KL logits, sparse attention), Reuse, Reindex."""
    from flashtrain.model import chunks
    from flashtrain.train.config import compose
    from flashtrain.train.plan.estimate import probe_block

    cfg = compose(["+exp=flash_tiny", "data.seq_len=1024"])
    for layer in (2, 21, 24):
        monkeypatch.setattr(chunks, "SIMULATE_EVERY_CHUNK", False)
        fast = probe_block(cfg, layer, mode)
        monkeypatch.setattr(chunks, "SIMULATE_EVERY_CHUNK", True)
        assert probe_block(cfg, layer, mode) == fast, layer


def test_step_tracker_keeps_no_graph_alive():
    """torch's MemTracker (through ModTracker's multi-grad hooks) kept every module input's autograd
    graph, leaves included, alive for the life of the process; the estimator's tracker must not, or a
    pipeline stage's received inputs are counted long after the real step frees them."""
    import gc
    import weakref

    from flashtrain.train.plan.estimate import _step_tracker

    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    tracker = _step_tracker()
    tracker.track_external(block)
    with tracker:
        x = torch.randn(4, 8, requires_grad=True)  # a received input: a leaf
        block(x).sum().backward()
        alive = weakref.ref(x)
        del x
        gc.collect()
        assert alive() is None




@pytest.mark.slow
@pytest.mark.parametrize("world, pp, rank, schedule, whole, simulated", [
    (1, 1, 0, "1f1b", 3, 2), (2, 2, 0, "1f1b", 4, 3), (2, 2, 1, "1f1b", 3, 2), (2, 2, 1, "dualpipev", 6, 4),
    (2, 2, 0, "interleaved_1f1b", 6, 4)])
def test_the_shortened_step_has_the_peak_of_the_whole_accumulation(monkeypatch, world, pp, rank, schedule, whole,
                                                                    simulated):
    """The estimator simulates only as many micro-batches as the peak needs (2 without a pipeline; with
    1F1B pp + 1 on stage 0, pp on the last; 2 pp with DualPipeV, and with interleaved 1F1B when pp divides the
    round; `test_which_steps_the_estimator_shortens` has the other cases): its
    peak against simulating the whole accumulation (`whole` micro-batches, one round), and the micro-batch
    counts by hand. Within 0.1%: a few bytes per micro-batch (the schedule's per-micro-batch losses, 3 KiB
    here without a pipeline) are bookkeeping that the shortened step does not repeat; one micro-batch too
    few would leave out the gradients or a micro-batch's activations (> 10% here). `whole`: one micro-batch
    more than the shortened step keeps (DualPipeV and interleaved 1F1B: a whole round of 6), so that the
    simulation of the whole accumulation stays short (each micro-batch ~3 s of the suite's time)."""
    import flashtrain.train.plan.estimate as estimate
    from flashtrain.train.config import compose

    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, f"parallel.pp={pp}", f"train.global_batch_tokens={128 * whole}",
                   "data.batch_size=1", f"parallel.pipeline_schedule={schedule}"])
    from flashtrain.train.module import TrainModule

    counts = []
    original = TrainModule.step

    def counted(module, batches, *args):
        counts.append(len(batches))
        return original(module, batches, *args)

    monkeypatch.setattr(TrainModule, "step", counted)
    short = estimate.estimate_rank(cfg, world, rank, "cpu")
    monkeypatch.setattr(estimate, "_peak_preserving_microbatches", lambda *a: {})
    full = estimate.estimate_rank(cfg, world, rank, "cpu")
    assert counts == [simulated, whole]
    assert short.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-3), (short, full)
    if pp > 1:
        # A pipeline round's inputs for the micro-batches the shortened step leaves out (3 int64 tensors
        # of 128 tokens: 3 KiB each) are added by hand; without them the stages fall short by 6-9 KiB,
        # under the 0.1% above. The simulations differ by a few bytes of the schedule's bookkeeping.
        assert abs(short.peak_bytes - full.peak_bytes) < 3 * 128 * 8 // 4, (short, full)


def test_the_shortened_step_is_partitioned_as_the_whole_round(monkeypatch):
    """The estimator's rank runs 3 of stage 0's 5 micro-batches, but the partition it builds prices the whole
    round's inputs, as the trainer's does (`BatchPlan.round_inputs`): the same stages whatever the shortening."""
    import flashtrain.train.module as module
    import flashtrain.train.plan.estimate as estimate
    from flashtrain.train.config import compose

    plans = []
    original = module.build_rank

    def build(c, plan, *args, **kwargs):
        plans.append(plan)
        return original(c, plan, *args, **kwargs)

    monkeypatch.setattr(module, "build_rank", build)
    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, "parallel.pp=2", "train.global_batch_tokens=640",
                   "data.batch_size=1"])
    estimate.estimate_rank(cfg, 2, 0, "cpu")
    assert [(p.round_microbatches, p.round_inputs) for p in plans] == [(3, 5)]


@pytest.mark.parametrize("pp, schedule, accumulation, round_microbatches, rank, expected", [
    (1, "1f1b", 7, 7, 0, (2, 1)), (1, "1f1b", 1, 1, 0, (1, 1)),
    (4, "1f1b", 64, 64, 0, (5, 5)), (4, "1f1b", 64, 64, 3, (4, 4)), (4, "1f1b", 3, 3, 0, None),
    (4, "1f1b", 64, 16, 0, None),  # several rounds: in full
    (4, "dualpipev", 256, 256, 2, (8, 8)), (4, "zbv", 12, 12, 0, (8, 8)), (4, "dualpipev", 8, 8, 3, None),
    (4, "interleaved_1f1b", 16, 16, 1, (8, 8)), (4, "interleaved_1f1b", 6, 6, 0, None),
    (4, "interleaved_1f1b", 10, 10, 0, None),  # rounds of 5 (10 // 4 = 2 rounds): a longer warm-up than 2 x 4
])
def test_which_steps_the_estimator_shortens(pp, schedule, accumulation, round_microbatches, rank, expected):
    """The micro-batch counts `_peak_preserving_microbatches` simulates, by hand from its docstring's rules:
    (accumulation, round_microbatches), or None where the step is simulated in full (nothing to shorten)."""
    from types import SimpleNamespace

    from flashtrain.train.config import BatchPlan
    from flashtrain.train.plan.estimate import _peak_preserving_microbatches

    plan = BatchPlan(SimpleNamespace(pp=pp), accumulation, 1, accumulation, round_microbatches)
    got = _peak_preserving_microbatches(plan, schedule, rank)
    if expected is None:
        assert got == {}
    else:
        assert (got["accumulation"], got["round_microbatches"]) == expected


def test_the_step_phase_by_phase_follows_the_1f1b_schedule():
    """`--phases` (estimate_rank(phases=True)) on stage 0 of pp=2 with 1F1B, 3 micro-batches simulated: the
    phases in the schedule's order, each micro-batch's forward leaving more live bytes than it found (what it
    keeps for its backward) and each backward fewer; the peak is the largest phase peak plus the round's
    unsimulated inputs (3 int64 tensors of 64 tokens for the 2 micro-batches left out: 3 KiB); a layout
    without a pipeline is refused in one line."""
    import dataclasses

    import flashtrain.train.plan.estimate as estimate
    from flashtrain.config.errors import ConfigError
    from flashtrain.train.config import compose

    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, "parallel.pp=2", "data.seq_len=64"])
    r = estimate.estimate_rank(cfg, 2, 0, "cuda", phases=True)
    names = [q["phase"] for q in r.phases]
    assert names == ["before the first forward", "forward 1", "forward 2", "backward 1", "forward 3", "backward 2",
                     "backward 3", "optimizer"]
    at = {q["phase"]: q for q in r.phases}
    ends = [q["end_bytes"] for q in r.phases]
    for i, q in enumerate(r.phases[1:-1], 1):
        assert q["peak_bytes"] >= max(q["end_bytes"], ends[i - 1])
        assert (q["end_bytes"] > ends[i - 1]) == q["phase"].startswith("forward"), q
    assert at["forward 2"]["end_bytes"] - at["forward 1"]["end_bytes"] == pytest.approx(
        at["forward 1"]["end_bytes"] - at["before the first forward"]["end_bytes"], rel=0.1)  # one micro-batch each
    assert r.peak_bytes == max(q["peak_bytes"] for q in r.phases) + 2 * 3 * 64 * 8
    # the figures by kind are the peak's, and the unsimulated inputs count as activations: they add up to it exactly
    assert sum(getattr(r, f"{k}_bytes") for k in ("params", "grads", "optimizer", "activations", "temporaries",
                                                   "buffers")) == r.peak_bytes
    # each forward's record of the stage's one block (layer 0): the first micro-batch's block leaves what the
    # block alone keeps (`probe_block`: its kept bytes, autocast's weight copies included) plus its output
    # carry (layer 1's input carry); backward phases (recomputation included) have no block records
    assert [[b["block"] for b in q.get("blocks", [])] for q in r.phases] == [
        [], *[["StageModule.blocks.0"]] * 2, [], ["StageModule.blocks.0"], [], [], []]
    for q in r.phases:
        for b in q.get("blocks", []):
            assert b["peak"] >= max(b["start"], b["end"]) and b["end"] > b["start"], b
    probe = [estimate.probe_block(cfg, layer, cfg.train.recompute, "cuda") for layer in (0, 1)]
    first = at["forward 1"]["blocks"][0]
    assert first["end"] - first["start"] == pytest.approx(probe[0]["kept_bytes"] + probe[1]["carry_bytes"], rel=0.01)
    assert "phases" not in dataclasses.replace(r, phases=None).as_dict() and r.as_dict()["phases"] == r.phases
    with pytest.raises(ConfigError, match="--phases follows a pipeline stage's micro-batches: give a layout with "
                                          "parallel.pp > 1"):
        estimate.estimate_rank(compose(["+exp=flash_tiny", *FOUR_LAYERS]), 1, 0, "cuda", phases=True)


def test_under_recomputation_each_backward_lists_its_blocks_rebuilds():
    """Full recomputation, stage 1 of pp=2 (blocks 0-2 of the stage: layers 1-3), 2 micro-batches: each backward
    phase lists the stage's blocks in reverse, each record from its rebuild's first module to the next block's
    rebuild (start = the previous record's end) and the last to the phase's end; the phase's peak is a block's,
    as the blocks' rebuilds and backwards are everything a backward phase runs before the optimizer."""
    import flashtrain.train.plan.estimate as estimate
    from flashtrain.train.config import compose

    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, "parallel.pp=2", "parallel.stage_layers=[1,3]",
                   "data.seq_len=64", "train.recompute=full"])
    r = estimate.estimate_rank(cfg, 2, 1, "cuda", phases=True)
    backward = [q for q in r.phases if q["phase"].startswith("backward")]
    assert [q["phase"] for q in backward] == ["backward 1", "backward 2"]
    for q in backward:
        blocks = q["blocks"]
        assert [b["block"] for b in blocks] == [f"StageModule.blocks.{i}" for i in (2, 1, 0)]
        assert [b["start"] for b in blocks[1:]] == [b["end"] for b in blocks[:-1]]
        assert blocks[-1]["end"] == q["end_bytes"]
        assert max(b["peak"] for b in blocks) == q["peak_bytes"]
        for b in blocks:
            assert b["peak"] > max(b["start"], b["end"]), b
    # each block's rebuild and backward add the same bytes in both micro-batches (the same shapes), whatever
    # the earlier blocks of the phase reached
    added = [[b["peak"] - b["start"] for b in q["blocks"]] for q in backward]
    assert added[0] == added[1], added


@pytest.mark.slow
def test_selective_recompute_keeps_the_expert_exchange_as_the_cost_model_prices_it():
    """Under `train.recompute=selective` the expert all-to-all's outputs are kept (model/recompute.py saves
    the exchange): the simulated step's per-block records (`--phases`) of flash_tiny at ep=2 and ep=1 differ by
    exactly what the cost model adds for it -- per (token, expert) pair the fp32 MoE input as sent (4 D), the
    bf16 expert outputs sent back (2 D) and the bf16 routing weight (2): 64 tokens x 2 picks x 386 bytes."""
    import flashtrain.train.plan.estimate as estimate
    from flashtrain.parallel.partition import PartitionCosts, block_activations
    from flashtrain.train.config import compose, model_config

    def added(ep: int) -> int:
        cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, "parallel.pp=2", "parallel.stage_layers=[1,3]",
                       f"parallel.ep={ep}", "data.seq_len=64", "data.batch_size=1", "train.recompute=selective"])
        r = estimate.estimate_rank(cfg, 4, 2, "cuda", phases=True)  # stage 1, where blocks 1-3 run
        blocks = next(q for q in r.phases if q["phase"] == "forward 2")["blocks"]
        return [b["end"] - b["start"] for b in blocks]

    with_ep, without = added(2), added(1)
    assert len(with_ep) == len(without) >= 2
    m = model_config(compose(["+exp=flash_tiny", *FOUR_LAYERS]))
    assert (m.dim, m.n_activated_experts) == (64, 2)
    assert [a - b for a, b in zip(with_ep, without)] == [64 * 2 * (4 * 64 + 2 * 64 + 2)] * len(with_ep)
    from flashtrain.model.layer_plan import layer_plan

    for r in layer_plan(m):  # the cost model's term, the same for every role
        kept = [block_activations(m, r, 0, 0, 0, 64, 1, PartitionCosts(recompute="selective", ep=ep))["kept"]
                for ep in (2, 1)]
        assert kept[0] - kept[1] == 64 * 2 * 386, r


@pytest.mark.parametrize("stage", ["pretrain", "dspark"])
def test_the_stages_a_rank_runs(stage):
    """What the estimator reports as a rank's pipeline stages (`TrainModule.stages`) and holds frozen (`frozen()`),
    its module without a stability guard, on each rank of pp=2: pre-training's pipeline stages of the rank; the
    DSpark stage's, the stage of the frozen backbone's forward pipeline (its drafter on the last), the backbone the
    one frozen module."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import flashtrain.train.plan.estimate as estimate
    from flashtrain.train.config import compose

    extra = ["train.stage=dspark", "train.backbone=/nonexistent", "model.dspark_target_layer_ids=[1,2,3]"] \
        if stage == "dspark" else []
    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, "model.vision_n_layers=0", "parallel.pp=2", "data.batch_size=1",
                   *extra])
    seen = []
    for rank in (0, 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            sim = estimate.SimulatedRank(cfg, 2, rank, "cpu", FakeTensorMode(allow_non_fake_inputs=True))
            frozen = sim.module.frozen()
            assert sim.module.guard is None  # no stability guard: its verdict reads values a fake tensor has not
            seen.append((sim.module.stages(), len(frozen), all(not p.requires_grad for m in frozen
                                                               for p in m.parameters())))
        finally:
            dist.destroy_process_group()
    assert seen == [([0], int(stage == "dspark"), True), ([1], int(stage == "dspark"), True)]


def test_the_simulated_step_trains_every_parameter():
    """The estimator simulates the first step with the ViT body unfrozen (the largest state: every parameter has a
    gradient and optimizer state): after `prime_optimizer_state` every parameter requires a gradient."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import flashtrain.train.plan.estimate as estimate
    from flashtrain.model.vision import is_vision_body
    from flashtrain.train.config import compose

    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, "data.batch_size=1"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        sim = estimate.SimulatedRank(cfg, 1, 0, "cpu", fake)
        with fake:
            sim.prime_optimizer_state()
        body = [n for n, _ in sim.model.named_parameters() if is_vision_body(n)]
        assert body and all(p.requires_grad for p in sim.model.parameters())
    finally:
        dist.destroy_process_group()
