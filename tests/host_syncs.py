"""Counting host synchronisations on the CPU (the CPU equivalent of `torch.cuda.set_sync_debug_mode`):
every op that must read a device value back to the host before it can return on CUDA -- a scalar read
(`item`, `bool`), `tolist`, a data-dependent output size (`nonzero`, `masked_select`, `unique`,
`bincount`, `repeat_interleave` without `output_size`) -- is recorded with its Python-side name."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DATA_DEPENDENT = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
                  "aten.bincount.default", "aten._unique2.default", "aten.unique_dim.default",
                  "aten.unique_consecutive.default", "aten.masked_scatter.default"}


class HostSyncs(TorchDispatchMode):
    """with HostSyncs() as s: ...; s.events lists the synchronising ops in order."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []
        self._tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in DATA_DEPENDENT or (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None):
            self.events.append(name)
        return func(*args, **kwargs)

    def __enter__(self):
        # tolist reads the data directly, below the dispatcher: count it at the Python method
        self._tolist = torch.Tensor.tolist
        events, original = self.events, self._tolist

        def tolist(t):
            events.append("Tensor.tolist")
            return original(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
