"""Allocator-independent measurement of the tensor memory an optimizer step allocates.

`PeakTensorBytes` is a TorchDispatchMode that adds up the storage of every tensor an operator creates
(views and in-place/out= ops create none) and subtracts it when the tensor is freed, keeping the
peak. Unlike process RSS it does not depend on the allocator's caching or fragmentation, so it can
show that a step's workspace stays at chunk size rather than a full m x n matrix. It counts fake
tensors' storages too (train/plan/estimate.py's per-block probe).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakTensorBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):  # a wrapper without storage of its own
                    continue  # (a collective's async result)
                key = storage._cdata  # the storage itself: fake tensors (the estimator) have no address
                if key not in self._seen:
                    n = storage.nbytes()
                    self._seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, n)  # the storage: a view may outlive its base
        return out
