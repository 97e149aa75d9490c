"""Run under torchrun (gloo, 2 processes): flash_tiny with ep=2 (each rank holds 4 of the 8 experts of
every MoE layer, tokens dispatched by all-to-all) against ep=1 on the same 2 data-parallel ranks, each
rank with its own 2 sequences: the same losses, gradients (expert gradients compared on the slice each
rank holds), global expert loads and MoE bias updates; and one host synchronisation per layer (the
all-to-all split sizes). Exits non-zero with a message on a mismatch."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' shared helpers

from host_syncs import HostSyncs  # noqa: E402
from parity_batch import IGNORE, batch, tiny_model  # noqa: E402

from flashtrain.model.aux import StepStats  # noqa: E402
from flashtrain.model.param_kinds import ParamKind, parameter_kinds  # noqa: E402
from flashtrain.parallel.experts import shard_experts  # noqa: E402
from flashtrain.train.balancing import global_loads, update_biases  # noqa: E402


def step(model, tokens, types, labels, images):
    stats = StepStats()
    logits = model(tokens, types, images, stats)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)
    loss.backward()
    grads, kinds = {}, parameter_kinds(model)
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # ep=2 with dp=2: the expert replicas group has one rank, the sum is over everyone
        grads[n] = g / 2 if kinds[n] is not ParamKind.ROUTED_EXPERT or model.layers[0].ffn.experts.dispatcher is None else p.grad / 2
    loads = global_loads(stats.expert_load, model.cfg.n_layers, model.cfg.n_routed_experts)
    update_biases(model, loads, 1e-3)
    return loss.detach(), grads, loads


def check_one_host_sync_per_layer(moe, shape) -> None:
    """An expert-parallel MoE layer's forward+backward reads one thing back to the host: the split sizes
    of its all-to-alls (tests/host_syncs.py counts every synchronising op)."""
    x = torch.randn(*shape, moe.gate.weight.shape[1], requires_grad=True)
    with HostSyncs() as syncs:
        moe(x, None).backward(torch.ones(*shape, x.shape[-1]))
    assert syncs.events == ["Tensor.tolist"], syncs.events


def main() -> None:
    dist.init_process_group("gloo")
    r = dist.get_rank()
    tokens, types, labels, images = batch()
    mine = slice(2 * r, 2 * r + 2)
    args = (tokens[mine], types[mine], labels[mine], images[mine])
    ref = tiny_model()
    ref_loss, ref_grads, ref_loads = step(ref, *args)
    ep = tiny_model()
    shard_experts(ep, 2, r, dist.group.WORLD)
    assert ep.layers[3].ffn.experts.w1.shape[0] == 4
    loss, grads, loads = step(ep, *args)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    kinds = parameter_kinds(ep)
    for n, g in grads.items():
        want = ref_grads[n]
        if kinds[n] is ParamKind.ROUTED_EXPERT:
            want = want[4 * r:4 * r + 4]
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-8, msg=lambda m, n=n: f"rank {r} {n}: {m}")
    assert loads.keys() == ref_loads.keys() and all(torch.equal(loads[k], ref_loads[k]) for k in loads)
    for l in range(ep.cfg.n_layers):
        for b in ("bias", "bias_vl"):
            assert torch.equal(getattr(ep.layers[l].ffn.gate, b), getattr(ref.layers[l].ffn.gate, b))
    check_one_host_sync_per_layer(ep.layers[3].ffn, args[0].shape[:2])
    print(f"rank {r}: ep=2 matches ep=1 (loss {loss.item():.6f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
