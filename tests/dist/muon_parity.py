"""Run under torchrun (gloo, 2 processes): distributed Muon (Newton-Schulz split over the ranks by whole
matrices, results all-gathered) against single-rank Muon on every rank, on flash_tiny's Muon parameters
(2-D weights, head-wise query weights, stacked experts) with the same gradients: the same parameters
after two steps. Exits non-zero on a mismatch."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from parity_batch import tiny_cfg, tiny_model  # noqa: E402
from train.config import compose, optim_config  # noqa: E402
from train.optim import build_optimizers  # noqa: E402


def run(shard_group_of):
    model = tiny_model()
    opt = build_optimizers(model, tiny_cfg(), optim_config(compose(["+exp=flash_tiny"])), shard_group_of).optimizers["muon"]
    params = [p for g in opt.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return {id_: p.detach().clone() for id_, p in enumerate(params)}, opt


def main() -> None:
    dist.init_process_group("gloo")
    single, _ = run(None)
    shared, opt = run(lambda p: dist.group.WORLD)
    n_mats = sum(p.shape[0] if p.dim() == 3 else 1 for g in opt.param_groups for p in g["params"])
    for i, p in single.items():
        torch.testing.assert_close(shared[i], p, rtol=1e-6, atol=1e-7)
    print(f"rank {dist.get_rank()}: distributed Muon matches single-rank Muon on {n_mats} matrices", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
