"""Run under torchrun: the real trainer of this process (launch/pretrain.py's, built from the Hydra
overrides on the command line) runs one pass of its loop (`Trainer.loop_step`: the training step, metrics,
the stop flag), then a second one is run under tests/host_syncs.py's counter. Writes this rank's
synchronising operations and where the project asked for them, as JSON, to $SYNCS_OUT/rank{R}.json."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: host_syncs

import torch  # noqa: E402
from host_syncs import HostSyncs  # noqa: E402

from flashtrain.train.config import compose  # noqa: E402
from flashtrain.train.metrics import MetricsLogger  # noqa: E402
from flashtrain.train.profile import StepProfiler  # noqa: E402
from flashtrain.train.trainer import Trainer  # noqa: E402


def main() -> None:
    cfg = compose(sys.argv[1:])
    out = Path(os.environ["SYNCS_OUT"])
    trainer = Trainer(cfg, out)
    c = trainer.cfg
    metrics = MetricsLogger(out, c.logging, c.cfg_dict, trainer.is_main, trainer.max_steps, trainer.step)
    profiler = StepProfiler.for_trainer(trainer)
    trainer.module.guard.start(trainer.step, trainer.tokens_seen)
    trainer.loop_step(metrics, profiler)  # the first step creates the optimizer state
    with HostSyncs() as syncs:
        saved, stop = trainer.loop_step(metrics, profiler)
    assert not saved and not stop, "the counted step must not save a checkpoint (train.checkpoint.interval)"
    metrics.close()
    (out / f"rank{trainer.rank}.json").write_text(json.dumps({"sites": syncs.sites}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
