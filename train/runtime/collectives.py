"""The loop's own collectives and how a failed one is reported (issue 18 item 8; `parallel.timeout_s`).

Every collective of the loop runs under a named operation (`Operation`: the step it belongs to and what
the step is doing, e.g. "the gradient reduction"); when one fails or times out, `collective_error`
turns the library's error into a `CollectiveError` that names the rank, the step and the operation.
`all_reduce` and `barrier` are the loop's two host-side collectives (stop flag, spike verdict, start-up
turns); without a process group they do nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashtrain.config.errors import CheckpointError, FlashtrainError


class CollectiveError(FlashtrainError, RuntimeError):
    """A collective failed or did not complete within `parallel.timeout_s`; names the step, the operation and
    the ranks that are gone. One line (flashtrain.config.cli `exit_on_user_error`): printed by `printed_by`
    alone, the lowest rank still there, when the heartbeats tell which ranks are gone; EVERY_RANK when the
    job's store is gone too; None: as any user error (rank 0, the others after a wait)."""

    EVERY_RANK = -1

    def __init__(self, message: str, printed_by: int | None = None):
        super().__init__(message)
        self.printed_by = printed_by


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


def _first_sentence(text: str) -> str:
    """The library's message without its source location (gloo's `[.../pair.cc:553] `), to its first full stop."""
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else "")
    return first.split(". ")[0].rstrip(".")[:200]


def collective_error(e: BaseException, op: Operation, rank: int, timeout_s: float, liveness=None) -> BaseException:
    """A failed or timed-out collective, named by step and operation (parallel.timeout_s bounds the wait) and,
    with the job's heartbeats (parallel/liveness.py), by the ranks that are gone; any other error unchanged."""
    if not dist.is_initialized() or isinstance(e, (CollectiveError, FloatingPointError, CheckpointError)):
        return e
    text = str(e)
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    if not (timed_out or isinstance(e, dist.DistError) or "connection" in text.lower()):
        return e
    why = (f"did not complete within parallel.timeout_s={timeout_s:g} s" if timed_out else
           f"failed ({_first_sentence(text)})")
    where = f"rank {rank}: step {op.step}, {op.name}: a collective {why}"
    lost = liveness.lost_ranks() if liveness is not None else []
    if lost is None:  # the store is gone with the node that hosts it: every rank says so
        return CollectiveError(f"{where}; {liveness.store_gone_line(waited=False, named=False)}",
                               printed_by=CollectiveError.EVERY_RANK)
    if lost:
        alive = [r for r in range(liveness.world) if r not in lost]
        return CollectiveError(f"{where}; {liveness.lost_line(lost, 'its heartbeat stopped', named=False)}",
                               printed_by=alive[0])
    hint = " (a rank stalled or is stuck; every rank's heartbeat still moves)" if liveness is not None else \
        " (a rank stalled or is stuck)" if timed_out else ""
    return CollectiveError(f"{where}{hint}; the last checkpoint is intact -- restart in the run directory to resume "
                           f"(raise parallel.timeout_s if the step legitimately takes longer)")


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` is set on any rank: one max all-reduce, read once on the host."""
    t = torch.tensor([1.0 if flag else 0.0])
    all_reduce(t, device, dist.ReduceOp.MAX if dist.is_initialized() else None)
    return bool(t.item())
