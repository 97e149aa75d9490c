"""Run under torchrun (gloo): flash_tiny with images under context parallelism against the same model on
the unsplit sequences, on every rank (the reference is the literal single-process computation).

Sequences of 126 tokens: zigzag cuts them at 32, 64 and 95 (cp=2), contiguous at 63 -- inside a
compression group of 4, inside an image span (images at 28..35 and 58..67) and, in text, inside an
Engram n-gram. Checks: the losses summed over the cp ranks equal the reference's, every gradient summed
over the cp ranks equals the reference gradient (to fp32 rounding), the expert loads summed over the cp
ranks are exactly the reference's and so are the bias updates made from them, and the balance / indexer
loss values add up.

usage: torchrun --nproc_per_node=PP*CP tests/dist/context_parity.py PP CP BALANCE [BALANCE ...]"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' shared helpers

from conftest import random_image, vl_sample  # noqa: E402
from parity_batch import IGNORE, tiny_cfg, tiny_model  # noqa: E402

from flashtrain.model.aux import StepStats  # noqa: E402
from flashtrain.parallel.config import ParallelConfig  # noqa: E402
from flashtrain.parallel.context import ContextComm  # noqa: E402
from flashtrain.parallel.partition import bounds_from_counts  # noqa: E402
from flashtrain.parallel.pipeline import build_pipeline, local_stage_ranges, prune_to_stages  # noqa: E402
from flashtrain.train.balancing import update_biases  # noqa: E402
from flashtrain.train.loss import tiled_lm_loss  # noqa: E402

SEQ_LEN, ROWS, TILE = 126, 4, 48


def batch():
    cfg = tiny_cfg()
    rows = []
    for r in range(ROWS):
        if r % 2 == 0:
            a, b = random_image(cfg, 84, 84, seed=r), random_image(cfg, 96, 84, seed=10 + r)
            head, _, _ = vl_sample(cfg, [28, a, 22, b], seed=r)
            rows.append(vl_sample(cfg, [28, a, 22, b, SEQ_LEN - head.numel()], seed=r))
        else:
            rows.append(vl_sample(cfg, [SEQ_LEN], seed=r))
    tokens = torch.stack([t for t, _, _ in rows])
    types = torch.stack([y for _, y, _ in rows])
    labels = torch.cat([tokens[:, 1:], torch.full((ROWS, 1), IGNORE)], dim=1)
    labels = labels.masked_fill(torch.cat([types[:, 1:], torch.zeros(ROWS, 1, dtype=torch.long)], 1) >= 0, IGNORE)
    return tokens, types, labels, [ims for _, _, ims in rows]


def reference(tokens, types, labels, images, n_micro):
    """The unsplit model, micro-batch by micro-batch, losses scaled by 1 / n_micro."""
    model = tiny_model()
    losses, loads, balance, indexer, hidden = [], {}, 0.0, 0.0, None
    for rows in torch.arange(tokens.shape[0]).chunk(n_micro):
        stats = StepStats()
        hidden = model.final_hidden(model.run(tokens[rows], types[rows], [images[i] for i in rows], stats,
                                              aux_grad_scale=1.0 / n_micro))
        loss = tiled_lm_loss(hidden, model.head, labels[rows], TILE, 1.0 / n_micro)
        hidden = hidden.detach()
        loss.backward()
        losses.append(loss.detach())
        for layer, load in stats.expert_load.items():
            loads[layer] = loads.get(layer, 0) + load
        balance += float(stats.total("balance_loss"))
        indexer += float(stats.total("indexer_loss"))
    return model, losses, loads, balance, indexer, hidden  # hidden: the last micro-batch's


def main(pp: int, cp: int, balances: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (pp, cp), mesh_dim_names=("pp", "cp"))
    cp_group, pp_group = mesh["cp"].get_group(), mesh["pp"].get_group()
    cp_rank, pp_rank = mesh["cp"].get_local_rank(), mesh["pp"].get_local_rank()
    tokens, types, labels, images = batch()
    n_micro = 1 if pp == 1 else ROWS
    ref, ref_losses, ref_loads, ref_balance, ref_indexer, ref_hidden = reference(tokens, types, labels, images,
                                                                                   n_micro)

    def summed(t):
        t = t.clone()
        dist.all_reduce(t, group=cp_group)
        return t

    for balance in balances:
        model = tiny_model()
        model.set_context_parallel(cp, cp_rank, balance, ContextComm(cp_group))
        split = model.sequence_split(SEQ_LEN)
        if pp == 1:
            stats = StepStats()
            hidden = model.final_hidden(model.run(tokens, types, images, stats))
            torch.testing.assert_close(hidden, split.local(ref_hidden), msg=lambda m: f"{balance}: hidden states: {m}")
            losses = [tiled_lm_loss(hidden, model.head, labels, TILE, 1.0, split=split)]
            losses[0].backward()
            loads = dict(stats.expert_load)
            bal, idx = float(stats.total("balance_loss")), float(stats.total("indexer_loss"))
        else:
            counts = [3, 5]  # kv source 2 on stage 0, its readers 3 and 4 on stage 1
            parallel = ParallelConfig(pp=pp, stage_layers=counts)
            mine = local_stage_ranges(parallel, bounds_from_counts(counts), pp_rank)
            prune_to_stages(model, mine)
            pipe = build_pipeline(model, parallel, mine, pp_group, torch.device("cpu"), 1, SEQ_LEN, n_micro,
                                  lambda h, y: tiled_lm_loss(h, model.head, y, TILE, 1.0 / n_micro, split=split))
            pipe.set_aux_grad_scale(1.0 / n_micro)
            losses = pipe.run_round(tokens, types, labels, images)
            loads, bal, idx = dict(pipe.stats.expert_load), float(pipe.stats.balance), float(pipe.stats.indexer)

        if losses:
            for got, want in zip(losses, ref_losses):
                torch.testing.assert_close(summed(got.detach()), want, msg=f"{balance}: loss")
        ref_params = dict(ref.named_parameters())
        n_checked, worst = 0, (0.0, "")
        for name, p in model.named_parameters():
            want = ref_params[name].grad
            got = None if p.grad is None else summed(p.grad)
            if want is None or got is None:
                assert got is None or not got.any(), f"{balance}: {name} has a gradient the reference lacks"
                continue
            # norm-relative: mHC's Sinkhorn rounds amplify rounding -- merely swapping the reference's two rows
            # moves some gradients (hc_*_scale) by 3e-4 of their norm; a wrong position would move them by O(1)
            err = float((got - want).norm() / want.norm().clamp_min(1e-30))
            assert err < 5e-3, f"{balance}: gradient of {name} off by {err:.2e} of its norm"
            worst = max(worst, (err, name))
            n_checked += 1
        assert n_checked > 20, n_checked
        for layer, load in loads.items():
            assert torch.equal(summed(load), ref_loads[layer]), f"{balance}: expert load of layer {layer}"
        assert loads, "no expert loads reported"
        totals = torch.tensor([bal, idx], dtype=torch.float64)
        dist.all_reduce(totals)  # every stage's layers, every cp rank's share
        torch.testing.assert_close(totals, torch.tensor([ref_balance, ref_indexer], dtype=torch.float64),
                                   rtol=1e-5, atol=1e-7, msg=f"{balance}: balance / indexer loss values")
        global_loads = {layer: summed(load) for layer, load in loads.items()}
        update_biases(model, global_loads, 1e-3)
        update_biases(ref, {layer: ref_loads[layer] for layer in global_loads}, 1e-3)
        for layer in global_loads:
            for buf in ("bias", "bias_vl"):
                assert torch.equal(getattr(model.layers[layer].ffn.gate, buf), getattr(ref.layers[layer].ffn.gate, buf))
            for buf in ("bias", "bias_vl"):  # undo, for the next layout
                getattr(ref.layers[layer].ffn.gate, buf).zero_()
        print(f"rank {dist.get_rank()}: context parity ok ({balance}, pp={pp}, cp={cp}, {n_checked} gradients, "
              f"worst {worst[0]:.1e} of the norm ({worst[1]}))", flush=True)
        dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
    dist.barrier()  # main's tensors, whose graphs hold the groups, are gone before the groups are destroyed
    dist.destroy_process_group()
