"""When the Triton path runs, and how it is tuned.

Shared by the model's kernels (model/kernels/) and the optimizer's (train/optim/). On CUDA the Triton
kernels are the default. `TRITON_INTERPRET=1` runs them on CPU tensors in Triton's
interpreter (fp32 only), which is how the tests check them against the plain-PyTorch references;
under the interpreter a single autotune config is used.
"""

from __future__ import annotations

import os

import torch

from flashtrain.model.simulation import simulated

try:  # triton is optional on CPU-only machines; the reference paths need nothing from it
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    HAS_TRITON = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor, requested: bool | None) -> bool:
    """requested=None: Triton on CUDA (or under the interpreter), the reference elsewhere. Fake tensors
    (the memory estimator, train/estimate.py) always take the reference: a kernel has no values to run on,
    and the kernels keep the same saved tensors as the references they sit beside."""
    if simulated(t):
        return False
    if requested is False or not HAS_TRITON:
        if requested:
            raise RuntimeError("use_triton=True but triton is not installed (pip install triton)")
        return False
    if requested is None:
        return t.is_cuda or interpreting()
    if not (t.is_cuda or interpreting()):
        raise RuntimeError("use_triton=True needs a CUDA tensor, or TRITON_INTERPRET=1 for CPU tensors")
    return True
