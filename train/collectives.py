"""The loop's own collectives and how a failed one is reported (issue 18 item 8; `parallel.timeout_s`).

Every collective of the loop runs under a named operation (`Operation`: the step it belongs to and what
the step is doing, e.g. "the gradient reduction"); when one fails or times out, `collective_error`
turns the library's error into a `CollectiveError` that names the rank, the step and the operation.
`all_reduce` and `barrier` are the loop's two host-side collectives (stop flag, spike verdict, start-up
turns); without a process group they do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashtrain.config.errors import CheckpointError


class CollectiveError(RuntimeError):
    """A collective failed or did not complete within `parallel.timeout_s`; names the step and the operation."""


@dataclass
class Operation:
    """What the step is doing now (named when a collective fails) and the step it belongs to."""

    name: str = "start-up"
    step: int = 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce(t: torch.Tensor, device: torch.device, op=None, group=None) -> torch.Tensor:
    """In place over `group` (default: every rank), through the device (NCCL reduces device tensors only)."""
    if dist.is_initialized():
        on_device = t.to(device)
        dist.all_reduce(on_device, op=op or dist.ReduceOp.SUM, group=group)
        t.copy_(on_device)
    return t


def collective_error(e: RuntimeError, op: Operation, rank: int, timeout_s: float) -> RuntimeError:
    """A failed or timed-out collective, named by step and operation (parallel.timeout_s bounds the wait);
    any other error unchanged."""
    if not dist.is_initialized() or isinstance(e, (CollectiveError, FloatingPointError, CheckpointError)):
        return e
    text = str(e)
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    if not (timed_out or isinstance(e, dist.DistError) or "connection" in text.lower()):
        return e
    why = (f"did not complete within parallel.timeout_s={timeout_s:g} s (a rank stalled or "
           f"is stuck)" if timed_out else f"failed ({type(e).__name__}: {text.splitlines()[0][:200]})")
    return CollectiveError(f"rank {rank}: step {op.step}, {op.name}: a collective {why}; the last "
                           f"checkpoint is intact -- restart in the run directory to resume (raise "
                           f"parallel.timeout_s if the step legitimately takes longer)")
