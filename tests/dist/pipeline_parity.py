"""Run under torchrun (gloo): one pipeline step of flash_tiny per schedule on a fixed batch, dumping
each rank's losses, gradients, expert loads and aux-loss sums to OUT/<schedule>.rank<r>.pt. The last
stage returns hidden states and the loss runs head + cross-entropy tiled (train/loss.py);
tests/test_pipeline_dist.py compares them with a single-process reference that builds full logits.

usage: torchrun --nproc_per_node=2 tests/dist/pipeline_parity.py OUT SCHEDULE:COUNTS [SCHEDULE:COUNTS ...]
(COUNTS: layer counts per stage, e.g. 1f1b:3,5)"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' shared helpers

from parity_batch import MICROBATCHES, batch, tiny_model  # noqa: E402

from flashtrain.parallel.config import ParallelConfig  # noqa: E402
from flashtrain.parallel.partition import bounds_from_counts  # noqa: E402
from flashtrain.parallel.pipeline import build_pipeline, local_stage_ranges, prune_to_stages  # noqa: E402
from flashtrain.train.loss import tiled_lm_loss  # noqa: E402

LOSS_TILE_TOKENS = 48  # 128-token micro-batches: 3 tiles, the last one shorter


def main(out: Path, specs: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pp = dist.get_world_size()
    tokens, types, labels, images = batch()
    M = MICROBATCHES

    for spec in specs:
        name, counts = spec.split(":")
        counts = [int(c) for c in counts.split(",")]
        parallel = ParallelConfig(pp=pp, pipeline_schedule=name, stage_layers=counts)
        bounds = bounds_from_counts(counts)
        model = tiny_model()

        def loss_fn(hidden, target, model=model):  # the last stage hands over hidden states: head + CE tiled
            return tiled_lm_loss(hidden, model.head, target, LOSS_TILE_TOKENS, 1.0 / M)

        mine = local_stage_ranges(parallel, bounds, rank)
        prune_to_stages(model, mine)
        pipe = build_pipeline(model, parallel, mine, dist.group.WORLD, torch.device("cpu"),
                              micro_batch=tokens.shape[0] // M, seq_len=tokens.shape[1], n_microbatches=M,
                              loss_fn=loss_fn)
        pipe.set_aux_grad_scale(1.0 / M)
        losses = pipe.run_round(tokens, types, labels, images)
        torch.save({"losses": [l.detach() for l in losses],
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                    "params": sorted(n for n, _ in model.named_parameters()),
                    "loads": pipe.stats.expert_load, "balance": float(pipe.stats.balance),
                    "indexer": float(pipe.stats.indexer)},
                   out / f"{name}.rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
