"""Pipeline parity under torchrun/gloo (2 processes): one step of every schedule on flash_tiny (the
8-layer plan of tests/layer_plans.py) gives the losses, gradients, expert loads and aux-loss values of
the single-process model running the same micro-batches, with stage boundaries where the CSA2 carry
crosses:

- 1f1b [3 | 5]: Full 2's kv and top-k are read by Reuse 3-4 on the next stage;
- 4 virtual stages [3 | 2 | 1 | 2] (interleaved 1F1B, ZBV, DualPipeV): boundaries at 3 (Full 2's kv
  and top-k, read by Reuse 3-4), 5 (Full 5 starts a stage of its own) and 6 (Full 5's kv, index-K,
  top-k and candidate pool, read by Reindex 6 and Reuse 7). In the V-shaped placements rank 0 holds
  stages 0 and 3 (embedding and head), so the 1 -> 2 boundary is on one rank and the others cross
  processes."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import warm_launch
from parity_batch import IGNORE, MICROBATCHES, batch, tiny_model

from flashtrain.model.aux import StepStats

pytestmark = pytest.mark.xdist_group("pipeline_dist")  # its module-scoped reference runs are shared

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"1f1b": "3,5", "interleaved_1f1b": "3,2,1,2", "zbv": "3,2,1,2", "dualpipev": "3,2,1,2"}


@pytest.fixture(scope="module")
def reference():
    """Single process: the same micro-batches one after another, CE / M and aux gradients scaled 1 / M."""
    model = tiny_model()
    tokens, types, labels, images = batch()
    losses, loads, balance, indexer = [], {}, 0.0, 0.0
    for i in range(MICROBATCHES):
        stats = StepStats()
        logits = model(tokens[i:i + 1], types[i:i + 1], images[i:i + 1], stats, aux_grad_scale=1.0 / MICROBATCHES)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[i:i + 1].reshape(-1),
                               ignore_index=IGNORE) / MICROBATCHES
        loss.backward()
        losses.append(loss.detach())
        for l, v in stats.expert_load.items():
            loads[l] = loads.get(l, 0) + v
        balance += sum(v.item() for v in stats.balance_loss.values())
        indexer += sum(v.item() for v in stats.indexer_loss.values())
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"losses": losses, "grads": grads, "params": set(dict(model.named_parameters())), "loads": loads,
            "balance": balance, "indexer": indexer}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "pipeline_parity.py"), str(out), *[f"{k}:{v}" for k, v in LAYOUTS.items()]]
    run = warm_launch.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return {name: [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in (0, 1)] for name in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(LAYOUTS))
def test_pipeline_matches_single_process(schedule, reference, pipelined):
    ranks = pipelined[schedule]
    # each parameter lives on exactly one rank, and together they are the whole model
    owned = [set(r["params"]) for r in ranks]
    assert not owned[0] & owned[1] and owned[0] | owned[1] == reference["params"]
    # the losses come from the rank holding the last stage (rank 1 for 1F1B / interleaved, rank 0 for V)
    last = 0 if schedule in ("zbv", "dualpipev") else 1
    assert ranks[1 - last]["losses"] == []
    torch.testing.assert_close(torch.stack(ranks[last]["losses"]), torch.stack(reference["losses"]),
                               rtol=1e-6, atol=1e-7)
    grads = {**ranks[0]["grads"], **ranks[1]["grads"]}
    assert set(grads) == set(reference["grads"])
    for n, g in reference["grads"].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-8, msg=lambda m: f"{schedule} {n}: {m}")
    # compressor gradients crossed the boundaries back to Full 2 / 5 (their readers are on later stages)
    for l in (2, 5):
        assert grads[f"layers.{l}.attn.compressor.wkv.weight"].abs().sum() > 0
    loads = {**ranks[0]["loads"], **ranks[1]["loads"]}
    assert sorted(loads) == sorted(reference["loads"])
    assert all(torch.equal(loads[l], reference["loads"][l]) for l in loads)
    assert ranks[0]["balance"] + ranks[1]["balance"] == pytest.approx(reference["balance"], rel=1e-6)
    assert ranks[0]["indexer"] + ranks[1]["indexer"] == pytest.approx(reference["indexer"], rel=1e-6)
