"""Gradient clipping (parallel/clipping.py) against hand-computed norms: gradients above train.grad_clip
are scaled to it, gradients below are left bit for bit; under pipeline and expert parallelism the
norm adds the other stages' and the other expert shards' squares (2 processes, gloo)."""

import os
import sys
from pathlib import Path

import pytest
import torch
import warm_launch

from flashtrain.parallel.clipping import CLIP_EPS, clip_grad_norm_

ROOT = Path(__file__).resolve().parent.parent


def _grads():
    # squared norms 25 + 144 = 169: global norm 13
    return [("layers.0.attn.wq_a.weight", torch.tensor([[3.0, 0.0], [0.0, -4.0]])),
            ("layers.0.ffn.experts.w1", torch.tensor([[[12.0]]]))]


@pytest.mark.parametrize("max_norm", [6.5, 1.0, 12.99])
def test_above_the_clip_scales_to_it(max_norm):
    named = _grads()
    before = [g.clone() for _, g in named]
    norm = clip_grad_norm_(named, max_norm, torch.device("cpu"))
    assert norm == pytest.approx(13.0, rel=1e-7)
    coef = max_norm / (13.0 + CLIP_EPS)
    for (_, g), g0 in zip(named, before):
        torch.testing.assert_close(g, g0 * coef, rtol=1e-6, atol=0)
    after = torch.cat([g.flatten() for _, g in named]).norm().item()
    assert after == pytest.approx(max_norm, rel=1e-6)


@pytest.mark.parametrize("max_norm", [13.5, 1e3])
def test_below_the_clip_is_left_unchanged(max_norm):
    named = _grads()
    before = [g.clone() for _, g in named]
    assert clip_grad_norm_(named, max_norm, torch.device("cpu")).item() == pytest.approx(13.0, rel=1e-7)
    assert all(torch.equal(g, g0) for (_, g), g0 in zip(named, before))  # not scaled up towards the clip


def test_norm_sums_over_stages_and_expert_shards_two_processes():
    """Rank r holds dense gradient [3 + r, 4] (squares 25 / 32) and expert gradient [[2 r + 1]] (1 / 9).
    As pipeline stages (each rank its own parameters): norm^2 = 25 + 1 + 32 + 9 = 67. Under expert
    parallelism with replicated dense gradients (both ranks hold [3, 4]) and sharded experts:
    norm^2 = 25 + 1 + 9 = 35. Clipped to 2 on every rank."""
    script = r'''
import math
import torch
import torch.distributed as dist
from flashtrain.parallel.clipping import CLIP_EPS, clip_grad_norm_

dist.init_process_group("gloo")
r = dist.get_rank()
is_expert = lambda n: ".experts." in n
cpu = torch.device("cpu")
for kind, dense, want in (("pp", [3.0 + r, 4.0], 67.0), ("ep", [3.0, 4.0], 35.0)):
    named = [("layers.0.attn.wkv.weight", torch.tensor(dense)),
             ("layers.0.ffn.experts.w2", torch.tensor([[2.0 * r + 1]]))]
    before = [g.clone() for _, g in named]
    groups = (dict(shard_group_of=lambda n: dist.group.WORLD if is_expert(n) else None) if kind == "ep"
              else dict(stage_group=dist.group.WORLD))
    norm = clip_grad_norm_(named, 2.0, cpu, **groups)
    assert abs(norm - math.sqrt(want)) < 1e-5, (kind, r, norm, want)
    coef = 2.0 / (math.sqrt(want) + CLIP_EPS)
    for (_, g), g0 in zip(named, before):
        assert torch.allclose(g, g0 * coef, rtol=1e-6, atol=0), (kind, r, g, g0 * coef)
    # below the clip: the same norm, nothing changes
    named = [(n, g0.clone()) for (n, _), g0 in zip(named, before)]
    assert abs(clip_grad_norm_(named, 100.0, cpu, **groups).item() - math.sqrt(want)) < 1e-5
    assert all(torch.equal(g, g0) for (_, g), g0 in zip(named, before))
print(f"rank {r}: clip ok", flush=True)
dist.destroy_process_group()
'''
    out = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "--no-python", sys.executable, "-c", script], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "rank 0: clip ok" in out.stdout and "rank 1: clip ok" in out.stdout
