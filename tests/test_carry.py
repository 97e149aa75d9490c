"""The carry contract (model/carry.py) against V41_SPEC §2 written out by hand, for exp=flash and
flash_tiny separately, and against what the blocks really read and write."""

import pytest
import torch

from flashtrain.model import Transformer
from flashtrain.model.aux import StepStats
from flashtrain.model.carry import FIELDS, Carry, SharedKV, shared_reads, shared_resets, shared_writes
from flashtrain.model.layer_plan import layer_plan
from flashtrain.parallel.pipeline import boundary_specs
from flashtrain.train.config import compose, model_config

SWA, FULL, REUSE, REINDEX = "swa", "full", "reuse", "reindex"


def _spec_table(restricted: bool = True) -> dict[int, tuple[str, set, set, set]]:
    """V41_SPEC §2, layer by layer: (role, reads, writes, resets) of the CSA2 fields. Layers 0-1 SWA;
    2, 8, 14 Full (ratio 2); 20 Full (ratio 1) and the candidate source; 24, 28, 32, 36 Reindex, scoring
    inside layer 20's pool when the restriction is on; every other layer Reuse."""
    table = {}
    for layer in range(40):
        if layer in (0, 1):
            table[layer] = (SWA, set(), set(), set())
        elif layer in (2, 8, 14):
            table[layer] = (FULL, set(), {"kv", "index_k", "topk"}, {"candidates"})
        elif layer == 20:
            table[layer] = (FULL, set(), {"kv", "index_k", "topk", "candidates"}, {"candidates"})
        elif layer in (24, 28, 32, 36):
            reads = {"kv", "index_k", "candidates"} if restricted else {"kv", "index_k"}
            table[layer] = (REINDEX, reads, {"topk"}, set())
        else:
            table[layer] = (REUSE, {"kv", "topk"}, set(), set())
    return table


@pytest.mark.parametrize("overrides", [["+exp=flash"], ["+exp=flash_tiny"],
                                       ["+exp=flash_tiny", "model.candidate_restriction=false"]])
def test_roles_read_and_write_what_the_spec_says(overrides):
    cfg = model_config(compose(overrides))
    want = _spec_table(restricted="model.candidate_restriction=false" not in overrides)
    plan = layer_plan(cfg)
    assert len(plan) == 40
    for role in plan:
        got = (role.role.value, set(shared_reads(role)), set(shared_writes(role)), set(shared_resets(role)))
        assert got == want[role.id], (role.id, got, want[role.id])


def test_field_shapes_and_boundary_specs_for_flash():
    """Shapes from V41_SPEC §1 (dim 5120, 4 streams, head_dim 512, index head 128, top-k 512, pools of 2048
    blocks of 8) for one sequence of 4096 tokens, at two cuts."""
    cfg = model_config(compose(["+exp=flash"]))
    plan = layer_plan(cfg)
    S = 4096
    assert FIELDS["candidates"].shape(cfg, 1, S, S) == (1, S, 512)  # ceil(4096 / 8) = 512 < 2048 blocks
    assert FIELDS["candidates"].shape(cfg, 1, 2 * 8 * 2048, 8 * 4096) == (1, 2 * 8 * 2048, 2048)
    # cut before Reuse 17: Full 14's KV (ratio 2) and top-k travel
    got = [(s.name, s.shape, s.dtype) for s in boundary_specs(cfg, plan, 17, 1, S)]
    assert got == [("tokens", (1, S), torch.long), ("token_types", (1, S), torch.long),
                   ("h", (1, S, 4, 5120), torch.float32), ("pre_mix", (1, S, 4), torch.float32),
                   ("kv", (1, S // 2, 512), torch.float32), ("topk", (1, S, 512), torch.long)]
    # cut before Reindex 24: Full 20's KV, index-K (ratio 1) and pool; 24 makes its own top-k
    got = [(s.name, s.shape, s.dtype) for s in boundary_specs(cfg, plan, 24, 1, S)][4:]
    assert got == [("kv", (1, S, 512), torch.float32), ("index_k", (1, S, 128), torch.float32),
                   ("candidates", (1, S, 512), torch.int32)]
    # under context parallelism (2 ranks): the compressed fields whole, the per-query ones local
    got = {s.name: s.shape for s in boundary_specs(cfg, plan, 23, 1, S, S // 2)}
    assert got == {"tokens": (1, S), "token_types": (1, S), "h": (1, S // 2, 4, 5120), "pre_mix": (1, S // 2, 4),
                   "kv": (1, S, 512), "index_k": (1, S, 128), "topk": (1, S // 2, 512),
                   "candidates": (1, S // 2, 512)}


@pytest.mark.slow
def test_blocks_write_and_read_only_what_the_spec_says(tiny_cfg):
    """Run flash_tiny block by block: the CSA2 fields a block replaces are its spec writes (and a reset pool
    that was set), and running each block from a carry holding only its spec reads gives the same output."""
    torch.manual_seed(0)
    model = Transformer(tiny_cfg)
    want = _spec_table()
    tokens = torch.randint(0, tiny_cfg.image_token_id, (2, 128))
    with torch.no_grad():
        ctx = model.context(tokens, None, StepStats())
        carry = model.embed_inputs(tokens)
        for layer, block in enumerate(model.layers):
            _, reads, writes, resets = want[layer]
            before = {n: getattr(carry.shared, n) for n in ("kv", "index_k", "topk", "candidates")}
            only_reads = SharedKV(**{n: t for n, t in before.items() if n in reads})
            alone = block(Carry(carry.h, carry.pre_mix, only_reads), model.context(tokens, None, StepStats()))
            carry = block(carry, ctx)
            changed = {n for n, t in before.items() if getattr(carry.shared, n) is not t}
            assert changed == writes | {n for n in resets if before[n] is not None}, (layer, changed)
            torch.testing.assert_close(alone.h, carry.h, rtol=0, atol=0)
            torch.testing.assert_close(alone.pre_mix, carry.pre_mix, rtol=0, atol=0)
    assert carry.shared.candidates is not None and carry.shared.candidates.dtype == torch.int32


def test_a_write_outside_the_contract_is_refused(tiny_cfg):
    plan = layer_plan(tiny_cfg)
    shared = SharedKV(kv=torch.zeros(1, 4, 32))
    with pytest.raises(RuntimeError, match="layer 3 .reuse. wrote \\['kv'\\]"):
        shared.write(plan[3], {"kv": torch.ones(1, 4, 32)})
    given = shared.read(plan[3])
    assert set(given) == {"kv", "topk"} and given["kv"] is shared.kv and given["topk"] is None
    shared.write(plan[20], {"topk": torch.zeros(1, 4, 2, dtype=torch.long)})  # Full 20 may, and resets the pool
    assert shared.candidates is None and shared.topk.shape == (1, 4, 2)


def test_carry_flattens_in_table_order():
    h, pre, kv, idx, topk, cand = (torch.full((1,), float(i)) for i in range(6))
    carry = Carry(h, pre, SharedKV(kv, idx, topk, cand))
    order = (h, pre, kv, idx, topk, cand)
    assert all(a is b for a, b in zip(carry.tensors(), order, strict=True))
    back = Carry.from_tensors(carry.tensors())
    assert back.h is h and back.pre_mix is pre and back.shared.kv is kv and back.shared.candidates is cand
