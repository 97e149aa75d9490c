"""Run under torchrun (gloo, 2 processes):
- distributed Muon (ZeRO-1: the Newton-Schulz work split over the ranks by whole matrices, each piece
  updated by its owner and broadcast) against single-rank Muon on every rank, on flash_tiny's Muon
  parameters (2-D weights, head-wise query weights, stacked experts) with the same gradients: the same
  parameters after two steps;
- SinkhornBalanced on a row-sharded table (each rank holds half the rows; rho's mean and the column
  statistics all-reduced) against the whole table on one rank: the same rows after two steps.
Exits non-zero on a mismatch."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' shared helpers

from parity_batch import tiny_cfg, tiny_model  # noqa: E402

from flashtrain.parallel.dims import ParallelDims  # noqa: E402
from flashtrain.train.config import compose, optim_config  # noqa: E402
from flashtrain.train.optim import SinkhornBalanced, build_optimizers, route_parameters  # noqa: E402
from flashtrain.train.optim.routing import zero_inputs  # noqa: E402


def run(zero: bool):
    model, mcfg, ocfg = tiny_model(), tiny_cfg(), optim_config(compose(["+exp=flash_tiny"]))
    zero_of = None
    if zero:
        dims = ParallelDims.build(dist.get_world_size(), dist.get_rank(), 1, 1, mcfg.n_layers, mcfg.n_routed_experts,
                                  zero=True)
        plan = dims.zero_plan(model, *zero_inputs(route_parameters(model, mcfg, ocfg)))
        zero_of = lambda p: plan[id(p)]  # noqa: E731
    opt = build_optimizers(model, mcfg, ocfg, zero_of, lr=2.6e-4).optimizers["muon"]
    params = [p for g in opt.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    owned = sum(len(zero_of(p).mine()) for p in params) if zero else None
    return {id_: p.detach().clone() for id_, p in enumerate(params)}, opt, owned


def main() -> None:
    dist.init_process_group("gloo")
    single, _, _ = run(False)
    shared, opt, owned = run(True)
    n_mats = sum(p.shape[0] if p.dim() == 3 else 1 for g in opt.param_groups for p in g["params"])
    counts = torch.tensor([owned])
    dist.all_reduce(counts)
    assert 0 < owned < counts.item(), (owned, counts.item())  # each rank owns (and orthogonalises) a part
    for i, p in single.items():
        torch.testing.assert_close(shared[i], p, rtol=1e-6, atol=1e-7)
    print(f"rank {dist.get_rank()}: distributed Muon matches single-rank Muon on {n_mats} matrices", flush=True)

    r = dist.get_rank()
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(300, 48, generator=gen) * 0.02
    grads = [torch.randn(300, 48, generator=gen) * torch.rand(300, 1, generator=gen) for _ in range(2)]
    grads[0][7] = 0.0  # a row below the tau threshold, on rank 0's half
    whole = torch.nn.Parameter(table.clone())
    half = torch.nn.Parameter(table[150 * r:150 * (r + 1)].clone())
    one = SinkhornBalanced([whole], lr=1e-2)
    split = SinkhornBalanced([half], lr=1e-2, row_group_of=lambda p: dist.group.WORLD)
    for g in grads:
        whole.grad, half.grad = g.clone(), g[150 * r:150 * (r + 1)].clone()
        one.step()
        split.step()
    torch.testing.assert_close(half.detach(), whole.detach()[150 * r:150 * (r + 1)], rtol=1e-5, atol=1e-7)
    assert not torch.equal(half.detach(), table[150 * r:150 * (r + 1)])
    print(f"rank {r}: row-sharded Sinkhorn matches the whole table", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
