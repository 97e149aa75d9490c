"""Anticipatory Routing (train/stability/anticipatory.py, V41_SPEC §9): with delta_steps=0 training is unchanged;
with delta_steps > 0 the indices every MoE gate uses at step t are those the parameters of step t - Δt
pick for step t's batch (recomputed here from parameters copied at that step), on 1 process and on pp=2
and ep=2; the look-ahead buffer and the cached indices survive a checkpoint exactly."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import warm_launch
from layer_plans import FOUR_LAYERS

from flashtrain.model.moe import Gate
from flashtrain.train.config import compose
from flashtrain.train.trainer import Trainer

pytestmark = pytest.mark.xdist_group("anticipatory")  # its module-scoped reference runs are shared

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return tmp_path_factory.mktemp("ar_corpus")


def trainer(run_dir, corpus, *extra, steps=4):
    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, f"data.corpus_dir={corpus}", "data.corpus_text_bytes=300000",
                   "data.corpus_mm_docs=100", "data.corpus_shards=2", "train.global_batch_tokens=512",
                   "data.batch_size=1", "logging.wandb.mode=disabled", "logging.progress=false", "run_name=ar",
                   f"train.max_steps={steps}", *extra])
    return Trainer(cfg, run_dir)


def losses(run_dir):
    return [r["loss"] for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())]


def finish(t):
    t.fit()
    t.run.release()  # the next trainer in this process may take the run directory


class Spy:
    """Per step: the parameters at its start, its micro-batches, and the indices each gate used in the
    training forward (not the anticipatory no-grad one)."""

    def __init__(self, t, monkeypatch):
        self.params, self.batches, self.used = [], [], []
        original_gate, original_step, original_run = Gate.forward, t.train_step, t.module.runner.run

        def gate(module, x, image_mask, indices=None):
            out = original_gate(module, x, image_mask, indices)
            if torch.is_grad_enabled():
                self.used[-1].append(out[2].clone())
            return out

        def train_step():
            self.params.append(copy.deepcopy(t.module.model.state_dict()))
            self.used.append([])
            return original_step()

        def run(batches, routes=None):
            self.batches.append(batches)
            return original_run(batches, routes)

        monkeypatch.setattr(Gate, "forward", gate)
        monkeypatch.setattr(t, "train_step", train_step)
        monkeypatch.setattr(t.module.runner, "run", run)

    def recomputed(self, model, step, params_step):
        """The indices the parameters at the start of `params_step` pick for `step`'s micro-batches."""
        model.load_state_dict(self.params[params_step - 1])
        out = []
        with torch.no_grad():
            for b in self.batches[step - 1]:
                rec = {}
                model.run(b["tokens"], b["token_types"], b["images"], recorded=rec)
                out += [rec[k] for k in sorted(rec)]
        return out


