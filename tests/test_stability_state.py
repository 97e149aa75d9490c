"""What a rollback and a resume must bring back of the stability state (issue 30 item 13): the spike
detector's whole history -- the grad norms as well as the losses -- and, with a rollback snapshot, the
RNG state of the moment it was taken; and the run's spike counters (`spikes_skipped`, `rollbacks`), which
continue from the checkpoint's values (issue 47 item 5; the trainer's save and load of them:
tests/test_anticipatory.py `test_a_checkpoint_in_the_active_phase_resumes_exactly`)."""

import random

import numpy as np
import torch

from flashtrain.train.checkpoint import _blob, _unblob
from flashtrain.train.runtime.collectives import Operation
from flashtrain.train.stability.anticipatory import AnticipatoryRoutingConfig
from flashtrain.train.stability.guard import StabilityGuard
from flashtrain.train.stability.spike import Snapshots, SpikeConfig, SpikeDetector


def test_the_grad_norm_history_survives_the_checkpoint():
    cfg = SpikeConfig(action="skip", window=10, min_history=4, loss_sigmas=100.0, grad_norm_sigmas=2.0)
    d = SpikeDetector(cfg)
    for norm in (1.0, 2.0, 3.0, 4.0):
        d.accept(1.0, norm)
    e = SpikeDetector(cfg)
    e.load_state_dict(d.state_dict())
    assert list(e.grad_norms) == [1.0, 2.0, 3.0, 4.0]
    # by hand: mean 2.5, std sqrt(1.25) = 1.118; threshold 2.5 + max(2 x 1.118, 0.05 x 2.5) = 4.736
    assert e.reason(1.0, 5.0) is not None and "grad norm 5" in e.reason(1.0, 5.0)
    assert e.reason(1.0, 4.7) is None


def test_a_rollback_snapshot_restores_the_rng_state():
    model = torch.nn.Linear(3, 2)
    snaps = Snapshots(SpikeConfig(action="rollback", rollback_steps=1, snapshot_interval=1))
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    snaps.take(3, 300, model, {})
    after_take = (torch.rand(4), random.random(), np.random.rand())  # what the next step would draw
    torch.rand(100), random.random(), np.random.rand(7)  # the steps that get rolled back draw more
    Snapshots.restore(snaps.target(4), model, {})
    again = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(after_take[0], again[0]) and after_take[1:] == again[1:]


def guard(action: str) -> StabilityGuard:
    cfg = SpikeConfig(action=action, rollback_steps=1, snapshot_interval=1, max_rollbacks=5)
    return StabilityGuard(cfg, AnticipatoryRoutingConfig(delta_steps=1, active_steps=2), torch.nn.Linear(3, 2), {},
                          torch.device("cpu"), Operation(), is_main=False)


def spiked(g: StabilityGuard, step: int):
    """A step the verdict judged a spike (as `verdict` leaves it), then the guard's after-step."""
    g.spike = "loss 9 above the threshold"
    record = {"loss": 9.0, "grad_norm": 1.0}
    return g.after_step(step, 100 * step, record), record


def normal(g: StabilityGuard, step: int) -> None:
    g.spike = None
    assert g.after_step(step, 100 * step, {}) is None


def test_skipped_spikes_count_on_from_the_checkpoint():
    """2 spikes skipped before the save; resumed, the next spike's record says 3."""
    a = guard("skip")
    normal(a, 1)
    for step in (2, 4):
        spiked(a, step)
    normal(a, 5)
    assert a.counts == {"skipped": 2, "rolled_back": 0}
    b = guard("skip")
    b.load_state_dict(_unblob(_blob(a.state_dict())), None)  # as the checkpoint writes and reads it
    assert b.counts == {"skipped": 2, "rolled_back": 0}
    normal(b, 6)
    _, record = spiked(b, 7)
    assert record["spikes_skipped"] == 3 and b.counts == {"skipped": 3, "rolled_back": 0}


def test_rollbacks_count_on_from_the_checkpoint():
    """A rollback before the save (spike at 2, back to the snapshot of step 1: one step undone); resumed at
    step 3, the next spike (at 5, back to 4) is rollback 2, and the wandb axis counts both undone steps."""
    a = guard("rollback")
    a.start(0, 0)
    normal(a, 1)
    back, _ = spiked(a, 2)
    assert (back.step, back.event["rollbacks"], back.wandb_step) == (1, 1, 2)
    for step in (2, 3):
        normal(a, step)
    b = guard("rollback")
    b.load_state_dict(_unblob(_blob(a.state_dict())), None)
    assert b.counts == {"skipped": 0, "rolled_back": 1} and b.rolled_back_steps == 1
    b.start(3, 300)  # the trainer's start after a resume: a rollback point at the checkpoint's step
    normal(b, 4)
    back, _ = spiked(b, 5)
    assert (back.step, back.event["rollbacks"], back.wandb_step) == (4, 2, 5 + 1)
    assert b.counts == {"skipped": 0, "rolled_back": 2} and b.rolled_back_steps == 2
