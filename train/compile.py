"""torch.compile per block (`train.compile`): regional compilation, as torchtitan's `apply_compile`.

`apply_compile(model)` compiles, in place, the body of every block of the rank's model (`Block._forward`:
Engram, the attention site, the FFN site, their mHC mixes) and the head + cross-entropy of one loss tile
(train/loss.py `tile_cross_entropy`). Module names, parameters and the state dict are unchanged (the
compiled function replaces the block's bound `_forward`; nothing is wrapped), so checkpoints, the pipeline
partition and the optimizer routing see the model they always see.

- Recomputation (model/recompute.py) wraps the compiled body: `full` keeps the block's input and runs the
  compiled body again in backward; `selective` saves the outputs of the operators its policy names, as
  far as they are dispatched as operators: inside a compiled body, inductor's generated code calls the
  matmuls as extern kernels, so under compile `selective` keeps what the compiled region saves and
  recomputes the region (the values are the same; tests/test_compile.py checks both modes).
- Pipeline stages run the same blocks; the boundary (parallel/pipeline.py) is outside every compiled region.
- Graph breaks: the expert all-to-all's split sizes (`tolist`, parallel/experts.py) and the
  context-parallel exchanges (eager collectives, parallel/context.py) end a compiled graph and the
  next operator starts another; the row-sharded Engram lookup's `wait` likewise. The graphs between them
  are compiled; the results are those of eager mode. The trainer logs them at the end of a run
  (`compile_report`). Measured on rank 0 of flash_tiny's 4-layer plan at pp=2 x cp=2 x ep=2, 2 steps
  (tests/test_compile.py): 19 graphs, 16 breaks -- 7 at the cp exchanges' P2P sends / receives
  (`P2POp`, `batch_isend_irecv`), 5 at data-dependent reads (the all-to-all split sizes), 4 at the fp32
  grouped-experts path (model/moe.py, `torch.compiler.disable`d: `_grouped_mm` compiles for bf16 only).
- `train.compile_backend` (default inductor): aot_eager / eager run dynamo's graphs without inductor's code
  generation, to tell a tracing problem from a compiler one (the parallel test uses eager).
- The Triton kernels are torch.library custom ops (model/kernels/select.py `kernel_op`): compile treats
  each as one opaque operator and never traces into Triton.
- The memory estimator (train/plan/estimate.py) builds its rank with a fake-tensor mode and never compiles.

Every block is a separate compiled region (its role, layer id and Engram table specialise its graph), so
dynamo's per-function recompile limit is raised to the number of blocks.

`train.compile`: true / false, or null for the device type's default (`train.compile_default`, set from
launch/bench_model.py's measurement on that device type: on where compiled is faster).
"""

from __future__ import annotations

import re

import torch

from flashtrain.config.errors import ConfigError
from flashtrain.model.transformer import Block
from flashtrain.train import loss


def compile_enabled(setting: bool | None, device_type: str, defaults: dict) -> bool:
    """`train.compile` resolved for `device_type` (null: `train.compile_default[device_type]`, false if
    the device type has none)."""
    if setting is None:
        return bool(defaults.get(device_type, False))
    if not isinstance(setting, bool):
        raise ConfigError(f"train.compile={setting!r}: must be true, false or null (the device type's default)")
    return setting


def check_backend(backend: str) -> None:
    """`train.compile_backend` names a torch.compile backend of this installation (checked before anything is
    built; importing torch._dynamo costs ~1 s, so only when compile is on)."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(f"train.compile_backend={backend!r} is not a torch.compile backend here; use one of "
                          f"{', '.join(sorted(known))} (inductor for training, aot_eager / eager to debug)")


def apply_compile(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile every block's body and the loss tile in place with `backend` (`train.compile_backend`);
    returns the number of blocks compiled."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, len(blocks) + 8)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * len(blocks) + 64)
    for block in blocks:
        block._forward = torch.compile(block._forward, backend=backend)
    loss.compile_tile(backend=backend)
    return len(blocks)


def compile_report() -> str:
    """What torch.compile made of this process so far, one line for the log: the graphs compiled and each
    graph break's reason (its first line) with how often it ended a graph, most frequent first."""
    from torch._dynamo.utils import counters

    breaks = {}
    for reason, n in counters["graph_break"].items():
        lines = reason.strip().splitlines()
        what = re.search(r"`([^`]+)`", lines[1]) if len(lines) > 1 else None  # the function or operator named
        key = lines[0].strip() + (f" ({re.sub(r' at 0x[0-9a-f]+', '', what.group(1))})" if what else "")
        breaks[key] = breaks.get(key, 0) + n
    listed = "; ".join(f"{n} x {r}" for r, n in sorted(breaks.items(), key=lambda kv: -kv[1]))
    return (f"torch.compile: {counters['stats']['unique_graphs']} graph(s), {sum(breaks.values())} graph break(s)"
            + (f": {listed}" if listed else ""))
