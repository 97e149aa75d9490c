
"""Data parallelism in parallel/ (DESIGN.md "Parallelism": data parallel): ZeRO-1 ownership planning
against brute force, global-tensor checkpoints resharding, and on 2 gloo processes the overlapped
bucketed reduction and the ZeRO-1 step against the replicated one (same gradients, same update, half
the state, state reloaded into a replicated run), and buckets reduced in the same order on ranks whose
backward completes them in opposite orders. The trainer-level parity runs (ZeRO-1 by default
with dp > 1, Engram tables row-sharded, resumes across dp / ep / pp layouts) are in test_trainer.py."""

import itertools
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import warm_launch
from layer_plans import EIGHT_LAYERS

from flashtrain.parallel.sharded_state import GlobalChunk
from flashtrain.parallel.zero import balance_matrices, flat_pieces, ns_cost, row_pieces

ROOT = Path(__file__).resolve().parent.parent


def _covers(pieces, numel, align):
    assert pieces[0].start == 0 and pieces[-1].end == numel
    assert all(a.end == b.start for a, b in zip(pieces, pieces[1:]))
    assert all(p.start % align == 0 and p.end % align == 0 for p in pieces)


def test_pieces_cover_parameters_and_muon_owners_are_balanced_by_work():
    _covers(row_pieces(10, 3, 4), 30, 3)
    assert [p.numel // 3 for p in row_pieces(10, 3, 4)] == [3, 3, 2, 2]
    assert [p.numel for p in flat_pieces(10, 4)] == [3, 3, 3, 1]
    assert [p.numel for p in flat_pieces(2, 4)] == [1, 1, 0, 0]
    # one large matrix and many small ones: balancing by count would put the large one with others
    params = [("wq_b", 4, 8, 32), ("big", 1, 64, 64), ("experts", 8, 16, 16)]
    matrices = {n: (k, r, c) for n, k, r, c in params}
    plan = balance_matrices(params, 3)
    for n, k, r, c in params:
        _covers(plan[n], k * r * c, r * c)
    loads = [0.0] * 3  # Newton-Schulz cost per owner (what the balancing minimises the maximum of)
    for n, ps in plan.items():
        for p in ps:
            loads[p.owner] += ns_cost(p.numel // (matrices[n][1] * matrices[n][2]), *matrices[n][1:])
    assert sum(loads) == sum(ns_cost(k, r, c) for _, k, r, c in params)
    pieces = [(n, p) for n in plan for p in plan[n]]
    costs = [ns_cost(p.numel // (matrices[n][1] * matrices[n][2]), *matrices[n][1:]) for n, p in pieces]
    best = min(max(sum(c for c, o in zip(costs, owners) if o == k) for k in range(3))
               for owners in itertools.product(range(3), repeat=len(costs)))
    assert max(loads) <= 4 / 3 * best  # LPT's guarantee against the brute-force optimum
    big_owner = plan["big"][0].owner
    assert sum(p.owner == big_owner for _, p in pieces) < len(pieces) / 3  # fewer pieces: more work each


def test_global_chunks_reshard_through_dcp(tmp_path):
    """A [10, 3] tensor written as two row blocks and a flat 12-element tensor as three pieces load
    into other blocks and into whole tensors, exactly."""
    full, flat = torch.arange(30.0).view(10, 3), torch.arange(12.0) * -1
    dcp.save({"t": GlobalChunk([(full[:4].clone(), (0, 0)), (full[4:].clone(), (4, 0))], (10, 3)),
              "f": GlobalChunk([(flat[:5].clone(), (0,)), (flat[5:7].clone(), (5,)), (flat[7:].clone(), (7,))], (12,))},
             checkpoint_id=str(tmp_path))
    blocks = GlobalChunk([(torch.zeros(3, 3), (2, 0)), (torch.zeros(1, 3), (9, 0))], (10, 3))
    whole = {"t": torch.zeros(10, 3), "f": torch.zeros(12)}
    dcp.load({"t": blocks, "f": GlobalChunk([(torch.zeros(6), (3,))], (12,))}, checkpoint_id=str(tmp_path))
    dcp.load(whole, checkpoint_id=str(tmp_path))
    assert torch.equal(blocks.chunks[0][0], full[2:5]) and torch.equal(blocks.chunks[1][0], full[9:])
    assert torch.equal(whole["t"], full) and torch.equal(whole["f"], flat)


SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
from flashtrain.model import Transformer
from flashtrain.parallel.dims import ParallelDims
from flashtrain.train.checkpoint import _blob, load_checkpoint, optimizer_state_sharded
from flashtrain.train.config import compose, model_config, optim_config
from flashtrain.train.loss import tiled_lm_loss
from flashtrain.train.optim import build_optimizers, route_parameters
from flashtrain.train.optim.routing import zero_inputs
from conftest import Allocations
import torch.distributed.checkpoint as dcp

dist.init_process_group("gloo")
r = dist.get_rank()
cfg = compose(["+exp=flash_tiny"])
mcfg, ocfg = model_config(cfg), optim_config(cfg)
def make():
    torch.manual_seed(0)
    return Transformer(mcfg)
model, twin = make(), make()
dims = ParallelDims.build(2, r, 1, 1, mcfg.n_layers, mcfg.n_routed_experts, zero=True, bucket_bytes=1 << 16)
reducer = dims.grad_reducer(model)
g = torch.Generator().manual_seed(10 + r)
tokens = torch.randint(0, mcfg.vocab_size, (2, 2, 64), generator=g)

def backward(m, final_hook=None):
    for i in range(2):
        hidden = m.final_hidden(m.run(tokens[i], aux_grad_scale=0.5))
        loss = tiled_lm_loss(hidden, m.head, tokens[i].roll(-1, 1), 64, 0.5)
        if final_hook and i == 1:
            final_hook()
        loss.backward()

# overlapped, bucketed reduction vs each rank's own gradients averaged by hand
reducer.zero_grad()
backward(model, reducer.mark_final)
launched_in_backward = reducer.launches
alloc = Allocations()
with alloc:
    reducer.finish()
backward(twin)
grads = [p.grad for p in twin.parameters() if p.grad is not None]
for t in grads:
    dist.all_reduce(t)
    t /= 2
total = sum(t.numel() * 4 for t in grads)
assert launched_in_backward > 0, "no bucket started during backward"
largest_bucket = max(b.buffer.numel() * b.buffer.element_size() for b in reducer.buckets)
# no flat copy of the gradients: nothing larger than one bucket, a few percent in all (gloo's staging)
assert alloc.largest <= largest_bucket < total / 50 and alloc.total < total / 10, (alloc.total, alloc.largest, total)
for (n, p), q in zip(model.named_parameters(), twin.parameters()):
    assert (p.grad is None) == (q.grad is None), n
    if p.grad is not None:
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)

# ZeRO-1 step vs the replicated step on the same gradients
for p, q in zip(model.parameters(), twin.parameters()):
    if p.grad is not None:
        q.grad = p.grad.clone()
kinds, matrices = zero_inputs(route_parameters(model, mcfg, ocfg))
plan = dims.zero_plan(model, kinds, matrices)
zero = build_optimizers(model, mcfg, ocfg, zero_of=lambda p: plan[id(p)], lr=1e-2)
repl = build_optimizers(twin, mcfg, ocfg, lr=1e-2)
for step in range(2):
    zero.set_lr(1e-2); repl.set_lr(1e-2)
    zero.step(); repl.step()
for (n, p), q in zip(model.named_parameters(), twin.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
def state_numel(opts):
    return sum(v.numel() for o in opts.optimizers.values() for _, _, v, _ in o.owned_state() if v.dim())
held = torch.tensor([float(state_numel(zero))])
dist.all_reduce(held)
assert (state_numel(zero) < 0.7 * state_numel(repl)
        and held.item() == state_numel(repl)), (state_numel(zero), state_numel(repl))

# ZeRO-1 state saved as global tensors loads into a replicated optimizer set
ck = sys.argv[1]
dcp.save({"model": model.state_dict(), "optim": optimizer_state_sharded(zero.optimizers, model, {}),
          "meta": _blob({}), f"dp{r}": _blob({})}, checkpoint_id=ck)
third = make()
for p in third.parameters():
    p.grad = torch.zeros_like(p)
fresh = build_optimizers(third, mcfg, ocfg, lr=1e-2)
load_checkpoint(ck, third, fresh.optimizers, dims)
name_of = {id(p): n for n, p in third.named_parameters()}
mine = {(name_of[id(p)], k): v for o in fresh.optimizers.values() for p, k, v, _ in o.owned_state()}
tname = {id(p): n for n, p in twin.named_parameters()}
ref = {(tname[id(p)], k): v for o in repl.optimizers.values() for p, k, v, _ in o.owned_state()}
assert mine.keys() == ref.keys(), sorted(set(mine) ^ set(ref))[:5]
for key in ref:
    torch.testing.assert_close(mine[key].reshape(ref[key].shape).float(), ref[key].float(), rtol=1e-5, atol=1e-6,
                               msg=str(key))
# buckets start in bucket order whatever order this rank's backward completes them in (an image on
# one rank only changes its graph): one backward call per parameter, rank 0 completing the buckets
# first to last, rank 1 last to first; one more parameter is reached on rank 0 only (zero-fill rule)
from flashtrain.parallel.grad_reduce import GradReducer
extra, qs = torch.nn.Parameter(torch.zeros(2)), [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 7, 11)]
red = GradReducer([("extra", extra)] + [(f"q{i}", q) for i, q in enumerate(qs)], lambda name: dist.group.WORLD, 2,
                  bucket_bytes=4)  # one parameter per bucket, in reverse registration order: q3 q2 q1 q0 extra
red.zero_grad()
assert [[id(p) for p in b.params] for b in red.buckets] == [[id(q)] for q in reversed(qs)] + [[id(extra)]]
red.mark_final()
order = [3, 2, 1, 0] if r == 0 else [0, 1, 2, 3]
for k, i in enumerate(order):
    (qs[i] * (i + 1 + r)).sum().backward()
    assert red.launches == (k + 1 if r == 0 else 4 * (k == 3)), (r, k, red.launches)  # rank 1: q3 comes last
if r == 0:
    (extra * 3).sum().backward()
red.finish()
for i, q in enumerate(qs):  # (i + 1 + i + 2) / 2 on both ranks
    torch.testing.assert_close(q.grad, torch.full_like(q, (2 * i + 3) / 2))
torch.testing.assert_close(extra.grad, torch.full_like(extra, 1.5))
# row-sharded Engram lookups of a whole round: counts of every micro-batch in one exchange, ids sent
# only on launch, rows equal to the whole table's; each looked-up row's gradient reaches its owner
from flashtrain.parallel.engram_shard import ShardedRows
table = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))
block = table[5 * r:5 * r + 5].clone().requires_grad_()
rows = ShardedRows(dist.group.WORLD, 2, r, [0, 5, 10])
ids = [torch.tensor([[1, 7, 7, 3]]) + r, torch.tensor([[9, 1, 2, 2, 6]]) - r]
reqs = rows.request_round(ids)
assert all(q.asked is None for q in reqs) and [sum(q.send) for q in reqs] == [3, 4]  # distinct ids
total = 0
for q, t in zip(reqs, ids):
    got = rows(block, t, q)
    torch.testing.assert_close(got, table[t])
    total = total + got.sum()
total.backward()
looked_up = torch.zeros(10)
for t in [torch.tensor([1, 7, 7, 3]) + k for k in (0, 1)] + [torch.tensor([9, 1, 2, 2, 6]) - k for k in (0, 1)]:
    looked_up.index_add_(0, t, torch.ones(len(t)))
torch.testing.assert_close(block.grad, looked_up[5 * r:5 * r + 5, None].expand(5, 4))
print(f"rank {r}: zero ok", flush=True)
dist.barrier()  # no rank tears down while its peer still exchanges (an abort at exit otherwise, now and then)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_overlapped_reduction_and_zero1_step_match_the_replicated_path_two_processes(tmp_path):
    out = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "--no-python", sys.executable, "-c", SCRIPT, str(tmp_path / "ck")], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}, capture_output=True, text=True,
                           timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "rank 0: zero ok" in out.stdout and "rank 1: zero ok" in out.stdout


