"""launch/estimate.py against a real step on this machine's GPU: a measurement, not a test.

    torchrun --nproc_per_node=1 launch/bench_estimate.py +exp=flash_small data.seq_len=8192 [overrides...]
    ... --real-only     the real step only (estimate elsewhere: the estimator needs no GPU)

Takes `+exp=NAME` and Hydra overrides (no default: name the exp); without `--real-only` both the real
step and the estimate run.

The estimator (train/plan/estimate.py) simulates bf16 autocast on fake tensors with the CPU's autocast
lists; the test suite checks it against a real CPU step only (tests/test_estimate.py). Here the
trainer's real step runs on CUDA (bf16 autocast, the Triton optimizer kernels): one step creates the
optimizer state, then the next -- the first with the ViT unfrozen, as the estimator simulates -- is
measured with the CUDA caching allocator's counters: `torch.cuda.memory_allocated()` at its start
(parameters, buffers, optimizer state) and `torch.cuda.max_memory_allocated()` during it. The same
configuration is then estimated (`estimate_rank`, device "cuda") in a subprocess. Prints one JSON line:

    {"overrides", "real": {"peak_bytes", "base_bytes", "step_s", "reserved_bytes"},
     "estimate": {...RankEstimate...}, "peak_ratio": estimate / real}

Single process, text batches (the estimator's). The estimator assumes balanced routing; a fresh
model's routing is not, so the expert part of the activations differs by that much.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashtrain.config.cli import exit_with_help  # noqa: E402 - imports nothing heavy

if __name__ == "__main__":
    exit_with_help(__doc__, sys.argv[1:])  # --help: this docstring, before the slow imports

ROOT = Path(__file__).resolve().parent.parent


def real_step(overrides: list[str], run_dir: str) -> dict:
    import torch

    from flashtrain.train.config import compose
    from flashtrain.train.trainer import Trainer

    if not torch.cuda.is_available():
        raise SystemExit("error: bench_estimate.py measures a CUDA step; this machine has no GPU")
    trainer = Trainer(compose(overrides), run_dir)
    trainer.step = trainer.schedule.vit_unfreeze_step  # the estimator's step: every parameter trains
    trainer.forward_backward_update()  # creates the optimizer state
    trainer.module.optim.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    trainer.forward_backward_update()
    torch.cuda.synchronize()
    out = {"peak_bytes": torch.cuda.max_memory_allocated(), "base_bytes": base,
           "step_s": time.perf_counter() - t0, "reserved_bytes": torch.cuda.max_memory_reserved()}
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return out


def main(argv: list[str]) -> None:
    real_only = "--real-only" in argv
    argv = [a for a in argv if a != "--real-only"]
    overrides = [*argv, "data.mix=[1,0]", "logging.wandb.mode=disabled", "run_name=bench_estimate"]
    with tempfile.TemporaryDirectory() as tmp:
        overrides.append(f"data.corpus_dir={tmp}/corpus")
        real = real_step(overrides, tmp)
    if real_only:
        print(json.dumps({"overrides": argv, "real": real}))
        return
    est = subprocess.run([sys.executable, str(ROOT / "launch" / "estimate.py"), *argv, "--world", "1", "--rank", "0",
                          "--device", "cuda", "--json"], capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if est.returncode != 0:
        raise SystemExit(f"error: the estimate failed:\n{est.stderr[-3000:]}")
    print(json.dumps(report(argv, real, est.stdout)))


def report(argv: list[str], real: dict, estimate_stdout: str) -> dict:
    """The printed record: the real step's figures, rank 0's estimate (the last line of `launch/estimate.py
    --json`) and `peak_ratio`, the estimated peak over the real one (above 1: the estimator over-estimates)."""
    estimate = json.loads(estimate_stdout.strip().splitlines()[-1])["ranks"][0]
    return {"overrides": argv, "real": real, "estimate": estimate,
            "peak_ratio": estimate["peak_bytes"] / real["peak_bytes"]}


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    exit_on_user_error(main, sys.argv[1:])
