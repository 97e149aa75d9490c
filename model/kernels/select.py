"""When the Triton path runs, how it is tuned, and how its kernels are launched.

Shared by the model's kernels (model/kernels/) and the optimizer's (train/optim/). On CUDA the Triton
kernels are the default. `TRITON_INTERPRET=1` runs them on CPU tensors in Triton's
interpreter (fp32 only), which is how the tests check them against the plain-PyTorch references;
under the interpreter a single autotune config is used.

Every kernel launch goes through `launch(kernel, grid, *args, **kwargs)`. On fake tensors (no values:
torch.compile tracing the kernels' custom ops, model/kernels/*.py) the host code runs -- it allocates
the outputs, which is all a fake tensor needs -- and the launch is skipped; while `recording()` is
active (the offline compile gate, train/plan/compile_gate.py) it is recorded instead, with its arguments,
and the Triton path is taken on fake tensors too, so one simulated training step lists every launch
the CUDA path makes at an exp's real shapes and dtypes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from flashtrain.model.simulation import simulated

try:  # triton is optional on CPU-only machines; the reference paths need nothing from it
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    HAS_TRITON = False


@dataclass
class Launch:
    """One recorded launch: the autotuned kernel and the arguments the host code passed it."""

    kernel: object  # triton.runtime.autotuner.Autotuner (or a JITFunction)
    args: tuple
    kwargs: dict


_RECORDED: list[Launch] | None = None  # set while recording() is active


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def recording():
    """Within: the Triton path is taken on fake tensors as on CUDA, and every launch on fake tensors is
    appended to the list this yields instead of running (the compile gate's trace of a training step)."""
    global _RECORDED
    previous, _RECORDED = _RECORDED, []
    try:
        yield _RECORDED
    finally:
        _RECORDED = previous


def is_recording() -> bool:
    """Whether `recording()` is active: a custom op whose fake implementation is only a shape function
    (model/fp8_linear.py `fp8_block_gemm`) runs its Triton host code instead, so that its launch is recorded."""
    return _RECORDED is not None


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`; on fake tensors skipped (recorded while `recording()`)."""
    if any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
        if _RECORDED is not None:
            _RECORDED.append(Launch(kernel, args, dict(kwargs)))
        return
    kernel[grid](*args, **kwargs)


def kernel_op(name: str):
    """Decorator: the host function of a kernel (or kernel group) as the torch.library custom op
    `flashtrain::<name>`, with the host function itself as its fake implementation (on fake tensors its
    launches are skipped, `launch`), so torch.compile treats it as one opaque operator and never traces
    into Triton. The function needs type annotations (torch.library infers the schema from them)."""

    def wrap(fn):
        op = torch.library.custom_op(f"flashtrain::{name}", fn, mutates_args=())
        op.register_fake(fn)
        return op

    return wrap


def use_triton(t: torch.Tensor, requested: bool | None) -> bool:
    """requested=None: Triton on CUDA (or under the interpreter), the reference elsewhere. Fake tensors
    (the memory estimator, train/plan/estimate.py) take the reference: a kernel has no values to run on, and
    the kernels keep the same saved tensors as the references they sit beside -- except while
    `recording()`, when they take the path CUDA takes."""
    if simulated(t):
        return _RECORDED is not None and requested is not False and HAS_TRITON
    if requested is False or not HAS_TRITON:
        if requested:
            raise RuntimeError("use_triton=True but triton is not installed (pip install triton)")
        return False
    if requested is None:
        return t.is_cuda or interpreting()
    if not (t.is_cuda or interpreting()):
        raise RuntimeError("use_triton=True needs a CUDA tensor, or TRITON_INTERPRET=1 for CPU tensors")
    return True