@pytest.mark.slow
def test_pipeline_sends_each_micro_batchs_engram_ids_during_the_previous_forward(monkeypatch):
    """Under pipelining a row-sharded Engram layer's counts are exchanged for the whole round when it
    starts and micro-batch k's ids are sent when micro-batch k - 1's forward starts, so the exchange
    travels during compute even when the Engram layer is the stage's first block. Simulated (fake
    tensors and process group) for the first stage of pp=2 x dp=2 of flash_tiny (8 layers)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import flashtrain.parallel.engram_shard as engram_shard
    import flashtrain.train.plan.estimate as estimate
    from flashtrain.train.config import compose

    monkeypatch.setattr(estimate, "_peak_preserving_microbatches", lambda *a: {})
    launches, rounds = [], []
    launch, request_round = engram_shard.RowRequest.launch, engram_shard.ShardedRows.request_round

    def watched_launch(self):
        if self.asked is None:
            launches.append((id(self), sim.pipe.modules[0].microbatch))
        return launch(self)

    def watched_round(self, ids):
        out = request_round(self, ids)
        rounds.append([id(q) for q in out])
        return out

    monkeypatch.setattr(engram_shard.RowRequest, "launch", watched_launch)
    monkeypatch.setattr(engram_shard.ShardedRows, "request_round", watched_round)
    cfg = compose(["+exp=flash_tiny", *EIGHT_LAYERS, "parallel.pp=2", "parallel.engram_shard=true",
                   "data.batch_size=1", "train.global_batch_tokens=1024", "parallel.stage_layers=[5,3]"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        sim = estimate.SimulatedRank(cfg, 4, 0, "cpu", fake)
        n = sim.layout.round_microbatches
        assert n >= 3 and sim.pipe.modules[0].range.start == 0
        with fake:
            sim.prime_optimizer_state()
            sim.module.step(next(sim.batches), None, sim.step)
    finally:
        dist.destroy_process_group()
    engram_layers = 2  # layers 1 and 4, both on the first stage
    assert len(rounds) == engram_layers * sim.layout.rounds and all(len(r) == n for r in rounds)
    when = dict(launches)
    for per_mb in rounds:
        assert [when[q] for q in per_mb] == [0] + list(range(n - 1))  # k's ids leave during k - 1's forward


@pytest.mark.parametrize("layout", ["flat", "rows"])
def test_the_zero1_adamw_gather_assembles_every_parameter_from_its_owners(monkeypatch, layout):
    """ShardedAdamW's all-gather, on 4 simulated ranks of one replica group: after the gather every element
    of every parameter is its owner's updated value -- parameters shorter than the group (empty pieces),
    not a multiple of it and a multiple of it; equal flat chunks (the one-copy path) and row pieces (the
    per-piece path)."""
    from flashtrain.parallel.zero import Ownership
    from flashtrain.train.optim import adamw

    size, shapes = 4, [(3,), (5, 2), (8,), (2, 6)]

    def pieces(shape):
        numel = torch.Size(shape).numel()
        return flat_pieces(numel, size) if layout == "flat" else row_pieces(shape[0], numel // shape[0], size)

    ranks = []
    for r in range(size):  # rank r's values: 100 r + the element's index (what it would hold after its step)
        params = [torch.arange(torch.Size(s).numel(), dtype=torch.float32).view(s) + 100 * r for s in shapes]
        own = {id(p): Ownership(pieces(s), r, group="g") for p, s in zip(params, shapes)}
        ranks.append((params, adamw.ShardedAdamW([{"params": params}], zero_of=lambda p, own=own: own[id(p)])))
    sends = [None] * size

    def all_gather_single(recv, send, group):  # every rank's send buffer, in rank order
        recv.view(size, -1).copy_(torch.stack(sends))

    monkeypatch.setattr(adamw.dist, "all_gather_single", all_gather_single)
    for r, (params, opt) in enumerate(ranks):  # first pass: what each rank sends
        monkeypatch.setattr(adamw.dist, "all_gather_single",
                            lambda recv, send, group, r=r: sends.__setitem__(r, send.clone()))
        opt._gather(params)
    monkeypatch.setattr(adamw.dist, "all_gather_single", all_gather_single)
    for params, opt in ranks:
        opt._gather(params)
        for p, s in zip(params, shapes):
            want = torch.tensor([100 * q.owner + i for q in pieces(s) for i in range(q.start, q.end)],
                                dtype=torch.float32)
            assert torch.equal(p.view(-1), want), (layout, s)


def test_zero_splits_each_parameter_as_its_optimizer_declares():
    """ZeRO-1 ownership over 2 ranks (parallel/dims.py `zero_plan`) by the split each optimizer declares
    (`ZERO_SPLIT`, train/optim): Sinkhorn's tables (embedding, head) in whole rows, 513 + 512 of an odd 1025;
    Muon's weights in whole matrices; AdamW's vectors in equal flat chunks of ceil(numel / 2). A fake process
    group: the plan is arithmetic on shapes (meta tensors)."""
    import math

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from flashtrain.parallel.construct import model_template
    from flashtrain.parallel.dims import ParallelDims
    from flashtrain.train.config import compose, model_config, optim_config
    from flashtrain.train.optim.routing import route_parameters, zero_inputs

    cfg = compose(["+exp=flash_tiny", "model.vocab_size=1025"])
    m = model_config(cfg)
    model = model_template(m)
    groups = route_parameters(model, m, optim_config(cfg))
    optimizer = {n: g.optimizer for g in groups for n in g.names}
    splits, matrices = zero_inputs(groups)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        plan = ParallelDims.build(2, 0, 1, 1, m.n_layers, m.n_routed_experts, zero=True).zero_plan(model, splits,
                                                                                                   matrices)
    finally:
        dist.destroy_process_group()
    assert {o: {splits[n] for n in optimizer if optimizer[n] == o} for o in ("muon", "sinkhorn", "adamw")} == \
        {"muon": {"matrices"}, "sinkhorn": {"rows"}, "adamw": {"flat"}}
    params = dict(model.named_parameters())
    table = [(p.start, p.end) for p in plan[id(params["embed.weight"])].pieces]
    assert table == [(0, 513 * m.dim), (513 * m.dim, 1025 * m.dim)]
    for n, p in params.items():
        bounds = [b for piece in plan[id(p)].pieces for b in (piece.start, piece.end)]
        if splits[n] == "matrices":
            size = matrices[n][1] * matrices[n][2]
            assert all(b % size == 0 for b in bounds), n
        elif splits[n] == "flat" and p.numel() > 1:
            assert bounds[1] == math.ceil(p.numel() / 2), n
