"""Counting host synchronisations on the CPU (the CPU equivalent of `torch.cuda.set_sync_debug_mode`):
every op that must read a device value back to the host before it can return on CUDA -- a scalar read
(`item`, `bool`), `tolist`, a copy to the host (`cpu`), a data-dependent output size (`nonzero`,
`masked_select`, `unique`, `bincount`, `repeat_interleave` without `output_size`) -- is recorded with its
Python-side name, and in `sites` with where the project's code asked for it (the innermost frame in
model/, parallel/, train/, data/ or conf/: "train/trainer.py:train_step")."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DATA_DEPENDENT = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
                  "aten.bincount.default", "aten._unique2.default", "aten.unique_dim.default",
                  "aten.unique_consecutive.default", "aten.masked_scatter.default"}


_ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = ("model", "parallel", "train", "data", "conf")


def project_site() -> str:
    """The innermost frame of the calling stack inside the project's packages, as "dir/file.py:function"."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(_ROOT) and path.relative_to(_ROOT).parts[0] in _PACKAGES:
            return f"{path.relative_to(_ROOT).as_posix()}:{frame.name}"
    return "outside the project"


class HostSyncs(TorchDispatchMode):
    """with HostSyncs() as s: ...; s.events lists the synchronising ops in order, s.sites (op, where)."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []
        self.sites: list[tuple[str, str]] = []
        self._methods: dict = {}

    def _record(self, name: str) -> None:
        self.events.append(name)
        self.sites.append((name, project_site()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in DATA_DEPENDENT or (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None):
            self._record(name)
        return func(*args, **kwargs)

    def __enter__(self):
        # tolist reads the data directly, below the dispatcher: count it at the Python method; so is a copy to
        # the host, `cpu()` (a no-op on a CPU tensor, a device-to-host copy that waits for the device on CUDA)
        self._methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu")}
        record = self._record

        def counted(name, original):
            def method(t, *args, **kwargs):
                record(f"Tensor.{name}")
                return original(t, *args, **kwargs)
            return method

        for name, original in self._methods.items():
            setattr(torch.Tensor, name, counted(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._methods.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)
