"""The token-based LR schedule and ViT unfreeze step (V41_SPEC §8) against hand values."""

import math

import pytest

from flashtrain.config.errors import ConfigError
from flashtrain.train.schedule import Schedule, ScheduleConfig


def small():
    cfg = ScheduleConfig(total_tokens=1000, peak_lr=1.0, final_lr=0.1, warmup_steps=5,
                         decay_start_tokens=500, decay_end_tokens=900)
    return Schedule(cfg, tokens_per_step=10)


def test_boundaries_by_hand():
    s = small()
    assert s.total_steps == 100
    assert [s.lr(i) for i in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert s.lr(49) == 1.0  # 490 tokens: still holding the peak
    assert s.lr(50) == pytest.approx(1.0)  # 500 tokens: cosine starts at the peak
    assert s.lr(70) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert s.lr(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert s.lr(89) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 390 / 400)))
    assert s.lr(90) == 0.1 and s.lr(99) == 0.1  # held to the end
    assert s.vit_unfreeze_step == 50 and not s.vit_trainable(49) and s.vit_trainable(50)


def test_fractions_scale_the_same_shape():
    a = Schedule(ScheduleConfig(total_tokens=1000, peak_lr=1.0, final_lr=0.1, warmup_steps=None, warmup_fraction=0.05,
                                decay_start_tokens=None, decay_end_tokens=None, decay_start_fraction=0.5,
                                decay_end_fraction=0.9), tokens_per_step=10)
    b = small()
    assert a.warmup_steps == 5
    assert [a.lr(i) for i in range(100)] == pytest.approx([b.lr(i) for i in range(100)])


def test_published_flash_numbers(flash_cfg):
    from flashtrain.train.config import compose, schedule

    s = schedule(compose(["+exp=flash"]))
    assert s.tokens_per_step == 1536 * 65536  # the published 100.6M tokens, rounded to 1536 sequences of 64K
    assert s.total_steps == math.ceil(45e12 / (1536 * 65536))
    assert s.lr(0) == pytest.approx(2.6e-4 / 2000) and s.lr(1999) == pytest.approx(2.6e-4)
    assert s.vit_unfreeze_step == math.ceil(28e12 / (1536 * 65536)) == 278156
    assert s.lr(s.vit_unfreeze_step) == pytest.approx(2.6e-4, rel=1e-6)
    assert s.lr(math.ceil(40e12 / (1536 * 65536))) == pytest.approx(2.6e-5)


def test_phases_out_of_order_are_rejected():
    with pytest.raises(ConfigError, match="out of order"):
        Schedule(ScheduleConfig(total_tokens=1000, warmup_steps=5, decay_start_tokens=900, decay_end_tokens=500), 10)
    with pytest.raises(ConfigError, match="decay_start_fraction"):
        Schedule(ScheduleConfig(total_tokens=1000, warmup_steps=5, decay_start_tokens=None, decay_end_tokens=500), 10)


def test_plan_reports_the_schedule():
    import json
    import sys
    from pathlib import Path

    import warm_launch

    root = Path(__file__).resolve().parent.parent
    out = warm_launch.run([sys.executable, "launch/plan.py", "+exp=flash", "--json"], cwd=root, capture_output=True,
                           text=True, timeout=300)
    sched = json.loads(out.stdout)["schedule"]
    for key in ("total_steps", "tokens_per_step", "warmup_end_step", "warmup_end_lr", "decay_start_step",
                "decay_start_lr", "decay_end_step", "decay_end_lr", "last_step", "last_lr", "vit_unfreeze_step"):
        assert key in sched
    assert sched["warmup_end_step"] == 1999 and sched["last_lr"] == pytest.approx(2.6e-5)
