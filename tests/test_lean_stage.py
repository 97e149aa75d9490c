
"""parallel/lean_stage.py: a pipeline stage holds receive buffers only for the micro-batch being
received and consumed, and gives up the storage of the residual it sends. Simulated on fake tensors
with a fake process group for the middle stage of pp=3 (it both receives and sends), through the
trainer's own step, on the 8-layer plan of flash_tiny (tests/layer_plans.py). (That the lean stage
computes the same gradients is the pipeline parity tests' job: tests/test_trainer.py runs every
schedule against the single process.)"""

import pytest
import torch
import torch.distributed as dist
from layer_plans import EIGHT_LAYERS

from flashtrain.train.config import compose


@pytest.mark.slow
def test_middle_stage_holds_only_the_boundary_tensors_in_use():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from flashtrain.train.plan.estimate import SimulatedRank

    cfg = compose(["+exp=flash_tiny", *EIGHT_LAYERS, "parallel.pp=3", "data.batch_size=1"])
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        sim = SimulatedRank(cfg, 3, 1, "cpu", fake)
        stage = sim.pipe.schedule._stage
        assert not stage.is_first and not stage.is_last
        n_micro = sim.layout.round_microbatches
        assert n_micro >= 3  # more micro-batches than the stage ever holds buffers for
        h = [s.name for s in stage.submod.out_specs].index("h")
        assert stage.release_outputs == (h,)
        held, released = [], []

        def chunks_with_buffers(infos_by_chunk):
            return sum(any(i.buffer is not None for i in infos if not i.is_root_arg)
                       for infos in infos_by_chunk.values())

        def watch(name, after=None):
            original = getattr(stage, name)

            def wrapped(chunk, *args, **kwargs):
                out = original(chunk, *args, **kwargs)
                held.append((chunks_with_buffers(stage.args_recv_info), chunks_with_buffers(stage.grad_recv_info)))
                if after:
                    after(chunk)
                return out

            setattr(stage, name, wrapped)

        def check_released(chunk):
            t = stage.fwd_cache[chunk][0][h]
            released.append((t.untyped_storage().nbytes(), t.shape == stage._stage_meta.outputs[h].shape,
                              t.grad_fn is not None))

        for name in ("get_fwd_recv_ops", "get_bwd_recv_ops", "forward_one_chunk", "backward_one_chunk"):
            watch(name)
        watch("get_fwd_send_ops", check_released)
        with fake:
            sim.prime_optimizer_state()
            sim.module.step(next(sim.batches), None, sim.step)
        # at most one micro-batch's input buffer and one's output-gradient buffer exist at a time
        # (torch's PipelineStage allocates all n_micro of each when the schedule starts and keeps them)
        assert held and max(f for f, _ in held) == 1 and max(g for _, g in held) == 1, held
        assert held[-1] == (0, 0)  # nothing held once the step is over
        # every sent residual gave its storage up and kept its shape and autograd node for backward
        assert len(released) == n_micro
        assert all(n <= torch.finfo(torch.float32).bits // 8 and same and graph for n, same, graph in released)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_last_stage_frees_each_micro_batch_after_its_backward(monkeypatch):
    """The schedule keeps every micro-batch's loss until the round ends; a loss still attached to its
    graph would keep the graph's leaves -- the stage's received inputs -- alive, M x the input carry.
    Simulated for the last stage of pp=2 with all its micro-batches (not the estimator's shortened
    round), without the estimator's memory tracker (the real step)."""
    import gc
    import weakref

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import flashtrain.train.plan.estimate as estimate

    monkeypatch.setattr(estimate, "_peak_preserving_microbatches", lambda *a: {})
    cfg = compose(["+exp=flash_tiny", *EIGHT_LAYERS, "parallel.pp=2", "data.batch_size=1"])
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        sim = estimate.SimulatedRank(cfg, 2, 1, "cpu", fake)
        stage = sim.pipe.schedule._stage
        assert stage.is_last and sim.layout.round_microbatches >= 4
        inputs, done, stale = {}, set(), []
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def watched_forward(chunk, *args, **kwargs):
            gc.collect()  # received inputs of finished micro-batches still alive (the schedule's
            stale.append(sum(any(r() is not None for r in inputs[c]) for c in done))  # last `output`: <= 1)
            out = forward(chunk, *args, **kwargs)
            inputs[chunk] = [weakref.ref(t) for t in stage.fwd_cache[chunk][1] if isinstance(t, torch.Tensor)]
            return out

        def watched_backward(chunk, *args, **kwargs):
            out = backward(chunk, *args, **kwargs)
            done.add(chunk)
            return out

        stage.forward_one_chunk, stage.backward_one_chunk = watched_forward, watched_backward
        with fake:
            sim.prime_optimizer_state()
            sim.module.step(next(sim.batches), None, sim.step)
        assert len(stale) == sim.layout.round_microbatches * sim.layout.rounds
        assert max(stale) <= 1, stale
    finally:
        dist.destroy_process_group()
