"""One training step of a model exp on this machine: forward+backward and optimizer time, tokens/s.
A benchmark, not a test.

    python launch/bench_model.py [+exp=flash_small] [--batch 2] [--seq 512] [--steps 3]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model import Transformer  # noqa: E402
from train.config import compose, model_config, optim_config  # noqa: E402
from train.optim import build_optimizers  # noqa: E402


def _opt(argv: list[str], name: str, default: int) -> tuple[int, list[str]]:
    if name in argv:
        i = argv.index(name)
        return int(argv[i + 1]), argv[:i] + argv[i + 2:]
    return default, argv


def main(argv: list[str]) -> int:
    batch, argv = _opt(argv, "--batch", 2)
    seq, argv = _opt(argv, "--seq", 512)
    steps, argv = _opt(argv, "--steps", 3)
    overrides = argv or ["+exp=flash_small"]
    conf = compose(overrides)
    mcfg, ocfg = model_config(conf), optim_config(conf)
    torch.manual_seed(0)
    model = Transformer(mcfg)
    opt = build_optimizers(model, mcfg, ocfg)
    tokens = torch.randint(3, mcfg.image_token_id, (batch, seq + 1))
    fb, op = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, mcfg.vocab_size), tokens[:, 1:].reshape(-1)).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        fb.append(t1 - t0)
        op.append(t2 - t1)
    res = {"exp": overrides, "params": sum(p.numel() for p in model.parameters()), "batch": batch, "seq": seq,
           "fwd_bwd_s": statistics.median(fb), "optim_s": statistics.median(op),
           "tokens_per_s": batch * seq / (statistics.median(fb) + statistics.median(op))}
    print(f"{overrides}: {res['params'] / 1e6:.1f}M params, {batch} x {seq} tokens: forward+backward "
          f"{res['fwd_bwd_s']:.2f} s, optimizer {res['optim_s']:.2f} s, {res['tokens_per_s']:.0f} tokens/s")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
