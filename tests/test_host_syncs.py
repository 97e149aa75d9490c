"""The host synchronisations of one whole training step (the trainer's loop pass, `Trainer.loop_step`:
forward / backward of every micro-batch, gradient reduction, clipping, the optimizer step, the MoE bias
update, the step's values and metrics, the stop flag), counted by tests/host_syncs.py on the real trainer
of each rank (tests/dist/step_syncs.py) in two layouts of flash_tiny on the 4-layer plan: one process
(pp=1), and 4 processes with pp=2 x cp=2 x ep=2 (pipeline P2P, context-parallel exchanges, expert
all-to-alls, data-parallel reduction over dp x cp). Two one-sequence micro-batches per step, text and
images (data.mix [1, 1]).

Every place that reads a value back is listed below with its reason, and the count of each rank's
device synchronisations is pinned; a new one fails the test until it is removed or given a reason here.
What the counter cannot see on the CPU: a copy into a host tensor (`host.copy_(device)`, the stop flag's
way back, train/runtime/collectives.py `all_reduce`), counted here with the read that follows it."""

import collections
import json
import os
import sys
from pathlib import Path

import pytest
import warm_launch
from layer_plans import FOUR_LAYERS

ROOT = Path(__file__).resolve().parent.parent

# device synchronisations: (op, where) -> why it stays
DEVICE_SYNCS = {
    ("Tensor.tolist", "train/step_values.py:read"):
        "the step's one read-back: its summed values, the gradient norm and the expert-load statistics, for "
        "the metrics record and the loop's decisions",
    ("aten._local_scalar_dense.default", "train/runtime/collectives.py:any_rank"):
        "the stop flag (SIGTERM on any rank): every rank must decide to save and exit at the same step",
    ("Tensor.tolist", "parallel/experts.py:_exchange_plan"):
        "expert parallelism: the all-to-all split sizes of each MoE layer's dispatch (one per layer and "
        "micro-batch; the collective needs them on the host)",
    ("Tensor.tolist", "parallel/grad_reduce.py:_zero_fill_rule"):
        "dp x cp > 1: which parameters got a gradient on any replica, agreed over the group (a parameter no "
        "replica's backward reached keeps no gradient, so the optimizers skip it as one process would)",
    ("Tensor.tolist", "parallel/pipeline.py:forward"):
        "the first pipeline stage of a multimodal round: which samples of the round this micro-batch holds, "
        "to pick their images",
    ("aten.nonzero.default", "model/vision.py:merge_images"):
        "a sample with images: the positions of its image tokens (a data-dependent index)",
    ("aten._local_scalar_dense.default", "model/vision.py:merge_images"):
        "a sample with images: its image spans checked against the aligner rows (a one-line error otherwise)",
}
# reads of host tensors: no device synchronisation
HOST_READS = {
    ("aten._local_scalar_dense.default", "train/optim/adamw.py:step"):
        "torch.optim.AdamW's step counters live on the CPU (capturable=False, fused=False)",
    ("aten._local_scalar_dense.default", "data/loader.py:collate"): "the loader's batches, built on the host",
    ("aten.bincount.default", "data/loader.py:collate"): "the loader's batches, built on the host",
    **{(op, f"train/optim/sinkhorn.py:{fn}"): "the Sinkhorn reference's squared path on a table held on the host "
       "(its mean, the rows to correct, its range checks); off the host it reads nothing back (_decides_on_host)"
       for op, fn in (("aten._local_scalar_dense.default", "sinkhorn_update_reference"),
                      ("aten.nonzero.default", "sinkhorn_update_reference"),
                      ("aten._local_scalar_dense.default", "_squared_passes"))},
}
# per layout, each rank's device synchronisations in the counted step (2 micro-batches, one image sample):
# pp=1: read-back 1 + stop flag 1 + merge_images 2
# pp=2 x cp=2 x ep=2, stage 0 (1 MoE layer): all-to-all splits 1 x 2 + zero-fill 1 + image rows 2 + read-back 1
#   + stop flag 1 + merge_images 2; stage 1 (3 MoE layers): splits 3 x 2 + zero-fill 1 + read-back 1 + stop 1
PINNED = {"pp1": [4], "pp2_cp2_ep2": [9, 9, 9, 9]}
LAYOUTS = {"pp1": (1, []), "pp2_cp2_ep2": (4, ["parallel.pp=2", "parallel.cp=2", "parallel.ep=2"])}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    return [f"data.corpus_dir={d}", "data.corpus_text_bytes=400000", "data.corpus_mm_docs=50", "data.corpus_shards=4"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_whole_step_host_syncs(layout, corpus, tmp_path):
    """Slow: the real trainer under torchrun (1 and 4 gloo processes, ~25 s each)."""
    nproc, extra = LAYOUTS[layout]
    env = {**os.environ, "SYNCS_OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                            str(ROOT / "tests" / "dist" / "step_syncs.py"), "+exp=flash_tiny", *FOUR_LAYERS, *corpus,
                            *extra, "run_name=syncs", "logging.wandb.mode=disabled", "logging.progress=false",
                            "train.checkpoint.interval=100", "train.eval.interval=0", "data.batch_size=1",
                            "train.global_batch_tokens=256", "data.mix=[1,1]"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    device = []
    for rank in range(nproc):
        sites = [tuple(s) for s in json.loads((tmp_path / f"rank{rank}.json").read_text())["sites"]]
        unknown = {s for s in sites if s not in DEVICE_SYNCS and s not in HOST_READS}
        assert not unknown, f"rank {rank}: synchronisations without a reason: {unknown}"
        device.append(sum(1 for s in sites if s in DEVICE_SYNCS))
        if layout == "pp1":
            assert collections.Counter(sites)[("Tensor.tolist", "train/step_values.py:read")] == 1
    assert device == PINNED[layout], collections.Counter(
        s for r in range(nproc) for s in map(tuple, json.loads((tmp_path / f"rank{r}.json").read_text())["sites"]))


def test_counter_sees_reads_and_host_copies():
    """The counter itself: a scalar read, tolist, a host copy and a data-dependent size are each recorded,
    with the project file that asked; plain arithmetic is not."""
    import torch
    from host_syncs import HostSyncs

    from flashtrain.train.step_values import StepValues

    x = torch.arange(6.0)
    with HostSyncs() as s:
        y = (x * 2).sum()
        float(y)
        x.tolist()
        x.cpu()
        torch.nonzero(x)
        StepValues(x.device).read()
    assert s.events == ["aten._local_scalar_dense.default", "Tensor.tolist", "Tensor.cpu", "aten.nonzero.default",
                        "Tensor.tolist"]
    assert s.sites[-1] == ("Tensor.tolist", "train/step_values.py:read")
    assert s.sites[0][1] == "outside the project"
