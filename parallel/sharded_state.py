"""Global tensors held in pieces, for torch.distributed.checkpoint (DESIGN.md "Training": checkpoints
reshard across pp / ep / dp).

A rank that holds part of a tensor -- its expert shard of a stacked [E, ...] weight, its row block of a
row-sharded Engram table, the optimizer state of the parameter pieces it owns under ZeRO-1 -- hands DCP
a `GlobalChunk`: the global shape plus the local chunks with their offsets. DCP writes each chunk where
it belongs in the global tensor and, on load, fills each requested chunk from whatever chunks the
checkpoint holds, so a checkpoint written with one layout loads into any other. (DTensor needs the
chunks to follow its own even split; ZeRO's cost-balanced pieces and prime-sized tables do not.)

Only DCP's checkpointable protocol is implemented; the object is not a tensor to compute with.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class GlobalChunk(torch.Tensor):
    """A `global_shape` tensor of which this rank holds `chunks` = [(local tensor, offsets)]."""

    @staticmethod
    def __new__(cls, chunks: list[tuple[torch.Tensor, tuple[int, ...]]], global_shape):
        if not chunks:
            raise ValueError("GlobalChunk needs at least one local chunk (leave the key out of the state dict "
                             "on a rank that holds none)")
        first = chunks[0][0]
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=first.dtype, device=first.device)
        r._chunks = [(t, torch.Size(o)) for t, o in chunks]
        for t, o in r._chunks:
            if len(o) != len(r.shape) or any(a + n > g for a, n, g in zip(o, t.shape, r.shape)):
                raise ValueError(f"chunk of shape {tuple(t.shape)} at {tuple(o)} does not fit {tuple(r.shape)}")
        return r

    @property
    def chunks(self) -> list[tuple[torch.Tensor, torch.Size]]:
        return self._chunks

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(o, t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.size()))
                for t, o in self._chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(o, t.size()) for t, o in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for t, o in self._chunks:
            if o == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no local chunk at {index.offset}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.new_empty.default:  # DCP's async staging: an empty twin whose attributes
            self = args[0]                           # (the chunks) it then deep-copies to the CPU
            twin = torch.Tensor._make_wrapper_subclass(cls, self.shape, dtype=self.dtype, device="cpu")
            twin._chunks = []
            return twin
        raise NotImplementedError(f"GlobalChunk is a checkpoint view, not a tensor to compute with ({func})")

    def __repr__(self) -> str:
        return f"GlobalChunk({tuple(self.shape)}, chunks at {[tuple(o) for _, o in self._chunks]})"
