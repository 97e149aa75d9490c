
"""The per-modality bias rule (V41_SPEC §4) against hand values, and its distributed reduction."""

import os
import sys
from pathlib import Path

import pytest
import torch
import warm_launch

from flashtrain.train.balancing import accumulate_loads, update_biases


def test_sign_rule_by_hand_with_an_absent_modality(tiny_model, tiny_cfg):
    E = tiny_cfg.n_routed_experts
    assert E == 8
    gate = tiny_model.layers[3].ffn.gate
    gate.bias.copy_(torch.arange(E, dtype=torch.float32) * 0.01)
    before_vl = gate.bias_vl.clone()
    text = torch.tensor([10, 0, 4, 2, 2, 6, 0, 8])  # mean 4: over -> down, under -> up, equal -> unchanged
    loads = {3: torch.stack([text, torch.zeros(E, dtype=torch.long)])}  # no image token this step
    assert update_biases(tiny_model, loads, rate=0.001) == 2  # both rows: the absent one's signs are all 0
    want = torch.arange(E, dtype=torch.float32) * 0.01 + 0.001 * torch.tensor([-1, 1, 0, 1, 1, -1, 1, -1.0])
    torch.testing.assert_close(gate.bias, want)
    torch.testing.assert_close(gate.bias_vl, before_vl)  # absent modality: unchanged


def test_image_loads_move_only_bias_vl(tiny_model):
    gate = tiny_model.layers[0].ffn.gate
    before = gate.bias.clone()
    image = torch.tensor([0, 0, 0, 0, 0, 0, 0, 16])
    update_biases(tiny_model, {0: torch.stack([torch.zeros(8, dtype=torch.long), image])}, rate=0.5)
    torch.testing.assert_close(gate.bias, before)
    torch.testing.assert_close(gate.bias_vl, torch.tensor([0.5] * 7 + [-0.5]))


def test_micro_batch_loads_are_summed_before_the_rule():
    total = {}
    accumulate_loads(total, {1: torch.tensor([[1, 0], [0, 0]])})
    accumulate_loads(total, {1: torch.tensor([[0, 3], [2, 0]])})
    assert total[1].tolist() == [[1, 3], [2, 0]]


@pytest.mark.slow
def test_global_loads_sum_over_ranks():
    """Two gloo ranks with different local loads both see the sum."""
    script = r'''
import torch, torch.distributed as dist
from flashtrain.train.balancing import global_loads
dist.init_process_group("gloo")
r = dist.get_rank()
loads = {2: torch.tensor([[r + 1, 0], [0, 5 * r]]), 7: torch.tensor([[3, 3], [r, r]])}
out = global_loads(loads, n_layers=8, n_experts=2)
assert out[2].tolist() == [[3, 0], [0, 5]], out
assert out[7].tolist() == [[6, 6], [1, 1]], out
# pipeline: rank 0 owns layers 0-1, rank 1 owns layer 3 (of 4); everyone gets every owned layer's sum
staged = ({0: torch.tensor([[1, 2], [0, 0]]), 1: torch.tensor([[4, 0], [1, 1]])} if r == 0
          else {3: torch.tensor([[0, 9], [2, 0]])})
out = global_loads(staged, n_layers=4, n_experts=2)
assert sorted(out) == [0, 1, 2, 3], out  # every layer; one nobody reported has zero loads
assert out[1].tolist() == [[4, 0], [1, 1]] and out[3].tolist() == [[0, 9], [2, 0]], out
assert out[2].tolist() == [[0, 0], [0, 0]], out
dist.destroy_process_group()
'''
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "--no-python", sys.executable, "-c", script], cwd=root, env=env,
                           capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
