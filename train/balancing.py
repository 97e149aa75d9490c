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


def accumulate_loads(total: dict[int, torch.Tensor], step_loads: dict[int, torch.Tensor]) -> None:
    """Add one micro-batch's loads (layer -> [2, E]) into a running total."""
    for layer, load in step_loads.items():
        total[layer] = total[layer] + load if layer in total else load.clone()


def global_loads(loads: dict[int, torch.Tensor], n_layers: int, n_experts: int, group=None,
                 device: torch.device | None = None, first: int = 0) -> dict[int, torch.Tensor]:
    """Sum the loads over `group` (default: every rank) in one all-reduce for all layers, on the device
    (no host read: the statistics are read with the step's values, train/step_values.py `read`).

    With pipeline stages each rank holds the loads of its own layers only, so the sum runs over a
    dense [n_layers, 2, n_experts] tensor and every rank ends with every layer's global load (what the
    metrics report; each rank updates the biases it owns); a layer no rank reported has zero loads
    (the bias rule leaves it as it is, its statistics are null). The sum runs on `device` (NCCL reduces
    device tensors only). The MoE layers are the ids `first` .. `n_layers` - 1 (the DSpark stage's are the
    drafter's, numbered after the backbone's)."""
    if not (dist.is_available() and dist.is_initialized()):
        return dict(loads)
    device = device or (next(iter(loads.values())).device if loads else torch.device("cpu"))
    dense = torch.zeros(n_layers - first, 2 * n_experts, dtype=torch.long, device=device)
    for layer, load in loads.items():
        dense[layer - first] = load.reshape(-1)
    dist.all_reduce(dense, group=group)
    return {l: dense[l - first].reshape(2, n_experts) for l in range(first, n_layers)}


@torch.no_grad()
def update_biases(model: nn.Module, loads: dict[int, torch.Tensor], rate: float) -> int:
    """Apply the sign rule to every MoE layer's `bias` (row 0 loads) and `bias_vl` (row 1 loads), on the
    device (no host read). A modality absent from the step (all counts 0) leaves its bias as it is: every
    count equals the mean, so every sign is 0. Returns the number of (layer, modality) biases updated."""
    updated = 0
    drafter = getattr(model, "moe_layers", None)  # the DSpark drafter (model/dspark.py): its own MoE layer ids
    for layer, load in loads.items():
        ffn = drafter.get(layer) if drafter is not None else getattr(model.layers[layer], "ffn", None)
        if ffn is None:
            continue  # another pipeline stage owns this layer (and applies the same update)
        gate = ffn.gate
        for bias, counts in ((gate.bias, load[0]), (gate.bias_vl, load[1])):
            counts = counts.to(bias.device, torch.float32)
            bias += rate * torch.sign(counts.mean() - counts)
            updated += 1
    return updated
