"""A torch.distributed.checkpoint directory written in parts, by one process, without holding it whole.

`dcp.save` takes the whole state dict at once; converting a released checkpoint must not (552B + 196B
parameters). `PartsWriter` saves each batch of tensors with `dcp.save` into a scratch directory, moves
its data file to `part_NNNNN.distcp` and merges its metadata (tensor entries, the chunks of a tensor
written in several parts -- one expert row at a time -- and where each chunk's bytes lie) into one
`.metadata`, pickled as `FileSystemWriter.finish` writes it. The result is an ordinary DCP checkpoint:
`dcp.load` (train/checkpoint.py `load_checkpoint`) reads it with any layout. The directory appears only
when complete (written as `.tmp-<name>`, renamed at `close`).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from flashtrain.parallel.sharded_state import GlobalChunk
from flashtrain.train.checkpoint import write_manifest

_DATA_FILE = "__0_0.distcp"  # what a single-process dcp.save writes


class PartsWriter:
    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.tmp = self.out.with_name(f".tmp-{self.out.name}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.parts = 0
        self.state_md: dict = {}
        self.planner: dict = {}
        self.storage: dict = {}

    def add(self, state: dict) -> None:
        """Save `state` (nested like a training checkpoint: {"model": {fqn: tensor | GlobalChunk}, ...})."""
        if not state:
            return
        scratch = self.tmp / f".part_{self.parts:05d}"
        with warnings.catch_warnings():  # DCP warns when it runs without a process group: expected here
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, checkpoint_id=str(scratch))
        md = dcp.FileSystemReader(str(scratch)).read_metadata()
        name = f"part_{self.parts:05d}.distcp"
        os.replace(scratch / _DATA_FILE, self.tmp / name)
        shutil.rmtree(scratch)
        for key, entry in md.state_dict_metadata.items():
            have = self.state_md.get(key)
            if have is None:
                self.state_md[key] = entry
            elif isinstance(entry, TensorStorageMetadata) and isinstance(have, TensorStorageMetadata) \
                    and have.size == entry.size and have.properties.dtype == entry.properties.dtype:
                have.chunks.extend(entry.chunks)  # another piece of a tensor written in pieces
            else:
                raise ValueError(f"{key!r} was written twice, not as pieces of one tensor")
        self.planner.update(md.planner_data)
        for index, info in md.storage_data.items():
            self.storage[index] = dataclasses.replace(info, relative_path=name)
        self.parts += 1

    def close(self) -> Path:
        """Write the merged metadata and move the checkpoint into place."""
        md = Metadata(state_dict_metadata=self.state_md, planner_data=self.planner, storage_data=self.storage)
        with open(self.tmp / ".metadata", "wb") as f:
            pickle.dump(md, f)
            f.flush()
            os.fsync(f.fileno())
        write_manifest(self.tmp)  # checksums, verified when a run loads it (train/checkpoint.py)
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)
        return self.out


def pieces(chunks: list[tuple[torch.Tensor, tuple[int, ...]]], shape: tuple[int, ...]) -> GlobalChunk:
    """Rows of a global tensor, for `PartsWriter.add`."""
    return GlobalChunk(chunks, shape)
