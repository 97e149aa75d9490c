"""Run under torchrun (gloo, 2 processes): Anticipatory Routing with delta_steps=1 on flash_tiny (4 layers)
in the layout given (`pp` = parallel.pp=2, `ep` = parallel.ep=2), switched on from step 1. Each rank
records, per step, the parameters it holds at the step's start, the step's micro-batches and the routing
indices its MoE gates actually used in the training forward/backward (a wrapper around Gate.forward);
afterwards it loads the parameters of step t - 1 and recomputes step t's indices with the layout's own
no-grad forward, and the indices of step t with step t's own parameters. Writes OUT/<layout>.rank<r>.pt:
{"same_as_earlier": [bool per step], "same_as_own": [...], "calls": [gate calls per step], "losses": [...],
"biases": {name: the MoE biases of this rank's gates after the last step}, "records": [the step's
metrics record, per step]}.

usage: torchrun --nproc_per_node=2 tests/dist/anticipatory_routing.py OUT CORPUS_DIR LAYOUT
(one layout per launch: a second process group in the same torchrun job can read the first one's stale
rendezvous keys from the launcher's store and hang)"""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist


from flashtrain.model.moe import Gate  # noqa: E402
from flashtrain.train.config import compose  # noqa: E402
from flashtrain.train.trainer import Trainer  # noqa: E402

FOUR_LAYERS = ["model.n_layers=4", "model.compress_ratios=[0,0,2,2]", "model.kv_source_layers=[2]",
               "model.index_source_layers=[2]", "model.candidate_source_layer=2", "model.engram_layer_ids=[1]"]
LAYOUTS = {"pp": ["parallel.pp=2", "parallel.microbatches=2"], "ep": ["parallel.ep=2"]}
STEPS = 3


def run(out: Path, corpus: str, layout: str) -> None:
    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, f"data.corpus_dir={corpus}", "data.corpus_text_bytes=300000",
                   "data.corpus_mm_docs=100", "data.corpus_shards=2", "train.global_batch_tokens=512",
                   "data.batch_size=1", "logging.wandb.mode=disabled", "logging.progress=false", "run_name=ar",
                   f"train.max_steps={STEPS}", "train.anticipatory_routing.delta_steps=1", *LAYOUTS[layout]])
    t = Trainer(cfg, out / f"run_{layout}")
    t.module.guard.routing.activate(0)
    used: list[list[torch.Tensor]] = []
    params, batches, losses, records = [], [], [], []
    original = Gate.forward

    def gate(self, x, image_mask, indices=None):
        result = original(self, x, image_mask, indices)
        if torch.is_grad_enabled():  # the training forward, not the anticipatory one
            used[-1].append(result[2].clone())
        return result

    Gate.forward = gate
    for _ in range(STEPS):
        params.append(copy.deepcopy(t.module.model.state_dict()))
        used.append([])
        run_batches = t.module.runner.run

        def spy(b, routes=None, run_batches=run_batches):
            batches.append(b)
            return run_batches(b, routes)

        t.module.runner.run = spy
        record, _ = t.train_step()
        t.module.runner.run = run_batches
        losses.append(record["loss"])
        records.append(record)
    Gate.forward = original
    biases = {k: v.clone() for k, v in t.module.model.state_dict().items() if k.endswith(("gate.bias", "gate.bias_vl"))}
    same_earlier, same_own, calls = [], [], []
    for s in range(1, STEPS + 1):
        flat = []
        for src in (max(s - 1, 1), s):  # parameters of step t - 1 (activation: step 1's own), then step t's
            t.module.model.load_state_dict(params[src - 1])
            flat.append([d[k] for d in t.module.runner.record_routes(batches[s - 1]) for k in sorted(d)])
        calls.append(len(used[s - 1]))
        same_earlier.append(len(flat[0]) == len(used[s - 1]) > 0 and
                            all(torch.equal(a, b) for a, b in zip(flat[0], used[s - 1])))
        same_own.append(all(torch.equal(a, b) for a, b in zip(flat[1], used[s - 1])))
    torch.save({"same_as_earlier": same_earlier, "same_as_own": same_own, "calls": calls, "losses": losses,
                "biases": biases, "records": records}, out / f"{layout}.rank{t.rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
