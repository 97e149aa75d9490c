"""Per-rank construction (DESIGN.md "Construction at scale", model/init.py): a meta-device template
pruned to a rank's stages and expert shard and then materialised holds exactly that rank's
parameters, with the same values as one process building the whole model (pp=2, ep=2 and pp=2 x
ep=2 against pp=1 ep=1), never allocating what it does not own; the fixed-batch arithmetic of
exp=flash."""

import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import Allocations

from flashtrain.config.typed import typed_config
from flashtrain.model import Transformer
from flashtrain.parallel.config import ParallelConfig
from flashtrain.parallel.construct import build_rank_model, model_template
from flashtrain.parallel.dims import ParallelDims
from flashtrain.parallel.pipeline import local_stage_ranges

pytestmark = pytest.mark.xdist_group("construction")  # its module-scoped reference runs are shared

BOUNDS = [(0, 17), (17, 40)]  # a pp=2 split that cuts between layer 14 (Full, Engram) and its Reuse layers


def _rank_model(cfg, seed, pp_rank=None, ep_rank=None):
    """What the trainer builds on pp rank `pp_rank` of 2 / ep rank `ep_rank` of 2 (None: unsplit)."""
    stages = None if pp_rank is None else local_stage_ranges(ParallelConfig(pp=2), BOUNDS, pp_rank)
    dims = None if ep_rank is None else SimpleNamespace(ep=2, ep_rank=ep_rank, ep_group=None, engram_shard=False)
    return build_rank_model(model_template(cfg), "cpu", seed, stages, dims)


@pytest.fixture(scope="module")
def whole(tiny_cfg):
    return Transformer(tiny_cfg, seed=7)


@pytest.mark.parametrize("pp_rank, ep_rank", [(0, None), (1, None), (None, 0), (None, 1), (1, 1)])
def test_every_layout_starts_from_the_same_weights(tiny_cfg, whole, pp_rank, ep_rank):
    part = _rank_model(tiny_cfg, 7, pp_rank, ep_rank)
    full = dict(whole.named_parameters())
    mine = dict(part.named_parameters())
    assert mine and set(mine) <= set(full)
    if pp_rank is not None:
        lo, hi = BOUNDS[pp_rank]
        layers = {int(n.split(".")[1]) for n in mine if n.startswith("layers.")}
        assert layers == set(range(lo, hi))
        assert ("embed.weight" in mine) == (pp_rank == 0) and ("head.weight" in mine) == (pp_rank == 1)
    for name, p in mine.items():
        want = full[name]
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")) and ep_rank is not None:
            e = tiny_cfg.n_routed_experts // 2
            want = want[ep_rank * e:(ep_rank + 1) * e]
        assert torch.equal(p, want), name
    full_buffers = dict(whole.named_buffers())
    for name, b in part.named_buffers():
        assert torch.equal(b, full_buffers[name]), name
    # and the values are not the global RNG's: another seed gives other weights, the same seed the same
    assert not torch.equal(Transformer(tiny_cfg, seed=8).embed.weight, whole.embed.weight)
    torch.manual_seed(123)
    assert torch.equal(Transformer(tiny_cfg, seed=7).layers[3].ffn.experts.w2, whole.layers[3].ffn.experts.w2)


def test_init_statistics_follow_the_documented_rules(tiny_cfg, whole):
    std = tiny_cfg.init_std
    for name, p in whole.named_parameters():
        if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "q_weight", "k_weight")):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(("attn_sink", ".bias")):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif name.endswith(("hc_attn_scale", "hc_ffn_scale")):
            assert torch.equal(p, torch.ones_like(p)), name
        elif p.numel() >= 4096 and not name.endswith(("_fn", "_base")):
            assert abs(p.std().item() - std) < 0.05 * std and abs(p.mean().item()) < 0.05 * std, name
    w = whole.layers[0].ffn.experts.w1
    assert not torch.equal(w[0], w[1])  # experts draw from their own generators, not copies


def test_row_blocks_of_a_sharded_tensor_equal_the_whole(monkeypatch):
    """Any row range of a tensor, filled with its global row offset, equals that range of the whole
    tensor, also when the range cuts through seeded blocks."""
    import flashtrain.model.init as mi

    monkeypatch.setattr(mi, "INIT_BLOCK_ELEMS", 64)  # 8 rows of 8 per block
    full = torch.empty(30, 8)
    mi.seeded_normal_(full, 1.0, 3, "t")
    for offset, rows in ((0, 7), (5, 11), (16, 14), (29, 1)):
        part = torch.empty(rows, 8)
        mi.seeded_normal_(part, 1.0, 3, "t", row_offset=offset, global_rows=30)
        assert torch.equal(part, full[offset:offset + rows]), offset


def test_a_rank_allocates_only_what_it_owns(tiny_cfg, whole):
    """Building pp rank 1 with ep rank 1 allocates, in all, its own parameters and buffers once, plus the
    seeded blocks that fill them (at most their size again) -- less than the whole model's parameters
    alone, which building the whole model and pruning it would allocate."""
    with Allocations() as mem:
        part = _rank_model(tiny_cfg, 7, 1, 1)
    owned = sum(p.numel() * p.element_size() for p in part.parameters())
    buffers = sum(b.numel() * b.element_size() for b in part.buffers())
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    bound = 2 * (owned + buffers) + (1 << 16)
    assert bound < total  # so the bound below tells a pruned build from a whole one
    assert owned <= mem.total <= bound, (mem.total, owned, buffers)


