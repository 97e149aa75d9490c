"""Pipeline partitioning (parallel/partition.py): the DP is optimal (against brute force), pinned stage
layers are honoured, costs add up, plan.py reports the partition, and the cost model's per-block
activations agree with the estimator's measurement of each block (train.estimate.probe_block)."""

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
import warm_launch

from flashtrain.config.errors import ConfigError
from flashtrain.parallel.config import ParallelConfig
from flashtrain.parallel.partition import (
    PartitionCosts,
    _stage_cost,
    in_flight_microbatches,
    in_flight_states,
    partition,
    rank_costs,
    unit_costs,
)

pytestmark = pytest.mark.xdist_group("partition")  # its module-scoped reference runs are shared

ROOT = Path(__file__).resolve().parent.parent


def _units(seed, n, giant=None):
    g = torch.Generator().manual_seed(seed)
    vals = torch.randint(1, 100, (n, 3), generator=g).tolist()
    units = [{"state_bytes": a * 10, "activation_bytes": b, "work_bytes": w, "flops_per_token": a + b}
             for a, b, w in vals]
    if giant is not None:  # one unit that sets the maximum alone (an Engram table)
        units[giant]["state_bytes"] = 100_000
    return units


@pytest.mark.parametrize("seed, n, pp, flight, giant, slack", [
    (0, 8, 3, None, None, 0.0), (1, 9, 4, None, None, 0.0), (2, 7, 2, None, None, 0.0), (3, 10, 5, None, 2, 0.0),
    (4, 10, 4, [3, 2, 1, 2], None, 0.0), (5, 10, 4, None, 6, 0.0), (6, 10, 4, None, None, 0.1),
    (7, 9, 3, [1, 1, 1], None, 0.3)])
def test_dp_matches_brute_force(seed, n, pp, flight, giant, slack):
    """Brute force over every split: the largest stage memory is the smallest possible (M); among the
    splits within M x (1 + slack), the slowest stage's compute is the smallest possible; among those,
    the memory is the most even (sum of squares)."""
    units = _units(seed, n, giant)
    flight = flight or [pp - s for s in range(pp)]

    def stages(cuts):
        return list(zip((0,) + cuts, cuts + (n,)))

    def costs(bounds):
        return [_stage_cost(units, a, b, flight[s]) for s, (a, b) in enumerate(bounds)]

    def compute(bounds):
        return max(sum(u["flops_per_token"] for u in units[a:b]) for a, b in bounds)

    splits = [stages(cuts) for cuts in itertools.combinations(range(1, n), pp - 1)]
    best = min(max(costs(b)) for b in splits)
    within = [b for b in splits if max(costs(b)) <= best * (1 + slack)]
    fastest = min(compute(b) for b in within)
    even = min(sum((c / best) ** 2 for c in costs(b)) for b in within if compute(b) == fastest)
    bounds = partition(units, pp, in_flight=flight, memory_slack=slack)
    assert bounds[0][0] == 0 and bounds[-1][1] == n and all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
    assert max(costs(bounds)) <= best * (1 + slack) * (1 + 1e-9)
    if slack == 0:
        assert max(costs(bounds)) == best
    assert compute(bounds) == fastest
    assert sum((c / best) ** 2 for c in costs(bounds)) == pytest.approx(even)


def test_memory_slack_trades_memory_for_the_slowest_stage():
    """Units whose memory-optimal split is slow: a little slack buys a faster pipeline, never more than
    the slack allows."""
    units = [{"state_bytes": 10, "activation_bytes": 0, "work_bytes": 0, "flops_per_token": f} for f in (1, 1, 1, 9)]
    units[3]["state_bytes"] = 11
    tight = partition(units, 2, in_flight=[1, 1])
    loose = partition(units, 2, in_flight=[1, 1], memory_slack=0.5)
    assert tight == [(0, 2), (2, 4)]  # memory 20 / 21: the smallest largest stage
    assert loose == [(0, 3), (3, 4)]  # memory 30 / 11 (<= 21 x 1.5), compute 3 / 9 instead of 2 / 10


