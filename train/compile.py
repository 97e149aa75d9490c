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
  are compiled; the results are those of eager mode.
- The Triton kernels are torch.library custom ops (model/kernels/select.py `kernel_op`): compile treats
  each as one opaque operator and never traces into Triton.
- The memory estimator (train/estimate.py) builds its rank with a fake-tensor mode and never compiles.

Every block is a separate compiled region (its role, layer id and Engram table specialise its graph), so
dynamo's per-function recompile limit is raised to the number of blocks.

`train.compile`: true / false, or null for the device type's default (`train.compile_default`, set from
launch/bench_model.py's measurement on that device type: on where compiled is faster).
"""

from __future__ import annotations

import torch

from flashtrain.config.errors import ConfigError


def compile_enabled(setting: bool | None, device_type: str, defaults: dict) -> bool:
    """`train.compile` resolved for `device_type` (null: `train.compile_default[device_type]`, false if
    the device type has none)."""
    if setting is None:
        return bool(defaults.get(device_type, False))
    if not isinstance(setting, bool):
        raise ConfigError(f"train.compile={setting!r}: must be true, false or null (the device type's default)")
    return setting


def apply_compile(model: torch.nn.Module) -> int:
    """Compile every block's body and the loss tile in place; returns the number of blocks compiled."""
    from flashtrain.model.transformer import Block
    from flashtrain.train import loss

    blocks = [m for m in model.modules() if isinstance(m, Block)]
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, len(blocks) + 8)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * len(blocks) + 64)
    for block in blocks:
        block._forward = torch.compile(block._forward)
    loss.compile_tile()
    return len(blocks)
