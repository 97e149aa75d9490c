"""Run under torchrun: the real trainer of this process (launch/pretrain.py's, built from the Hydra
overrides on the command line) runs one step, then the next step -- the first with the ViT unfrozen,
as train/plan/estimate.py simulates -- is measured: live tensor bytes at its start (parameters, buffers,
optimizer state; gradients were dropped) plus the peak of what the step allocates on top, counted by
storage (train/optim/memory.py). Writes {rank: peak_bytes} as JSON to $MEASURE_OUT/rank{R}.json."""

import json
import os
import sys
from pathlib import Path

import torch


from flashtrain.train.config import compose  # noqa: E402
from flashtrain.train.optim.memory import PeakTensorBytes  # noqa: E402
from flashtrain.train.trainer import Trainer  # noqa: E402


def live_bytes(trainer: Trainer) -> int:
    tensors = list(trainer.module.model.parameters()) + list(trainer.module.model.buffers())
    for opt in trainer.module.optim.optimizers.values():
        for state in opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def main() -> None:
    cfg = compose(sys.argv[1:])
    trainer = Trainer(cfg, os.environ["MEASURE_OUT"])
    trainer.step = trainer.schedule.vit_unfreeze_step  # the estimator's step: every parameter trains
    trainer.forward_backward_update()
    trainer.module.optim.zero_grad(set_to_none=True)
    base = live_bytes(trainer)
    with PeakTensorBytes() as mem:
        trainer.forward_backward_update()
    Path(os.environ["MEASURE_OUT"], f"rank{trainer.rank}.json").write_text(
        json.dumps({"peak_bytes": base + mem.peak, "base_bytes": base}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