@pytest.mark.parametrize("seed, n, pp, loose", [(10, 9, 3, 1.3), (11, 10, 4, 1.6), (12, 8, 2, 1.05), (13, 10, 4, 3.0)])
def test_memory_budget_puts_the_slowest_stage_first(seed, n, pp, loose):
    """parallel.gpu_memory_gb: brute force over every split -- among the splits whose every stage fits the
    budget, the slowest stage's compute is the smallest possible; among those the memory is the most
    even. A budget below the smallest possible largest stage is refused with the number to beat."""
    units = _units(seed, n)
    flight = [pp - s for s in range(pp)]
    splits = [list(zip((0,) + c, c + (n,))) for c in itertools.combinations(range(1, n), pp - 1)]

    def costs(bounds):
        return [_stage_cost(units, a, b, flight[s]) for s, (a, b) in enumerate(bounds)]

    def compute(bounds):
        return max(sum(u["flops_per_token"] for u in units[a:b]) for a, b in bounds)

    smallest = min(max(costs(b)) for b in splits)
    budget = smallest * loose
    fits = [b for b in splits if max(costs(b)) <= budget]
    fastest = min(compute(b) for b in fits)
    bounds = partition(units, pp, in_flight=flight, budget=budget)
    assert max(costs(bounds)) <= budget and compute(bounds) == fastest
    even = min(sum((c / smallest) ** 2 for c in costs(b)) for b in fits if compute(b) == fastest)
    assert sum((c / smallest) ** 2 for c in costs(bounds)) == pytest.approx(even)
    with pytest.raises(ConfigError, match=r"gpu_memory_gb=.*smallest largest stage needs"):
        partition(units, pp, in_flight=flight, budget=smallest * 0.99)


def test_memory_budget_balances_the_sum_of_a_ranks_two_stages():
    """V-shaped placement (rank r holds stages r and 2P - 1 - r): the local search lowers the largest
    per-rank compute below the per-stage optimum's, and every rank's memory (its two stages) fits."""
    units = [{"state_bytes": 10, "activation_bytes": 0, "work_bytes": 0, "flops_per_token": f}
             for f in (1, 1, 1, 1, 1, 1, 1, 9)]
    ranks = [[0, 3], [1, 2]]
    flight, states = [1, 1, 1, 1], [[(1, 1)], [(1, 1)]]
    per_stage = partition(units, 4, in_flight=flight, budget=1000)
    paired = partition(units, 4, in_flight=flight, budget=1000, stages_of_rank=ranks, states=states)

    def rank_compute(bounds):
        return max(sum(sum(u["flops_per_token"] for u in units[slice(*bounds[s])]) for s in r) for r in ranks)

    assert rank_compute(paired) < rank_compute(per_stage)
    assert rank_compute(paired) == 10  # rank 0 holds the first unit and the 9: stages [1] and [9] at best
    assert all(b <= 1000 for b in rank_costs(units, paired, ranks, states))
    with pytest.raises(ValueError, match="in-flight states"):
        partition(units, 4, in_flight=flight, budget=1000, stages_of_rank=ranks)


def test_stage_cost_is_state_plus_in_flight_activations_plus_the_largest_backward():
    units = [{"state_bytes": 100, "activation_bytes": 10, "work_bytes": 7},
             {"state_bytes": 50, "activation_bytes": 20, "work_bytes": 30}]
    assert _stage_cost(units, 0, 2, 3) == 150 + 3 * 30 + 30
    assert _stage_cost(units, 0, 1, 4) == 100 + 4 * 10 + 7


def test_a_ranks_cost_holds_its_stages_at_the_schedules_worst_point_and_one_backward():
    """`rank_costs` by hand: rank 0 holds stages 0 (units 0-1) and 3 (unit 4), rank 1 stages 1 and 2; what a
    micro-batch holds in a stage is its first unit's activations plus, for the next units, their activations
    less the carry they receive plus the carry the previous unit wrote (`_held`)."""
    def unit(state, act, work, carry=0, new=0):
        return {"state_bytes": state, "activation_bytes": act, "work_bytes": work, "carry_bytes": carry,
                "new_carry_bytes": new}

    units = [unit(100, 10, 7), unit(50, 20, 30, carry=5, new=2), unit(10, 3, 1), unit(20, 4, 2), unit(1, 40, 9)]
    bounds, ranks = [(0, 2), (2, 3), (3, 4), (4, 5)], [[0, 3], [1, 2]]
    held0 = 10 + (20 - 5 + 2)  # stage 0's second unit: its own activations less the carry, plus what unit 0 wrote
    states = [[(3, 2), (4, 1)], [(2, 1), (3, 0)]]
    assert rank_costs(units, bounds, ranks, states) == [
        151 + max(3 * held0 + 2 * 40, 4 * held0 + 40) + 30,  # one backward working set: the rank's largest
        30 + max(2 * 3 + 4, 3 * 3) + 2]
    # one stage per rank: the stage's cost
    one = [[(2,)], [(1,)]]
    assert rank_costs(units, [(0, 2), (2, 5)], [[0], [1]], one) == [_stage_cost(units, 0, 2, 2),
                                                                    _stage_cost(units, 2, 5, 1)]
    # what each stage holds once: its input gradients (not stage 0's), the largest shared-field gradients of the
    # rank's blocks and the round's inputs, once a rank; and the gradient of a stage's outputs (the next stage's
    # input gradients; none for the last stage) while its backward runs -- one backward at a time: the largest
    for i, u in enumerate(units):
        u.update(input_grad_bytes=1000 * (i + 1), shared_grad_bytes=[0, 0, 300, 200, 500][i], round_input_bytes=7)
    assert rank_costs(units, bounds, ranks, states) == [
        151 + max(3 * held0 + 2 * 40, 4 * held0 + 40) + 30 + 5000 + 3000 + 500 + 7,
        30 + max(2 * 3 + 4, 3 * 3) + 2 + 3000 + 4000 + 5000 + 300 + 7]
    assert rank_costs(units, [(0, 2), (2, 5)], [[0], [1]], one) == [_stage_cost(units, 0, 2, 2),
                                                                    _stage_cost(units, 2, 5, 1)]
    assert _stage_cost(units, 2, 5, 1) == 31 + 3 + 4 - 0 + 40 + 9 + 3000 + 500 + 7


