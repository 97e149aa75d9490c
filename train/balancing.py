"""Auxiliary-loss-free MoE balancing per modality (V41_SPEC §4; report §2.1.1, DeepSeek-V3's rule).

After every optimizer step, for every MoE layer and separately for text (`bias`) and image (`bias_vl`)
tokens, with that modality's per-expert load counted over the whole global batch (all data-parallel
ranks, all micro-batches):
    b_i <- b_i + rate * sign(mean(load) - load_i)
A modality with no token in the step leaves its bias unchanged. We follow Megatron-LM and do not
re-centre the update (torchtitan subtracts its mean; that changes no selection, only the biases' drift).

Loads come from the model's side channel (`StepStats.expert_load`, [2, E] per layer: text, image),
summed by the trainer over micro-batches (and, with a pipeline, by each stage over its own layers);
`global_loads` all-reduces them in one collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from flashtrain.model.simulation import simulated


def accumulate_loads(total: dict[int, torch.Tensor], step_loads: dict[int, torch.Tensor]) -> None:
    """Add one micro-batch's loads (layer -> [2, E]) into a running total."""
    for layer, load in step_loads.items():
        total[layer] = total[layer] + load if layer in total else load.clone()


def global_loads(loads: dict[int, torch.Tensor], n_layers: int, n_experts: int, group=None,
                 device: torch.device | None = None) -> dict[int, torch.Tensor]:
    """Sum the loads over `group` (default: every rank) in one all-reduce for all layers.

    With pipeline stages each rank holds the loads of its own layers only, so the sum runs over a
    dense [n_layers, 2, n_experts] tensor (plus a column marking the layers someone reported) and
    every rank ends with every layer's global load (what the metrics report; each rank updates the
    biases it owns). The sum runs on `device` (NCCL reduces device tensors only); the result is on
    the CPU."""
    if not (dist.is_available() and dist.is_initialized()):
        return {layer: load.cpu() for layer, load in loads.items()}
    device = device or (next(iter(loads.values())).device if loads else torch.device("cpu"))
    dense = torch.zeros(n_layers, 2 * n_experts + 1, dtype=torch.long, device=device)  # last column: present
    for layer, load in loads.items():
        dense[layer, :-1] = load.reshape(-1)
        dense[layer, -1] = 1
    dist.all_reduce(dense, group=group)
    dense = dense.cpu()  # the one device-to-host copy of the step's loads
    present = range(n_layers) if simulated(dense) else [l for l in range(n_layers) if dense[l, -1]]  # fake: no values
    return {l: dense[l, :-1].reshape(2, n_experts) for l in present}


@torch.no_grad()
def update_biases(model: nn.Module, loads: dict[int, torch.Tensor], rate: float) -> int:
    """Apply the sign rule to every MoE layer's `bias` (row 0 loads) and `bias_vl` (row 1 loads).
    Returns the number of (layer, modality) biases changed."""
    changed = 0
    drafter = getattr(model, "moe_layers", None)  # the DSpark drafter (model/dspark.py): its own MoE layer ids
    for layer, load in loads.items():
        ffn = drafter.get(layer) if drafter is not None else getattr(model.layers[layer], "ffn", None)
        if ffn is None:
            continue  # another pipeline stage owns this layer (and applies the same update)
        gate = ffn.gate
        for bias, counts in ((gate.bias, load[0]), (gate.bias_vl, load[1])):
            counts = counts.to(bias.device, torch.float32)
            if not simulated(counts) and counts.sum() == 0:
                continue  # this modality was absent from the step (the rule would change nothing either)
            bias += rate * torch.sign(counts.mean() - counts)
            changed += 1
    return changed
