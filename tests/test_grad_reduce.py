"""Gradient buckets (parallel/grad_reduce.py): every gradient is divided by the dp size, including the
buckets that have no replica group to all-reduce over (routed experts with ep = dp, row-sharded Engram
tables), whose owner already holds the whole group's sum."""

import copy

import pytest
import torch
from layer_plans import FOUR_LAYERS

from flashtrain.parallel.grad_reduce import GradReducer


@pytest.mark.parametrize("overlap", [True, False])
def test_buckets_without_a_group_are_divided_by_dp(overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    x = torch.randn(7, 5)
    dp = 4
    # small buckets, so that the parameters spread over several
    red = GradReducer(list(model.named_parameters()), lambda name: None, dp, bucket_bytes=64)
    red.zero_grad()
    if overlap:
        red.mark_final()
    model(x).square().sum().backward()
    red.finish()
    ref(x).square().sum().backward()
    assert len(red.buckets) > 1
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad / dp, rtol=1e-6, atol=0, msg=name)
    assert red.launches == (len(red.buckets) if overlap else 0)




@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 3])  # stage 0 of dp rank 0, stage 1 of dp rank 1
def test_a_pipeline_stage_starts_the_reduction_only_in_the_steps_last_backward(monkeypatch, rank):
    """pp=2 x dp=2, two rounds of two micro-batches: the gradients of a stage are complete only after
    its last backward of the step's last round, so no bucket may start before that backward (a bucket
    started earlier would all-reduce a partial sum); in that backward every bucket of the stage's
    parameters starts. Each stage (1F1B) simulated on fake tensors and a fake process group, through
    the trainer's own step runner; the launches are counted around every backward the schedule calls.
    Text batches, no vision path (a parameter that gets no gradient holds its bucket until `finish`)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import flashtrain.train.plan.estimate as estimate
    from flashtrain.train.config import compose

    monkeypatch.setattr(estimate, "_peak_preserving_microbatches", lambda *a: {})  # every micro-batch
    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, "model.vision_n_layers=0", "parallel.pp=2",
                   "parallel.microbatches=2", "train.global_batch_tokens=1024", "data.batch_size=1"])
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        sim = estimate.SimulatedRank(cfg, 4, rank, "cpu", fake)
        assert (sim.dims.dp, sim.layout.rounds, sim.layout.round_microbatches) == (2, 2, 2)
        stage, reducer = sim.pipe.schedule._stage, sim.runner.reducer
        assert stage.stage_index == sim.dims.pp_rank == (0 if rank == 0 else 1)
        launches = []  # per backward call: buckets started during it
        backward = stage.backward_one_chunk

        def counted(*args, **kwargs):
            before = reducer.launches
            out = backward(*args, **kwargs)
            launches.append(reducer.launches - before)
            return out

        stage.backward_one_chunk = counted
        with fake:
            sim.module.step(next(sim.batches), None, sim.step)
        reduced = [b for b in reducer.buckets if b.group is not None]
        assert len(launches) == 4 and len(reduced) > 1
        assert launches == [0, 0, 0, len(reducer.buckets)], launches
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_without_a_pipeline_every_bucket_starts_during_the_last_micro_batch(monkeypatch):
    """dp=2, four micro-batches, one process simulated (fake tensors, fake process group) through the
    local step runner: no bucket starts before the last micro-batch, and every bucket starts while it
    runs -- the head's gradient completes in its loss forward (train/loss.py back-propagates the head
    tile by tile), the others in its backward -- none is left to `finish`."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import flashtrain.train.plan.estimate as estimate
    from flashtrain.train.config import compose

    monkeypatch.setattr(estimate, "_peak_preserving_microbatches", lambda *a: {})
    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, "model.vision_n_layers=0", "train.global_batch_tokens=1024",
                   "data.batch_size=1", "parallel.grad_bucket_mb=0.01"])
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        sim = estimate.SimulatedRank(cfg, 2, 1, "cpu", fake)
        assert (sim.dims.dp, sim.layout.accumulation) == (2, 4)
        reducer, run = sim.runner.reducer, sim.model.run
        started = []  # buckets started before each micro-batch

        def counted(*args, **kwargs):
            started.append(reducer.launches)
            return run(*args, **kwargs)

        monkeypatch.setattr(sim.model, "run", counted)
        with fake:
            sim.module.step(next(sim.batches), None, sim.step)
        assert len(reducer.buckets) > 2
        assert started == [0, 0, 0, 0] and reducer.launches == len(reducer.buckets), (started, reducer.launches)
    finally:
        dist.destroy_process_group()
