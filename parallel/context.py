"""Context parallelism, the collectives (DESIGN.md "Context parallel"; the model's side, which positions a
rank holds and what it exchanges, is model/sequence_split.py).

`ContextComm` is what the model's `SequenceSplit` calls over the `cp` group:
- `gather(x)`: every rank's `x` (equal shapes) stacked along dim 0 in rank order, with autograd: the
  backward reduce-scatters, so each rank receives the sum of every rank's gradient for its own rows --
  the window halo's and the compressed KV's gradients go back to the rank that computed them;
- `sum(t)`: all-reduce without gradient (whole-sequence statistics: balance-loss selection counts, the
  number of label positions and of indexer queries).
Both are functional collectives, so the memory estimator's fake process group and selective
recomputation (model/recompute.py keeps their outputs) see them as ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if hasattr(t, "wait") else t


class ContextComm:
    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return _waited(funcol.all_gather_single_autograd(x.contiguous(), gather_dim=0, group=self.group))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return _waited(funcol.all_reduce(t.detach().contiguous(), "sum", self.group))
