"""Pipeline stages (parallel/pipeline.py): what crosses each boundary, placement, pruning, config
refusal; the multi-process parity runs are in tests/test_pipeline_dist.py."""

import pytest
import torch
from layer_plans import FOUR_LAYERS

from flashtrain.config.errors import ConfigError
from flashtrain.config.typed import typed_config
from flashtrain.model import Transformer
from flashtrain.model.aux import StepStats
from flashtrain.parallel.config import ParallelConfig
from flashtrain.parallel.pipeline import boundary_specs, live_shared_fields, prune_to_stages, stage_ids, stage_ranges


def test_live_fields_follow_the_role_table(tiny_cfg):
    from flashtrain.model.layer_plan import layer_plan

    plan = layer_plan(tiny_cfg)
    # tiny: Full 2, 8, 14 (ratio 2), Full 20 (ratio 1, candidate source), Reindex 24/28/32/36 use the pool
    assert live_shared_fields(plan, 2) == {}  # layer 2 is Full: it reads nothing from the carry
    live = live_shared_fields(plan, 17)
    assert list(live) == ["kv", "topk"] and live["kv"].id == 14 and live["topk"].id == 14
    live = live_shared_fields(plan, 24)  # Reindex 24 reads kv, index-K and the pool of Full 20, not its top-k
    assert list(live) == ["kv", "index_k", "candidates"] and {r.id for r in live.values()} == {20}
    live = live_shared_fields(plan, 23)  # Reuse 23 still reads Full 20's top-k
    assert list(live) == ["kv", "index_k", "topk", "candidates"] and {r.id for r in live.values()} == {20}
    live = live_shared_fields(plan, 25)  # Reuse 25 reads Reindex 24's top-k; Reindex 28 still needs the rest
    assert list(live) == ["kv", "index_k", "topk", "candidates"] and live["topk"].id == 24


# every boundary where the live set or its writer changes in the tiny plan (Full 2 / 8 / 14 at ratio 2,
# Full 20 the candidate source, Reindex 24 / 28 / 32 / 36), plus the first and the last
@pytest.mark.slow
@pytest.mark.parametrize("boundary", [1, 2, 3, 8, 9, 14, 17, 20, 21, 23, 24, 25, 28, 36, 39])
def test_boundary_specs_match_the_real_carry(tiny_cfg, boundary):
    """Run blocks [0, boundary) for real and compare the carry with the static spec: every live field
    present with that shape and dtype, and every field the rest of the model reads is in the spec
    (running the remaining blocks from a carry holding only the spec'd fields reproduces the logits)."""
    torch.manual_seed(0)
    model = Transformer(tiny_cfg)
    b, S = 2, 128
    tokens = torch.randint(0, tiny_cfg.image_token_id, (b, S))
    types = torch.full_like(tokens, -1)
    with torch.no_grad():
        ctx = model.context(tokens, types, StepStats())
        full = model.logits(model.run_blocks(model.embed_inputs(tokens, types), ctx))
        carry = model.run_blocks(model.embed_inputs(tokens, types), ctx, 0, boundary)
        specs = boundary_specs(tiny_cfg, model.plan, boundary, b, S)
        kept = {}
        for spec in specs:
            if spec.name in ("tokens", "token_types"):
                continue
            t = getattr(carry, spec.name) if spec.name in ("h", "pre_mix") else getattr(carry.shared, spec.name)
            assert t is not None and tuple(t.shape) == spec.shape and t.dtype == spec.dtype, spec
            kept[spec.name] = t
        from flashtrain.model.attention import SharedKV
        from flashtrain.model.transformer import Carry

        rest = Carry(kept["h"], kept["pre_mix"],
                     SharedKV(**{k: v for k, v in kept.items() if k not in ("h", "pre_mix")}))
        out = model.logits(model.run_blocks(rest, model.context(tokens, types, StepStats()), boundary))
    torch.testing.assert_close(out, full, rtol=0, atol=0)


def test_stage_placement():
    assert [stage_ids(ParallelConfig(pp=2), r) for r in (0, 1)] == [[0], [1]]
    assert ([stage_ids(ParallelConfig(pp=2, pipeline_schedule="interleaved_1f1b"), r) for r in (0, 1)]
            == [[0, 2], [1, 3]])
    assert ([stage_ids(ParallelConfig(pp=4, pipeline_schedule="zbv"), r) for r in range(4)]
            == [[0, 7], [1, 6], [2, 5], [3, 4]])
    assert stage_ids(ParallelConfig(pp=2, pipeline_schedule="dualpipev"), 0) == [0, 3]