def same(a, b):
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
def test_delta_zero_is_normal_training(tmp_path, corpus):
    finish(trainer(tmp_path / "normal", corpus))
    t = trainer(tmp_path / "ar0", corpus, "train.anticipatory_routing.delta_steps=0")
    t.module.guard.routing.activate(0)
    finish(t)
    records = [json.loads(line) for line in (tmp_path / "ar0" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["anticipatory_routing"] for r in records)
    assert losses(tmp_path / "ar0") == losses(tmp_path / "normal")


@pytest.mark.slow
def test_indices_come_from_the_parameters_delta_steps_earlier(tmp_path, corpus, monkeypatch):
    t = trainer(tmp_path / "ar2", corpus, "train.anticipatory_routing.delta_steps=2",
                "train.anticipatory_routing.active_steps=4", steps=5)
    t.module.guard.routing.activate(0)
    spy = Spy(t, monkeypatch)
    model = t.module.model
    t.fit()
    assert [len(b) for b in spy.batches] == [4] * 5
    for step in (1, 2, 3, 4):  # steps 1, 2: the parameters at activation (step 1); then step t - 2
        src = max(step - 2, 1)
        assert same(spy.recomputed(model, step, src), spy.used[step - 1]), step
        if src != step:  # and the parameters of the step itself would have routed differently
            assert not same(spy.recomputed(model, step, step), spy.used[step - 1]), step
    assert same(spy.recomputed(model, 5, 5), spy.used[4])  # active_steps over: normal routing again
    records = [json.loads(line) for line in (tmp_path / "ar2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["anticipatory_routing"] for r in records] == [True] * 4 + [False]


@pytest.fixture(scope="module")
def one_process_delta_one(tmp_path_factory, corpus):
    """The 2-process layouts' run in one process: delta_steps=1 from step 1, 3 steps; (records, biases)."""
    run = tmp_path_factory.mktemp("ar_one_process")
    t = trainer(run, corpus, "train.anticipatory_routing.delta_steps=1", steps=3)
    t.module.guard.routing.activate(0)
    finish(t)
    biases = {k: v.clone() for k, v in t.module.model.state_dict().items() if k.endswith(("gate.bias", "gate.bias_vl"))}
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()], biases


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp", "ep"])
def test_pipeline_and_expert_parallel_route_by_the_earlier_parameters(tmp_path, corpus, layout, request):
    """Each rank's gates route by the indices of the parameters one step earlier; with pp (one reader,
    as one process) the step's losses, aux values, expert loads and the MoE biases they update equal one
    process's (the loads and biases exactly: the same indices are counted; the losses to rounding)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "anticipatory_routing.py"), str(tmp_path), str(corpus), layout]
    run = warm_launch.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"{layout}.rank{r}.pt") for r in (0, 1)]
    for r in ranks:
        assert r["same_as_earlier"] == [True, True, True], (layout, r)
        assert r["same_as_own"] == [True, False, False], (layout, r)  # step 1: activation, its own parameters
    if layout == "pp":  # each stage routes its own layers: 1 MoE layer on stage 0, 3 on stage 1, 4 micro-batches
        assert [ranks[0]["calls"][0], ranks[1]["calls"][0]] == [4, 12]
    else:  # ep: every rank routes its own tokens through all 4 layers, 2 micro-batches each
        assert [r["calls"][0] for r in ranks] == [8, 8]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    if layout != "pp":
        return
    ref, ref_biases = request.getfixturevalue("one_process_delta_one")
    got = [json.loads(json.dumps(r), parse_constant=lambda c: None) for r in ranks[0]["records"]]  # NaN as null
    assert [r["step"] for r in got] == [1, 2, 3] and all(r["anticipatory_routing"] for r in got)
    for x, y in zip(ref, got):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6)
        assert y["balance_loss"] == pytest.approx(x["balance_loss"], rel=1e-5)
        assert y["indexer_loss"] == pytest.approx(x["indexer_loss"], rel=1e-4, abs=1e-7)
        assert y["expert_load"] == x["expert_load"]
    biases = {**ranks[0]["biases"], **ranks[1]["biases"]}
    assert biases.keys() == ref_biases.keys()
    assert all(torch.equal(biases[k], ref_biases[k]) for k in ref_biases)
    assert any(v.abs().sum() > 0 for v in ref_biases.values())  # the biases did move


@pytest.mark.slow
def test_a_checkpoint_in_the_active_phase_resumes_exactly(tmp_path, corpus):
    """Stopped at step 3 with steps 4 and 5 read ahead and routed by step 2's and 3's parameters: the
    resumed run trains steps 4-6 on the same batches with the same routing as the uninterrupted one. The
    run's spike counters (set by hand before the save: 2 skipped, 1 rollback) continue from the
    checkpoint's values in the resumed trainer and its records (the guard's own round trip and the next
    spike's count: tests/test_stability_state.py)."""
    ar = ["train.anticipatory_routing.delta_steps=2", "train.anticipatory_routing.active_steps=10"]
    straight = trainer(tmp_path / "straight", corpus, *ar, steps=6)
    straight.module.guard.routing.activate(0)
    finish(straight)
    first = trainer(tmp_path / "split", corpus, *ar, steps=3)
    first.module.guard.routing.activate(0)
    first.module.guard.counts = {"skipped": 2, "rolled_back": 1}
    finish(first)
    ckpt = tmp_path / "split" / "checkpoints" / "step_00000003"
    assert (ckpt / "__0_0.distcp").is_file()
    resumed = trainer(tmp_path / "split", corpus, *ar, steps=6)
    ahead = resumed.module.guard.routing.ahead
    assert resumed.step == 3 and len(ahead) == 2 and all(r is not None for _, r in ahead)
    assert resumed.module.guard.counts == {"skipped": 2, "rolled_back": 1}
    finish(resumed)
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")
    records = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["spikes_skipped"], r["rollbacks"]) for r in records if "event" not in r][3:] == [
        (4, 2, 1), (5, 2, 1), (6, 2, 1)]