def test_flash_fixed_batch_fits_common_layouts():
    """exp=flash: 1536 sequences of 64K (the published 100.6M tokens, rounded); 1024 GPUs with pp=16,
    ep=64 give dp=64 and 24 one-sequence micro-batches per pipeline, enough for 1F1B."""
    from flashtrain.train.build import plan_layout
    from flashtrain.train.config import TrainConfig, compose, data_config

    cfg = compose(["+exp=flash"])
    train, data = typed_config(TrainConfig, cfg["train"], "train"), data_config(cfg)
    assert data.batch_size == 1 and train.global_batch_tokens == 1536 * 65536
    layout = plan_layout(train, data.seq_len, data.batch_size, ParallelConfig(pp=16, ep=64), 1024, 40, 384)
    assert (layout.dp, layout.accumulation, layout.global_sequences) == (64, 24, 1536)
    for world in (8, 64, 256, 512):
        assert plan_layout(train, data.seq_len, 1, ParallelConfig(), world, 40, 384).global_sequences == 1536


def test_bad_global_batch_names_the_nearest_valid_one():
    from flashtrain.config.errors import ConfigError
    from flashtrain.train.build import plan_layout
    from flashtrain.train.config import TrainConfig

    train = TrainConfig(global_batch_tokens=1535 * 65536)
    with pytest.raises(ConfigError) as e:
        plan_layout(train, 65536, 1, ParallelConfig(pp=16, ep=64), 1024, 40, 384)
    msg = str(e.value)
    assert "1535 sequences" in msg and "64 data-parallel rank(s)" in msg
    assert f"the nearest is train.global_batch_tokens={1536 * 65536} (1536 sequences)" in msg
    with pytest.raises(ConfigError,
                       match=f"nearest is train.global_batch_tokens={4 * 10} \\(4 sequences\\) or {8 * 10}"):
        plan_layout(TrainConfig(global_batch_tokens=60), 10, 2, ParallelConfig(), 2, 40, 8)
    with pytest.raises(ConfigError, match="train.loss_tile_tokens=0: must be a positive number"):
        plan_layout(TrainConfig(global_batch_tokens=40, loss_tile_tokens=0), 10, 2, ParallelConfig(), 2, 40, 8)


def test_a_layout_for_another_world_size_is_refused_and_the_tools_default_to_it():
    """parallel.world (exp=flash_2048gpu): the trainer refuses another process count, naming both;
    launch/estimate.py and launch/plan.py take it as their --world."""
    import importlib.util
    from pathlib import Path

    from flashtrain.config.errors import ConfigError
    from flashtrain.train.build import plan_layout
    from flashtrain.train.config import TrainConfig, compose

    ROOT = Path(__file__).resolve().parent.parent

    with pytest.raises(ConfigError, match=r"parallel.world=4 but this run has 2 process"):
        plan_layout(TrainConfig(global_batch_tokens=40), 10, 2, ParallelConfig(world=4), 2, 40, 8)
    assert plan_layout(TrainConfig(global_batch_tokens=40), 10, 2, ParallelConfig(world=2), 2, 40, 8).dp == 2
    spec = importlib.util.spec_from_file_location("estimate_cli", ROOT / "launch" / "estimate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.configured_world(["+exp=flash_2048gpu"]) == 2048
    assert cli.configured_world(["+exp=flash_tiny"]) is None
    assert compose(["+exp=flash_2048gpu_1m"]).parallel.world == 2048


def test_only_cp_rank_0_counts_the_data():
    """The cp ranks of a group read the same batches (each keeps its part of the sequence): padding,
    positions and the loader's skip counters are counted by cp rank 0 alone, so that the step's all-reduce
    counts each batch once per dp rank (a doubled count would leave the padding fraction unchanged and
    show only in the skip counters, which the trainer runs' corpus leaves at 0)."""
    from types import SimpleNamespace

    from flashtrain.train.module import counts_data

    assert [counts_data(SimpleNamespace(cp_rank=r)) for r in range(4)] == [True, False, False, False]


def _engram_worker(rank, store, cfg, results):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    dims = ParallelDims.build(2, rank, 1, 1, cfg.n_layers, cfg.n_routed_experts, engram_shard=True, cp=2)
    model = build_rank_model(model_template(cfg), "cpu", 7, None, dims)
    results[rank] = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("engram.embed.weight")}
    dist.destroy_process_group()


def test_engram_rows_are_split_over_the_dp_x_cp_ranks_of_a_stage(tmp_path, tiny_cfg, whole):
    """dp=1 x cp=2 with parallel.engram_shard: the two context-parallel ranks hold the same parameters, so
    each keeps its own row block of every Engram table (`dims.dp_cp_rank`, not the data-parallel rank, which
    is 0 on both), and the two blocks are the whole table of one process."""
    results = mp.Manager().dict()
    mp.spawn(_engram_worker, args=(str(tmp_path / "store"), tiny_cfg, results), nprocs=2)
    full = {n: p for n, p in whole.named_parameters() if n.endswith("engram.embed.weight")}
    assert full and set(results[0]) == set(results[1]) == set(full)
    for name, table in full.items():
        mine = results[0][name], results[1][name]
        assert 0 < mine[0].shape[0] < table.shape[0]
        assert torch.equal(torch.cat(mine), table), name