def test_the_rounds_inputs_are_priced_with_a_pipeline_only():
    from flashtrain.train.config import compose, model_config, optim_config
    from flashtrain.train.plan.stages import partition_costs

    cfg = compose(["+exp=flash_tiny"])
    m, o = model_config(cfg), optim_config(cfg)
    assert partition_costs(m, o, ParallelConfig(pp=2), "none", True, 1, 8).round_microbatches == 8
    assert partition_costs(m, o, ParallelConfig(pp=1), "none", True, 1, 8).round_microbatches == 0


def test_in_flight_counts_follow_the_schedules_own_order():
    """From torch.distributed.pipelining's action lists (pp=2, 4 micro-batches), by hand:
    - interleaved 1F1B, rank 0 (stages 0, 2): 4 warm-up forwards, 2 per stage ((2, 2)), then forward / backward
      pairs -- forwards to stage 0 twice, backwards from stage 2 twice: (3, 2), (3, 1), (4, 1), (4, 0) --, then
      forwards to stage 2, backwards from stage 0; rank 1 (stages 1, 3): 2 warm-up forwards of stage 1, then
      pairs on stage 3 ((2, 1)), then on stage 1 ((3, 0));
    - DualPipeV, rank 0 (stages 0, 3): 2 forwards of stage 0, a forward of each ((3, 1)), stage 3's input
      backward and forward, then overlapped pairs: forward on stage 0 (4, 1) before stage 3's backward;
      rank 1 (stages 1, 2): two forwards of each ((2, 2)), then forward 1 (3, 2) before a backward.
    Per stage, the most it holds at any point; 1F1B's stage s of P holds P - s."""
    assert in_flight_states(2, "interleaved_1f1b") == [[(3, 2), (4, 1)], [(2, 1), (3, 0)]]
    assert in_flight_microbatches(2, "interleaved_1f1b") == [4, 3, 2, 1]
    assert in_flight_states(2, "dualpipev") == [[(4, 1)], [(3, 2)]]
    assert in_flight_microbatches(2, "dualpipev") == [4, 3, 2, 1]
    assert in_flight_states(2, "dualpipev", 64) == in_flight_states(2, "dualpipev")  # the steady state repeats
    assert in_flight_microbatches(4) == [4, 3, 2, 1] and in_flight_states(3) == [[(3,)], [(2,)], [(1,)]]
    # interleaved 1F1B at P = 4 with 10 micro-batches runs rounds of 5: a longer warm-up than with 8
    assert max(map(sum, in_flight_states(4, "interleaved_1f1b", 10)[0])) == 12
    assert max(map(sum, in_flight_states(4, "interleaved_1f1b", 8)[0])) == 11


def test_pinned_stage_layers_and_validation():
    units = _units(0, 6)
    assert partition(units, 3, [1, 2, 3]) == [(0, 1), (1, 3), (3, 6)]
    with pytest.raises(ConfigError, match="stage_layers"):
        partition(units, 3, [1, 2, 2])
    with pytest.raises(ConfigError, match="parallel.pp=7"):
        partition(units, 7)


def test_report_totals_and_plan_pipeline_section():
    out = warm_launch.run([sys.executable, "launch/plan.py", "+exp=flash", "parallel.pp=8", "--device", "cpu",
                            "--json"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    pipe = r["pipeline"]
    assert pipe["pp"] == 8 and len(pipe["stages"]) == 8
    ranges = [st["layers"] for st in pipe["stages"]]
    assert ranges[0][0] == 0 and ranges[-1][1] == 39 and all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))
    # state bytes (fp32, ep=1): 4 bytes x (param + grad + buffers), Muon/Sinkhorn 1 buffer, AdamW 2 -- from the
    # routing totals
    o = r["optimizers"]
    want = 4 * (3 * (o["muon"]["params"] + o["sinkhorn"]["params"]) + 4 * o["adamw"]["params"])
    assert sum(st["state_bytes"] for st in pipe["stages"]) == want
    # the two Engram layers (98B-parameter tables) never share a stage with many other layers
    for st in pipe["stages"]:
        if st["layers"][0] <= 1 <= st["layers"][1] or st["layers"][0] <= 14 <= st["layers"][1]:
            assert st["n_layers"] <= 3
    assert 1.0 <= pipe["imbalance_bytes"] < 1.3


