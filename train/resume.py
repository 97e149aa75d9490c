"""Where a start resumes from (DESIGN.md "Training": checkpoints): the run directory's newest complete,
verified checkpoint, or `train.resume_from`; and whether a checkpoint's model config allows it.

- `train.resume_from` must be an intact checkpoint (else `CheckpointError`, naming the problem);
- a `train.resume_from` holding weights only (an import, launch/import_official.py) is where a run
  starts, not a resume point: once the run directory has its own checkpoints, a restart continues from
  those;
- the saved model config must equal the run's, except the fields in `EXECUTION_ONLY`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from flashtrain.config.errors import CheckpointError, ConfigError
from flashtrain.train.checkpoint import checkpoint_problem, latest_verified_checkpoint, load_data_states, weights_only

log = logging.getLogger(__name__)

# model fields that change how the step is computed, not what: a run may resume with other values (e.g. a
# smaller attention chunk for the 1M-token extension, whose indexer scores [chunk, heads, S / m] per chunk),
# QAT (switched on for the last part of a run: the KV / indexer formats and the weights', issue 35) and FP8 GEMMs
EXECUTION_ONLY = frozenset({"attn_chunk_size", "use_triton", "qat", "fp8"})


def resume_path(resume_from: str | None, run_dir: Path, is_main: bool) -> str | Path | None:
    """The checkpoint this start loads (None: a fresh start)."""
    own = latest_verified_checkpoint(run_dir, report=log.warning if is_main else lambda _: None,
                                     move_damaged=True)
    if not resume_from:
        return own
    problem = checkpoint_problem(resume_from)
    if problem:
        raise CheckpointError(f"train.resume_from={resume_from} is damaged ({problem}); pick another checkpoint")
    if own is not None and weights_only(resume_from):
        # imported weights are where a run starts, not a resume point: a restart continues the run's own
        if is_main:
            log.info(f"train.resume_from={resume_from} holds weights only (an import); the run directory has its "
                     f"own checkpoints: resuming from {own}")
        return own
    return resume_from


def check_model_config(saved: dict, current: dict, path) -> None:
    diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k) and k not in EXECUTION_ONLY)
    if diff:
        raise ConfigError(f"checkpoint {path} was written for a different model config (fields {diff} differ); "
                          f"use a new run directory, or the model config it was trained with")


def restore_data_position(loader, state: dict | None, path, readers: int, data, is_main: bool) -> None:
    """The loader's position from checkpoint `path`: this reader's own (`state`, the same layout: the same batches
    follow), else every reader's re-split over this run's `readers` x workers and rows (another number of readers
    or workers, another data.seq_len; data/loader.py relayout: each document read once, those in flight
    included)."""
    if state is not None and loader.same_layout(state):
        loader.load_state_dict(state)
        return
    states = load_data_states(path)
    loader.load_state_dict(states)
    if is_main:
        before = states[0]
        log.info(f"the data position of {path} ({len(states)} reader(s) x {before['num_workers']} worker(s), "
                 f"rows of {before.get('capacity', '?')} positions) re-split over {readers} reader(s) x "
                 f"{max(1, data.num_workers)} worker(s), rows of {data.seq_len + 1}: each "
                 f"document read once, those in flight included (data/loader.py relayout)")
