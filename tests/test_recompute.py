"""train.recompute (model/recompute.py): none / selective / full give the same loss and gradients,
keep fewer bytes for backward, count the aux side channel once, and selective recomputation sends
no second expert all-to-all (the EP dispatcher runs on a one-rank gloo group in this process)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from flashtrain.model.aux import StepStats
from flashtrain.parallel.experts import shard_experts
from flashtrain.train.optim.memory import PeakTensorBytes

pytestmark = pytest.mark.xdist_group("recompute")  # its module-scoped reference runs are shared


class CountingDict(dict):
    """A side-channel dict that counts how often each key is written."""

    def __init__(self):
        super().__init__()
        self.writes: dict = {}

    def __setitem__(self, key, value):
        self.writes[key] = self.writes.get(key, 0) + 1
        super().__setitem__(key, value)


class CollectiveCount(TorchDispatchMode):
    """All-to-alls actually executed (a kept output replayed by selective recomputation is not)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def ep_group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(ep_group):
    from parity_batch import batch, tiny_model

    tokens, types, labels, images = batch()
    tokens, types, labels, images = tokens[:2], types[:2], labels[:2], images[:2]
    out = {}
    for mode in ("none", "selective", "full"):
        model = tiny_model()  # same seed each time
        shard_experts(model, 1, 0, ep_group)  # the all-to-all dispatcher, over one rank
        model.set_recompute(mode)
        stats = StepStats(balance_loss=CountingDict(), indexer_loss=CountingDict(), expert_load=CountingDict())
        with PeakTensorBytes() as mem:
            logits = model(tokens, types, images, stats)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            kept = mem.live  # what the forward leaves alive: activations kept for backward (+ logits)
        with CollectiveCount() as a2a:
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[mode] = dict(loss=loss.item(), grads=grads, stats=stats, kept=kept, a2a=a2a.n)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_same_loss_and_gradients(runs, mode):
    ref, got = runs["none"], runs[mode]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_aux_side_channel_written_once(runs, mode):
    ref, got = runs["none"]["stats"], runs[mode]["stats"]
    for field in ("balance_loss", "indexer_loss", "expert_load"):
        written = getattr(got, field).writes
        assert written and set(written.values()) == {1}, (field, written)
        for layer, v in getattr(ref, field).items():
            torch.testing.assert_close(getattr(got, field)[layer], v, rtol=1e-6, atol=0)


def test_fewer_bytes_kept_for_backward(runs):
    none, sel, full = (runs[m]["kept"] for m in ("none", "selective", "full"))
    assert full < sel < none, (none, sel, full)
    assert full < none / 4, (none, full)


def test_selective_sends_no_second_all_to_all(runs):
    n_moe = len(runs["none"]["stats"].expert_load)
    assert runs["none"]["a2a"] == 3 * n_moe  # reverse of tokens, routing weights, results
    assert runs["selective"]["a2a"] == runs["none"]["a2a"]
    assert runs["full"]["a2a"] == runs["none"]["a2a"] + 4 * n_moe  # the recomputed dispatch: counts + 3


def test_unknown_mode_is_refused_with_the_choices():
    from flashtrain.config.errors import ConfigError
    from flashtrain.parallel.config import ParallelConfig
    from flashtrain.train.build import plan_layout
    from flashtrain.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"train.recompute='sometimes': must be one of none, selective, full"):
        plan_layout(TrainConfig(global_batch_tokens=256, recompute="sometimes"), 128, 1, ParallelConfig(), 1)