# --- the cost model against the measurement of each block ------------------------------------------
# one block of every role (SWA, SWA + Engram, Full, Reuse, Full + Engram, Full as candidate source,
# Reindex), each recompute mode under bf16 autocast (the GPU runs), and fp32 (the CPU runs) without it
ROLE_LAYERS = (0, 1, 2, 3, 14, 20, 24)


# the release's formats (issue 35): FP8 GEMMs and every weight switch (flash_tiny's Engram heads widened to 32)
FORMATS = ("model.fp8.enabled=true", "model.qat.experts_fp4=true", "model.qat.weights_fp8=true",
           "model.qat.weights_bf16=true", "model.engram_head_dim=32")


def _template(overrides):
    from flashtrain.parallel.construct import model_template
    from flashtrain.train.config import compose, model_config, optim_config
    from flashtrain.train.plan.stages import optimizer_state_of

    cfg = compose(["+exp=flash_tiny", *overrides])
    m = model_config(cfg)
    model = model_template(m)
    return cfg, m, model, optimizer_state_of(model, m, optim_config(cfg))


@pytest.fixture(scope="module")
def tiny_template():
    return _template([])


@pytest.mark.parametrize("mode, device, formats", [("none", "cuda", False), ("selective", "cuda", False),
                                                   ("full", "cuda", False), ("none", "cpu", False),
                                                   ("selective", "cpu", False), ("none", "cuda", True)])
@pytest.mark.slow
def test_cost_model_matches_the_measured_block_activations(tiny_template, mode, device, formats):
    """carry exact; what a micro-batch keeps for backward within 25% (the term the in-flight count
    multiplies); the transient backward peak within 35%. The probe runs each block alone on fake
    tensors, through the real forward and backward (torch's autograd, checkpointing, autocast). `formats`:
    with FP8 GEMMs and the weight switches on, where the kept inputs (FP8 codes) and the weight copies each
    micro-batch saves (quantised, FP8) change most."""
    from flashtrain.parallel.partition import weight_copy_bytes
    from flashtrain.train.plan.estimate import probe_block

    cfg, m, model, optimizer_of = _template(FORMATS) if formats else tiny_template
    costs = PartitionCosts(recompute=mode, mixed_precision=device == "cuda")
    units = unit_costs(model, m, optimizer_of, cfg.data.seq_len, cfg.data.batch_size, costs)
    model_kept, probe_kept = {}, {}
    for layer in ROLE_LAYERS:
        got = probe_block(cfg, layer, mode, device)
        u, block = units[layer], model.layers[layer]
        routed = sum(p.numel() for p in block.ffn.experts.parameters())
        table = 0 if block.engram is None else block.engram.embed.weight.numel()
        # the probe's single micro-batch also holds autocast's bf16 weight copies, which the cost model
        # counts once per stage with the state
        cache = weight_copy_bytes(block, m, costs)[0]
        if not formats:
            assert cache == (2 * (sum(p.numel() for p in block.parameters()) - routed - table) if device == "cuda"
                             else 0)
        model_kept[layer], probe_kept[layer] = u["kept_bytes"] + cache, got["kept_bytes"]
        assert u["carry_bytes"] == got["carry_bytes"], layer
        assert model_kept[layer] == pytest.approx(got["kept_bytes"], rel=0.25), (layer, u, got)
        assert u["work_bytes"] == pytest.approx(got["work_bytes"], rel=0.35), (layer, u, got)
    # the role terms on their own: what an Engram module (layer 1 over layer 0, both SWA) and an indexer
    # (layer 2, Full, over layer 3, Reuse of the same ratio) add to what a micro-batch keeps, where it is
    # large (without recomputation; selective keeps a few projections of them, checked in the totals)
    for with_term, without in ((1, 0), (2, 3)) if mode == "none" else ():
        model_inc = model_kept[with_term] - model_kept[without]
        probe_inc = probe_kept[with_term] - probe_kept[without]
        assert model_inc == pytest.approx(probe_inc, rel=0.3, abs=64), (with_term, model_inc, probe_inc)
    # the formats' terms on their own: what the formats change in what a micro-batch keeps (FP8 inputs, the
    # weight copies each micro-batch saves, no autocast copy), against the same blocks without them
    if formats:
        plain_cfg, plain_m, plain_model, plain_opt = tiny_template
        plain_units = unit_costs(plain_model, plain_m, plain_opt, cfg.data.seq_len, cfg.data.batch_size, costs)
        for layer in (0, 2):
            plain = plain_units[layer]["kept_bytes"] + weight_copy_bytes(plain_model.layers[layer], plain_m, costs)[0]
            model_inc = model_kept[layer] - plain
            probe_inc = probe_kept[layer] - probe_block(plain_cfg, layer, mode, device)["kept_bytes"]
            assert probe_inc < 0 and model_inc == pytest.approx(probe_inc, rel=0.3), (layer, model_inc, probe_inc)