def test_a_second_spike_while_active_drops_the_cached_routes():
    """A rollback while Anticipatory Routing is already active (a second spike) re-activates it: the
    look-ahead batches keep their place in the data stream, but every cached route was computed with
    parameters the rollback undid, so each is recomputed with the restored ones before it is used.
    Batches are integers and a route is (batch, parameter version) here, the expectation by hand."""
    from flashtrain.train.stability.anticipatory import AnticipatoryRouting, AnticipatoryRoutingConfig

    stream = iter(range(1, 100))
    version = ["v0"]
    recorded: list = []

    def record(batch):
        recorded.append((batch, version[0]))
        return (batch, version[0])

    ar = AnticipatoryRouting(AnticipatoryRoutingConfig(delta_steps=2, active_steps=10))
    ar.activate(0)  # the first spike: rolled back to step 0
    assert ar.next_step(1, lambda: next(stream), record) == (1, (1, "v0"))  # steps 1-3 read ahead
    version[0] = "v1"  # step 1's update
    assert ar.next_step(2, lambda: next(stream), record) == (2, (2, "v0"))  # step 4 read ahead with v1
    version[0] = "v2"
    assert ar.next_step(3, lambda: next(stream), record) == (3, (3, "v0"))  # step 5 read ahead with v2
    assert recorded == [(1, "v0"), (2, "v0"), (3, "v0"), (4, "v1"), (5, "v2")]
    # step 3 spikes again: back to the snapshot of step 1 (parameters "s1"); the data continues with 4
    version[0] = "s1"
    ar.activate(1)
    assert ar.active_until == 11
    recorded.clear()
    assert ar.next_step(2, lambda: next(stream), record) == (4, (4, "s1"))
    assert recorded == [(4, "s1"), (5, "s1"), (6, "s1")]  # nothing routed by v1 / v2 survives


@pytest.mark.slow
def test_the_pipeline_route_recording_keeps_no_statistics():
    """`Pipeline.record_round` (the anticipatory forward of a future step) records routing indices and
    leaves the step's statistics (expert loads, aux sums) as they were, whenever it runs: a pipeline
    stage simulated on fake tensors and a fake process group, recording after a step has filled them."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from flashtrain.train.plan.estimate import SimulatedRank

    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, "parallel.pp=2", "data.batch_size=1"])
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        sim = SimulatedRank(cfg, 2, 1, "cpu", fake)
        stats = sim.pipe.stats
        with fake:
            batches = next(sim.batches)
            sim.module.step(batches, None, sim.step)
            before = (dict(stats.expert_load), stats.balance, stats.indexer)
            routes = sim.runner.record_routes(batches)
        assert len(routes) == len(batches) and all(sorted(r) == [1, 2, 3] for r in routes)  # stage 1's MoE layers
        assert sorted(before[0]) == [1, 2, 3]
        after = (stats.expert_load, stats.balance, stats.indexer)
        assert after[0].keys() == before[0].keys() and all(after[0][k] is before[0][k] for k in before[0])
        assert after[1] is before[1] and after[2] is before[2]
    finally:
        dist.destroy_process_group()
