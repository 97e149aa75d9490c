"""What a rollback and a resume must bring back of the stability state (issue 30 item 13): the spike
detector's whole history -- the grad norms as well as the losses -- and, with a rollback snapshot, the
RNG state of the moment it was taken."""

import random

import numpy as np
import torch

from flashtrain.train.spike import Snapshots, SpikeConfig, SpikeDetector


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