def test_state_shares_under_zero1_and_engram_sharding():
    """Per-parameter state bytes (parameter + gradient + optimizer values), by hand: fp32, dp=64, ep=8."""
    from flashtrain.model.param_kinds import ParamKind
    from flashtrain.parallel.partition import PartitionCosts

    c = PartitionCosts(bytes_per_value=4, ep=8, dp=64, zero=True, engram_shard=True)
    assert c.param_state_bytes(ParamKind.MATRIX, 6400, 1) == 6400 * 4 * (2 + 1 / 64)
    assert c.param_state_bytes(ParamKind.VECTOR, 6400, 2) == 6400 * 4 * (2 + 2 / 64)
    # routed experts: 1/8 of them here, their state shared by the 64 / 8 replicas of the shard
    assert c.param_state_bytes(ParamKind.ROUTED_EXPERT, 6400, 1) == 800 * 4 * (2 + 1 / 8)
    # a row-sharded Engram table: parameter, gradient and state all 1/64
    assert c.param_state_bytes(ParamKind.ENGRAM_TABLE, 6400, 1) == 100 * 4 * 3
    plain = PartitionCosts(bytes_per_value=4, ep=8, dp=64)
    assert plain.param_state_bytes(ParamKind.ENGRAM_TABLE, 6400, 1) == 6400 * 4 * 3
    assert plain.param_state_bytes(ParamKind.ROUTED_EXPERT, 6400, 1) == 800 * 4 * 3


def test_the_indexer_chunk_scores_under_context_parallelism_cost_six_bytes_a_score():
    """A rank holding 64 of a sequence's 2^20 positions: the indexer of a Full layer (ratio 2) scores a chunk
    of its queries against all 2^19 compressed entries, 6 bytes a score (measured: launch/estimate.py
    --phases, a block's forward transient at exp=flash, docs/parallelism.md); without recomputation that is the
    block's transient work, by hand: 6 x chunk x index heads x 2^19. A Reuse layer has no indexer: not priced."""
    from flashtrain.model.layer_plan import Role, layer_plan
    from flashtrain.parallel.partition import block_activations
    from flashtrain.train.config import compose, model_config

    sys.path.insert(0, str(ROOT / "tests"))
    from layer_plans import FOUR_LAYERS

    m = model_config(compose(["+exp=flash_tiny", *FOUR_LAYERS]))
    full = next(r for r in layer_plan(m) if r.role is Role.FULL)
    chunk = min(m.attn_chunk_size, 64)
    costs = PartitionCosts(recompute="none")
    work = block_activations(m, full, 0, 0, 0, 64, 1, costs, seq_tokens=1 << 20)["work"]
    assert full.compress_ratio == 2 and work == 6 * chunk * m.index_n_heads * (1 << 20) // 2
    reuse = next(r for r in layer_plan(m) if r.role is Role.REUSE)
    assert block_activations(m, reuse, 0, 0, 0, 64, 1, costs, seq_tokens=1 << 20)["work"] < work // 100


def test_the_expert_exchange_is_priced_under_selective_recomputation_only():
    """The all-to-all's outputs that selective recomputation keeps (per (token, expert) pair 4 D + 2 (D + 1)
    bytes under bf16 autocast): 64 tokens x 2 picks x 386 bytes more at ep=2 than at ep=1 for every role of
    flash_tiny; `full` keeps each block's input only, whatever the expert layout."""
    from flashtrain.model.layer_plan import layer_plan
    from flashtrain.parallel.partition import block_activations
    from flashtrain.train.config import compose, model_config

    sys.path.insert(0, str(ROOT / "tests"))
    from layer_plans import FOUR_LAYERS

    m = model_config(compose(["+exp=flash_tiny", *FOUR_LAYERS]))
    assert (m.dim, m.n_activated_experts) == (64, 2)
    for role in layer_plan(m):
        def kept(mode, ep):
            return block_activations(m, role, 0, 0, 0, 64, 1, PartitionCosts(recompute=mode, ep=ep))["kept"]
        assert kept("selective", 2) - kept("selective", 1) == 64 * 2 * (4 * 64 + 2 * 65), role
        assert kept("full", 2) == kept("full", 1), role


