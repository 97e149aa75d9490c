"""Query chunks of a sequence (DESIGN.md "Memory"). The memory-lean paths -- the sparse-attention core,
the indexer's selection and its KL logits -- loop over chunks of `attn_chunk_size` queries and write
into outputs allocated once, so one chunk's temporaries are gone before the next chunk starts.

On fake tensors (launch/estimate.py simulates a step with shapes and no values) a chunk whose shapes
repeat an earlier chunk's allocates exactly what that chunk did, so it is skipped: the simulated peak
is the same, and a 64K sequence costs two or three chunks per layer and pass instead of 64. A test
checks the skipping against simulating every chunk (`SIMULATE_EVERY_CHUNK`)."""

from __future__ import annotations

from typing import Iterator

import torch

from flashtrain.model.simulation import simulated

SIMULATE_EVERY_CHUNK = False


def query_chunks(S: int, chunk: int, like: torch.Tensor, window: int = 0, offset: int = 0) -> Iterator[tuple[int, int]]:
    """[t0, t1) ranges of `chunk` queries covering S positions. A chunk's shapes are its length and, with
    a sliding `window`, its key band [max(0, t0 + offset - window + 1), t1 + offset) (keys `offset`
    rows ahead of the queries: a context-parallel halo); on fake tensors (`like`) only the first chunk
    of each shape is yielded."""
    skip = simulated(like) and not SIMULATE_EVERY_CHUNK
    seen = set()
    for t0 in range(0, S, chunk):
        t1 = min(S, t0 + chunk)
        shape = (t1 - t0, t1 + offset - max(0, t0 + offset - window + 1) if window else 0)
        if skip and shape in seen:
            continue
        seen.add(shape)
        yield t0, t1
