"""The memory estimator's one seam into the model and the training step (train/plan/estimate.py;
DESIGN.md "Memory": memory is measured by running the real step on fake tensors).

`simulated(t)`: whether `t` is a fake tensor (torch's FakeTensorMode: shapes, dtypes and storage
sizes, no values). The code paths below read a tensor's values on the host; on fake tensors there are
none, so each asks `simulated` first and takes the shape-only path, which allocates what the real path
allocates (that is what the estimate counts):

| where | the real path reads | simulated |
|---|---|---|
| model/moe.py | the per-expert row counts; `_grouped_mm` support | the balanced split; bf16 only |
| model/quant.py | -- (its E2M1 tables are cached per device) | tables built per call, never cached |
| model/kernels/select.py | -- (Triton kernels need values) | the reference (compile gate: the Triton host code) |
| model/init.py | -- | no seeded draws (nothing to fill; ~50k draws for an exp=flash model otherwise) |
| model/chunks.py | -- | query chunks of a repeated shape run once (`SIMULATE_EVERY_CHUNK`) |
| model/transformer.py | whether a batch has image tokens | no images (text batches) |
| parallel/experts.py | the all-to-all split sizes | balanced splits, no count exchange |
| parallel/engram_shard.py | the distinct row ids each rank asks for | balanced requests |
| parallel/grad_reduce.py | which gradients arrived, storage identity | every gradient exists |
| train/balancing.py | which layers reported loads, empty counts | every layer |
| train/loss.py | the number of label tokens | every position |

The rest of the estimator's differences live in train/plan/estimate.py: the rank is built under its
FakeTensorMode (train/build.py `build_rank(tensor_mode=...)`), on a fake process group, and the
pipeline schedule's warm-up vote is replaced (it reads a tensor on the host). While the offline compile gate
records kernel launches (model/kernels/select.py `recording`, train/plan/compile_gate.py), the Triton path's host
code runs on fake tensors instead of the reference, its launches recorded instead of run. The Sinkhorn optimizer
(train/optim/sinkhorn.py) asks torch's `is_fake` directly.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def simulated(t) -> bool:
    """True for the memory estimator's fake tensors (no values to read). Inside a function torch.compile
    traces (train/compile.py) False: the traced tensors are real ones when the graph runs, and the estimator
    never compiles (dynamo cannot trace `is_fake`, and would break the graph at every kernel's dispatch)."""
    if torch.compiler.is_compiling():
        return False
    return is_fake(t)