def test_the_trainers_partition_uses_the_rounds_in_flight_counts():
    """`plan_stages` prices a stage by the micro-batches its round keeps in flight: interleaved 1F1B at pp=2 with
    a round of 2 runs every forward of rank 0 before a backward -- (2, 2) in flight, and (2, 1) on rank 1 --, so
    12 equal blocks (1 byte kept each) split 3 / 3 / 3 / 3 (largest stage 2 x 3); with the default round of 4
    (in flight 4, 3, 2, 1), 1 / 2 / 3 / 6."""
    from flashtrain.train.plan.stages import plan_stages

    units = [{"state_bytes": 0, "activation_bytes": 1, "work_bytes": 0, "flops_per_token": 1} for _ in range(12)]
    parallel = ParallelConfig(pp=2, pipeline_schedule="interleaved_1f1b")
    assert plan_stages(units, parallel, 2) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert plan_stages(units, parallel) == [(0, 1), (1, 3), (3, 6), (6, 12)]


def test_under_full_recomputation_the_rebuild_the_gradients_and_the_scores_are_separate_moments():
    """A Full layer (ratio 2) of a rank holding 64 of 2^20 positions, full recomputation: its backward work is
    the largest of the rebuild (what `none` keeps minus what `full` keeps, plus the fp32 expert outputs,
    4 k D bytes a position), the shared fields' gradients with the fp32 query gradient (4 H hd bytes a
    position; the KV's two more times with two query segments), the MoE's own backward work (`none`'s work)
    and the indexer's chunk scores (6 x chunk x index heads x 2^19), which a Full layer computes on the
    whole-sequence fields it has just written (`shared_grads` of them) while its rebuild so far -- all
    but the experts (4 k D + 24 k I + 22 ns I bytes a position) and the rank's compressed entries
    (22 hd / 2) -- is live."""
    from flashtrain.model.layer_plan import Role, layer_plan
    from flashtrain.parallel.partition import block_activations
    from flashtrain.train.config import compose, model_config

    sys.path.insert(0, str(ROOT / "tests"))
    from layer_plans import FOUR_LAYERS

    m = model_config(compose(["+exp=flash_tiny", *FOUR_LAYERS]))
    full = next(r for r in layer_plan(m) if r.role is Role.FULL)
    t = 64
    none = block_activations(m, full, 0, 0, 0, t, 1, PartitionCosts(recompute="none"))
    kept = block_activations(m, full, 0, 0, 0, t, 1, PartitionCosts(recompute="full"))["kept"]
    rebuild = none["kept"] - kept + t * 4 * m.n_activated_experts * m.dim
    query_grad = t * 4 * m.n_heads * m.head_dim
    scores = 6 * min(m.attn_chunk_size, t) * m.index_n_heads * (1 << 20) // 2
    assert max(rebuild, query_grad, none["work"]) < scores // 10
    k, D, I, ns = m.n_activated_experts, m.dim, m.moe_inter_dim, m.n_shared_experts
    before_experts = none["kept"] - t * (22 * m.head_dim // 2) - t * (4 * k * D + 24 * k * I + 22 * ns * I)
    assert 0 < before_experts < none["kept"]
    for segments in (1, 2):
        costs = PartitionCosts(recompute="full", kv_segments=segments)
        for grads, kv in ((0, 0), (1000, 0), (10 ** 6, 3000), (2 * scores, 0), (rebuild, rebuild // 4)):
            got = block_activations(m, full, 0, 0, 0, t, 1, costs, seq_tokens=1 << 20, shared_grads=grads,
                                    kv_grad=kv)["work"]
            want = max(rebuild, grads + 2 * (segments - 1) * kv + query_grad, none["work"],
                       scores + before_experts + grads)
            assert got == want, (segments, grads, kv)
    # a Reuse layer has no indexer: nothing stacks on anything
    reuse = next(r for r in layer_plan(m) if r.role is Role.REUSE)
    r_none = block_activations(m, reuse, 0, 0, 0, t, 1, PartitionCosts(recompute="none"))
    r_rebuild = r_none["kept"] - kept + t * 4 * k * D
    got = block_activations(m, reuse, 0, 0, 0, t, 1, PartitionCosts(recompute="full", kv_segments=2),
                            seq_tokens=1 << 20, shared_grads=10 ** 6, kv_grad=3000)["work"]
    assert got == max(r_rebuild, 10 ** 6 + 6000 + query_grad, r_none["work"])
    # a Reindex layer's indexer scores the Full layer's index keys, written long before: its scores stack on nothing
    from layer_plans import EIGHT_LAYERS

    m8 = model_config(compose(["+exp=flash_tiny", *EIGHT_LAYERS]))
    reindex = next(r for r in layer_plan(m8) if r.role is Role.REINDEX)
    x_none = block_activations(m8, reindex, 0, 0, 0, t, 1, PartitionCosts(recompute="none"))
    x_kept = block_activations(m8, reindex, 0, 0, 0, t, 1, PartitionCosts(recompute="full"))["kept"]
    x_scores = 6 * min(m8.attn_chunk_size, t) * m8.index_n_heads * (1 << 20) // reindex.compress_ratio
    x_rebuild = x_none["kept"] - x_kept + t * 4 * m8.n_activated_experts * m8.dim
    assert x_scores > max(x_rebuild, 10 ** 6 + t * 4 * m8.n_heads * m8.head_dim, x_none["work"])
    assert block_activations(m8, reindex, 0, 0, 0, t, 1, PartitionCosts(recompute="full"), seq_tokens=1 << 20,
                             shared_grads=10 ** 6)["work"] == x_scores
    # the local experts' bf16 copies (2 bytes a value) and their stacked weight gradient (8 / 3 bytes a value)
    # are part of the rebuild
    with_experts = [block_activations(m, reuse, routed, 0, 0, t, 1, PartitionCosts(recompute="full"))["work"]
                    for routed in (0, 3000)]
    assert with_experts[0] == r_rebuild > max(query_grad, r_none["work"])
    assert with_experts[1] - with_experts[0] == 2 * 3000 + 8 * 3000 // 3
    # one rank (no chunk scores): the rebuild alone, then the gradients once they outgrow it
    costs = PartitionCosts(recompute="full", kv_segments=2)
    assert block_activations(m, full, 0, 0, 0, t, 1, costs)["work"] == max(rebuild, query_grad, none["work"])
    big = rebuild + 12345
    assert block_activations(m, full, 0, 0, 0, t, 1, costs, shared_grads=big, kv_grad=7)["work"] == \
        big + 14 + query_grad


def test_without_full_recomputation_the_scores_stack_on_nothing():
    """Selective recomputation and none: the indexer's chunk scores (a Full layer at 64 of 2^20 positions) are a
    transient of their own, beside the stacked rebuild and gradients -- the work is the larger of the two."""
    from flashtrain.model.layer_plan import Role, layer_plan
    from flashtrain.parallel.partition import block_activations
    from flashtrain.train.config import compose, model_config

    sys.path.insert(0, str(ROOT / "tests"))
    from layer_plans import FOUR_LAYERS

    m = model_config(compose(["+exp=flash_tiny", *FOUR_LAYERS]))
    full = next(r for r in layer_plan(m) if r.role is Role.FULL)
    scores = 6 * min(m.attn_chunk_size, 64) * m.index_n_heads * (1 << 20) // 2
    for mode in ("none", "selective"):
        costs = PartitionCosts(recompute=mode)
        for grads in (0, 2 * scores):
            stacked = block_activations(m, full, 0, 0, 0, 64, 1, costs, shared_grads=grads)["work"]
            got = block_activations(m, full, 0, 0, 0, 64, 1, costs, seq_tokens=1 << 20, shared_grads=grads)["work"]
            assert got == max(stacked, scores) and stacked < scores * (1 if grads == 0 else 3), (mode, grads)


def test_the_kv_gradient_of_each_query_segment_counts_without_recomputation_too():
    """Without recomputation (and under `selective`) the rebuilt part and the backward's gradients stack, and the
    whole-sequence KV gradient of each query segment (two under zigzag context parallelism) joins them."""
    from flashtrain.model.layer_plan import Role, layer_plan
    from flashtrain.parallel.partition import block_activations
    from flashtrain.train.config import compose, model_config

    sys.path.insert(0, str(ROOT / "tests"))
    from layer_plans import FOUR_LAYERS

    m = model_config(compose(["+exp=flash_tiny", *FOUR_LAYERS]))
    reuse = next(r for r in layer_plan(m) if r.role is Role.REUSE)
    for mode in ("none", "selective"):
        one = block_activations(m, reuse, 0, 0, 0, 64, 1, PartitionCosts(recompute=mode), shared_grads=500,
                                kv_grad=400)["work"]
        two = block_activations(m, reuse, 0, 0, 0, 64, 1, PartitionCosts(recompute=mode, kv_segments=2),
                                shared_grads=500, kv_grad=400)["work"]
        assert two - one == 800, mode


def test_unit_costs_give_the_attention_the_whole_sequence_kv_it_reads():
    """flash_tiny's four-layer plan at 256 positions over cp=4, no recomputation: with two query segments a
    rank, the backward work of the Full layer 2 (whose attention reads the KV it writes) and of the Reuse
    layer 3 (which reads it) grows by two whole-sequence KV gradients, [128, head_dim] fp32 each; the
    sliding-window layers 0 and 1 read none. The trainer's costs: two segments under zigzag context
    parallelism only."""
    from flashtrain.parallel.config import ParallelConfig
    from flashtrain.parallel.partition import unit_costs
    from flashtrain.train.config import optim_config
    from flashtrain.train.plan.stages import partition_costs

    sys.path.insert(0, str(ROOT / "tests"))
    from layer_plans import FOUR_LAYERS

    cfg, m, model, optimizer_of = _template(FOUR_LAYERS)
    one, two = (unit_costs(model, m, optimizer_of, 256, 1, PartitionCosts(kv_segments=s), 64) for s in (1, 2))
    kv = 4 * 128 * m.head_dim
    assert [b["work_bytes"] - a["work_bytes"] for a, b in zip(one, two)] == [0, 0, 2 * kv, 2 * kv]
    ocfg = optim_config(cfg)
    for cp, balance, segments in ((1, "zigzag", 1), (4, "zigzag", 2), (4, "contiguous", 1)):
        parallel = ParallelConfig(cp=cp, cp_balance=balance)
        assert partition_costs(m, ocfg, parallel, "none", True, 4).kv_segments == segments, (cp, balance)


def test_unit_costs_price_the_gradients_a_stage_holds_and_the_rounds_inputs():
    """flash_tiny's four-layer plan (Full ratio-2 layer 2 writes the compressed KV and the top-k that Reuse layer
    3 reads) at 256 positions split over cp=4 (64 a rank), 6 micro-batches a round, by hand from the shapes:
    block 3's input gradients are its differentiable carry (residual [64, hc, D] and mix [64, hc] fp32, the
    whole sequence's KV [128, head_dim] fp32; the top-k indices have none), its shared ones the KV's; the
    round's inputs are 3 int64 per position of the round (tokens, token types, labels). A stage holds
    its input gradients (not the first stage), the gradient of its outputs (the next stage's input gradients;
    not the last stage), the largest shared set of its blocks and the round's inputs once (`_stage_fixed`, in
    `_stage_cost` and the prefix-sum table alike)."""
    from flashtrain.parallel.partition import _cost_table, _stage_fixed, unit_costs
    from flashtrain.parallel.pipeline import live_shared_fields

    sys.path.insert(0, str(ROOT / "tests"))
    from layer_plans import FOUR_LAYERS

    cfg, m, model, optimizer_of = _template(FOUR_LAYERS)
    units = unit_costs(model, m, optimizer_of, 256, 1, PartitionCosts(recompute="full", round_microbatches=6), 64)
    assert set(live_shared_fields(model.plan, 3)) == {"kv", "topk"}
    shared = 4 * 128 * m.head_dim
    residual = 4 * 64 * m.hc_mult * (m.dim + 1)
    assert units[3]["shared_grad_bytes"] == shared and units[3]["input_grad_bytes"] == residual + shared
    assert units[1]["shared_grad_bytes"] == 0 and units[1]["input_grad_bytes"] == residual
    assert all(u["round_input_bytes"] == 3 * 8 * 256 * 6 for u in units)
    assert _stage_fixed(units, 0, 4) == shared + 3 * 8 * 256 * 6  # the first stage: no input gradients
    # layers 1-2: no shared field in their carry; the gradient of their outputs is layer 3's input gradient
    assert _stage_fixed(units, 1, 3) == residual + (residual + shared) + 3 * 8 * 256 * 6
    assert _stage_fixed(units, 2, 4) == residual + shared + 3 * 8 * 256 * 6  # layer 3 reads the KV layer 2 writes
    table = _cost_table(units, 2, [2, 1])
    assert all(v == _stage_cost(units, i, j, [2, 1][s - 1]) for (s, i, j), v in table.items())
    assert unit_costs(model, m, optimizer_of, 256, 1, PartitionCosts(recompute="full"), 64)[0]["round_input_bytes"] == 0


def test_a_block_that_writes_a_shared_field_gets_its_gradient_in_its_backward():
    """Full layer 2 of the four-layer plan writes the compressed KV that layer 3 reads: under context parallelism
    its backward receives that field's gradient whole (4 x 128 positions x head_dim fp32 at 256 positions,
    ratio 2), and block 3, which reads it, too; `block_activations` with those bytes by hand is the unit's
    work (without recomputation, where the gradients stack on the block's backward work and show)."""
    from flashtrain.parallel.partition import UnitInventory, _nbytes, block_activations, copy_bytes
    from flashtrain.parallel.pipeline import boundary_specs

    sys.path.insert(0, str(ROOT / "tests"))
    from layer_plans import FOUR_LAYERS

    cfg, m, model, optimizer_of = _template(FOUR_LAYERS)
    costs = PartitionCosts(recompute="none")
    inventory = UnitInventory(model, m, optimizer_of)
    units = inventory.costs(256, 1, costs, 64)
    kv = 4 * 128 * m.head_dim
    for i in (2, 3):
        blk = inventory.blocks[i]
        carry = sum(_nbytes(s) for s in boundary_specs(m, model.plan, i, 1, 256, 64))
        want = block_activations(m, blk["role"], blk["routed"], blk["rows"], carry, 64, 1, costs, 256,
                                 copy_bytes(blk["copies"], costs)[1], kv)["work"]
        assert units[i]["work_bytes"] == want, i