def test_prune_keeps_names_and_drops_the_rest(tiny_cfg, tiny_model):
    full = dict(tiny_model.named_parameters())
    ranges = stage_ranges([(0, 9), (9, 17), (17, 23), (23, 40)])
    prune_to_stages(tiny_model, [ranges[0], ranges[3]])  # rank 0 of a V-shaped pp=2 pipeline
    names = set(dict(tiny_model.named_parameters()))
    assert "embed.weight" in names and "head.weight" in names and "norm.weight" in names
    expect = {n for n in full if not n.startswith("layers.") or int(n.split(".")[1]) in range(0, 9)
              or int(n.split(".")[1]) in range(23, 40)}
    assert names == expect
    middle = Transformer(tiny_cfg)
    prune_to_stages(middle, [ranges[1]])
    names = set(dict(middle.named_parameters()))
    assert names == {n for n in full if n.startswith("layers.") and int(n.split(".")[1]) in range(9, 17)}


@pytest.mark.parametrize("values, accumulation, message", [
    ({"pipeline_schedule": "gpipe"}, 4, "parallel.pipeline_schedule='gpipe'"),
    ({"pp": 2, "microbatches": 3}, 4, "does not divide the 4 micro-batches"),
    ({"pp": 4}, 2, "needs at least 4 micro-batches"),
    ({"pp": 2, "pipeline_schedule": "dualpipev"}, 2, "needs at least 4 micro-batches"),
    ({"pp": 2, "pipeline_schedule": "zbv"}, 2, "needs at least 4 micro-batches"),
    ({"pp": 4, "pipeline_schedule": "interleaved_1f1b", "microbatches": 9}, 9, "a multiple of 4"),
    ({"pp": 2, "bogus": 1}, 4, "bogus"),
])
def test_bad_pipeline_config_is_refused_with_a_message(values, accumulation, message):
    with pytest.raises(ConfigError, match=message):
        typed_config(ParallelConfig, values, "parallel").round_microbatches(accumulation)


def test_good_pipeline_config_rounds():
    assert typed_config(ParallelConfig, {"pp": 2}, "parallel").round_microbatches(4) == 4
    assert typed_config(ParallelConfig, {"pp": 2, "microbatches": 2}, "parallel").round_microbatches(4) == 2
    dualpipe = typed_config(ParallelConfig, {"pp": 2, "pipeline_schedule": "dualpipev"}, "parallel")
    assert dualpipe.round_microbatches(8) == 8


def test_the_former_schedule_key_still_works_with_a_deprecation_message():
    """`parallel.schedule` was renamed `parallel.pipeline_schedule` ("schedule" is the LR schedule); the old
    key is read for one release, with a warning, and a conflicting pair is refused."""
    from flashtrain.train.config import compose

    with pytest.warns(DeprecationWarning, match="parallel.pipeline_schedule=zbv"):
        cfg = typed_config(ParallelConfig, {"pp": 2, "schedule": "zbv"}, "parallel")
    assert cfg.pipeline_schedule == "zbv" and cfg.stages_per_rank == 2
    with pytest.raises(ConfigError, match="set only parallel.pipeline_schedule"):
        typed_config(ParallelConfig, {"schedule": "zbv", "pipeline_schedule": "dualpipev"}, "parallel")
    from omegaconf import OmegaConf

    conf = compose(["+exp=flash_tiny", "parallel.schedule=dualpipev"])  # the command-line override still parses
    with pytest.warns(DeprecationWarning):
        parsed = typed_config(ParallelConfig, OmegaConf.to_container(conf.parallel), "parallel")
    assert parsed.pipeline_schedule == "dualpipev"


def test_why_a_split_backward_refuses_selective_recomputation(monkeypatch):
    """The refusal of parallel.config.check_recompute_with_schedule is torch's own limit, not a guess: ZBV's
    step with the check taken out raises in its first weight pass (the estimator runs the real step on fake
    tensors), where interleaved 1F1B (one backward pass) runs."""
    import flashtrain.train.build as build
    from flashtrain.train.config import compose
    from flashtrain.train.plan.estimate import estimate_rank

    def cfg(schedule):  # torch's limit holds at any length: 64-token micro-batches keep the simulations short
        return compose(["+exp=flash_tiny", *FOUR_LAYERS, "parallel.pp=2", "data.seq_len=64",
                        "train.global_batch_tokens=256", "data.batch_size=1", f"parallel.pipeline_schedule={schedule}",
                        "train.recompute=selective"])

    with pytest.raises(ConfigError, match="selective"):
        estimate_rank(cfg("zbv"), 2, 0, "cpu")
    assert estimate_rank(cfg("interleaved_1f1b"), 2, 0, "cpu").peak_bytes > 0
    monkeypatch.setattr(build, "check_recompute_with_schedule", lambda *a: None)
    with pytest.raises(RuntimeError, match="backward once on any region computed under selective"):
        estimate_rank(cfg("zbv"), 2, 0, "cpu")
