"""Safetensors files (Hugging Face's format) through the `safetensors` package, plus what it does not do.

The package (the reference implementation) parses, validates and memory-maps files (`safe_open`) and
serialises them (`safetensors.torch.save_file`). This module adds what the official-checkpoint
converters (convert.py) need on top:

- error messages that name the file and the tensor: the package's header errors name neither in most
  cases ("incomplete metadata, file not fully covered"), so when it refuses a file, `_diagnose` reads
  the header (8-byte little-endian length, JSON) and says which entry is wrong and how, followed by the
  package's own words;
- the project's dtype table `DTYPES`: the 14 dtypes flashtrain reads and writes (the release formats
  use BF16, F32, F8_E4M3 weights, F8_E8M0 scales and I8 for FP4 codes, two E2M1 values per byte). The
  package also knows C64, U32, U64, the FNUZ float8s and the sub-byte F4 / F6 types (F4 with a doubled
  last dimension); the release formats use none of them, and a file holding one is refused naming the
  tensor, as is a tensor of such a dtype handed to the writer;
- atomic writes: `write_file` writes ``<path>.tmp``, fsyncs and renames it (the package writes in place),
  so a file under its final name is always complete;
- size-limited shards with the index (`ShardedWriter`, `read_index`, `write_index`): Hugging Face's
  ``model-00001-of-00003.safetensors`` ... plus ``model.safetensors.index.json`` = ``{"metadata":
  {"total_size": <data bytes>}, "weight_map": {tensor name: file name}}``.

Layout written by the package: the data buffer starts 8-byte aligned (the header is padded with
spaces), the tensors are stored by decreasing dtype alignment, then by name (not in the given order),
contiguously; readers accept any order and padding.

Memory bounds:

- `SafeFile.get` returns a tensor backed by a private (copy-on-write) map of the file: its pages are
  read when first touched and count toward the process's RSS only while the tensor lives; writing to it
  never reaches the file. A file is never read whole.
- `write_file` hands the package the tensors as they are when they are CPU-contiguous and own their
  storage (no copy); others (another device, strided, sharing storage with another entry) are copied
  to CPU first, all of them alive until the file is written. The package writes straight from the
  tensors' memory.
- `ShardedWriter` must know every entry of a shard before writing it, so it keeps the current shard's
  tensors (CPU copies made at `ShardedWriter.add`) until the shard is full: at most one shard
  (``max_shard_bytes``, or one tensor when that tensor alone is larger) is held at a time.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Union

import safetensors
import safetensors.torch
import torch

from flashtrain.config.errors import FlashtrainError

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "SafeFile",
    "SafetensorsError",
    "ShardedWriter",
    "read_index",
    "shard_name",
    "write_file",
    "write_index",
]

PathLike = Union[str, os.PathLike]

INDEX_NAME = "model.safetensors.index.json"
METADATA_KEY = "__metadata__"
_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # torch >= 2.7
}
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsError(FlashtrainError, ValueError):
    """A malformed safetensors file or index, or a tensor the format (or flashtrain) cannot hold."""


# ---------------------------------------------------------------------------------------------------
# writing


def _check_tensor(path: PathLike, name: object, tensor: object) -> None:
    if not isinstance(name, str):
        raise SafetensorsError(f"{path}: tensor name {name!r} is not a str")
    if name == METADATA_KEY:
        raise SafetensorsError(f"{path}: tensor name {METADATA_KEY!r} is reserved for the metadata")
    if not isinstance(tensor, torch.Tensor):
        raise SafetensorsError(f"{path}: tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise SafetensorsError(f"{path}: tensor {name!r}: layout {tensor.layout} is not supported (dense only)")
    if tensor.dtype not in _DTYPE_NAMES:
        raise SafetensorsError(f"{path}: tensor {name!r}: dtype {tensor.dtype} is not one flashtrain writes "
                               f"(supported: {', '.join(str(d) for d in DTYPES.values())})")


def _check_metadata(path: PathLike, metadata: Mapping[str, str] | None) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise SafetensorsError(f"{path}: {METADATA_KEY} must be a mapping of str to str, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SafetensorsError(f"{path}: {METADATA_KEY} entry {key!r}: keys and values must be str, got {value!r}")
    return dict(metadata)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _cpu_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as the package takes them: CPU, contiguous, each with a storage of its own (the package
    refuses entries that share memory). Tensors that already are so are passed as they are."""
    out, storages = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        storage = (tensor.untyped_storage().data_ptr(), tensor.device) if tensor.numel() else None
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or storage in storages:
            tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu").copy_(tensor)
        elif storage is not None:
            storages.add(storage)
        out[name] = tensor
    return out


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable; best effort (not every platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write `tensors` and `metadata` to `path` atomically with the package; returns the file size.

    Raises SafetensorsError, before anything is written, for a dtype outside `DTYPES`, a non-dense
    tensor or a non-str name / metadata.
    """
    path = Path(path)
    for name, tensor in tensors.items():
        _check_tensor(path, name, tensor)
    meta = _check_metadata(path, metadata)
    tmp = path.with_name(path.name + ".tmp")
    try:
        safetensors.torch.save_file(_cpu_tensors(tensors), tmp, metadata=meta or None)
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path.stat().st_size


# ---------------------------------------------------------------------------------------------------
# reading


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _header_problem(path: Path) -> str | None:
    """What is wrong with the header of `path`, naming the tensor where one is at fault; None when these
    checks find nothing. Used only to explain a file the package refused (the package does the validation)."""
    size = path.stat().st_size
    if size < 8:
        return f"{size} bytes is too short for the 8-byte header length"
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > size - 8:
            return f"header length {length} is larger than the file ({size} bytes)"
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"header is not valid UTF-8 JSON: {e}"
    if not isinstance(header, dict):
        return f"header must be a JSON object, got {type(header).__name__}"
    meta = header.pop(METADATA_KEY, None)
    if meta is not None and not isinstance(meta, dict):
        return f"{METADATA_KEY} must be a JSON object of str to str, got {meta!r}"
    for key, value in (meta or {}).items():
        if not isinstance(value, str):
            return f"{METADATA_KEY} entry {key!r}: values must be str, got {value!r}"
    spans = []
    for name, info in header.items():
        where = f"tensor {name!r}"
        if not isinstance(info, dict):
            return f"{where}: entry must be a JSON object, got {info!r}"
        missing = [k for k in _ENTRY_FIELDS if k not in info]
        extra = sorted(set(info) - set(_ENTRY_FIELDS))
        if missing or extra:
            return f"{where}: missing field(s) {missing}" if missing else f"{where}: unknown field(s) {extra}"
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:  # unknown to the package, or a dtype flashtrain does not read
            return f"{where}: field 'dtype': unknown dtype {dtype!r} (known: {', '.join(DTYPES)})"
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            return f"{where}: field 'shape' must be a list of non-negative ints, got {shape!r}"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            return f"{where}: field 'data_offsets' must be [begin, end] ints, got {offsets!r}"
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[0] < 0 or offsets[1] - offsets[0] != nbytes:
            return f"{where}: field 'data_offsets' {offsets} does not hold shape {shape} of {dtype} ({nbytes} bytes)"
        spans.append((offsets[0], offsets[1], name))
    buffer, position, previous = size - 8 - length, 0, None
    for begin, end, name in sorted(spans):
        if begin < position:
            return f"tensor {name!r}: data_offsets [{begin}, {end}] overlap tensor {previous!r}"
        if begin > position:
            return f"tensor {name!r}: data_offsets [{begin}, {end}] leave a gap after byte {position} of the data"
        if end > buffer:
            return (f"tensor {name!r}: data_offsets [{begin}, {end}] run past the end of the data buffer "
                    f"({buffer} bytes): the file is truncated")
        position, previous = end, name
    if position != buffer:
        return f"the tensors cover {position} of the {buffer} data bytes: {buffer - position} trailing bytes"
    return None


def _diagnose(path: Path, error: Exception) -> SafetensorsError:
    """The package's refusal of `path`, as one line naming the file and (where one is at fault) the tensor."""
    problem = _header_problem(path)
    said = f"safetensors: {error}"
    return SafetensorsError(f"{path}: {problem} ({said})" if problem else f"{path}: {said}")


class SafeFile:
    """A safetensors file opened with `safetensors.safe_open` (memory-mapped): the package validates the
    header on open; `get` hands out one tensor at a time."""

    def __init__(self, path: PathLike):
        self.path = Path(path)
        try:
            self._handle = safetensors.safe_open(self.path, framework="pt")
        except safetensors.SafetensorError as e:
            raise _diagnose(self.path, e) from None
        try:
            self._metadata = dict(self._handle.metadata() or {})
            self._info: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
            for name in self._handle.offset_keys():  # file order (by data offset)
                piece = self._handle.get_slice(name)
                dtype = piece.get_dtype()
                if dtype not in DTYPES:
                    raise SafetensorsError(f"{self.path}: tensor {name!r}: dtype {dtype!r} is not one flashtrain "
                                           f"reads (known: {', '.join(DTYPES)})")
                self._info[name] = (DTYPES[dtype], tuple(piece.get_shape()))
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        """Tensor names in file order (by data offset)."""
        return list(self._info)

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """The stored dtype and shape, without reading data."""
        try:
            return self._info[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def get(self, name: str) -> torch.Tensor:
        """The stored values, backed by a private copy-on-write map of the file (see the module docstring):
        writable, never writing the file, valid after `close`."""
        self.info(name)
        if self._handle is None:
            raise SafetensorsError(f"{self.path}: file is closed")
        return self._handle.get_tensor(name)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle = None

    def __enter__(self) -> SafeFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafeFile({str(self.path)!r}, {len(self._info)} tensors)"


# ---------------------------------------------------------------------------------------------------
# sharded checkpoints


def read_index(dir: PathLike) -> dict[str, str]:
    """{tensor name: file name in `dir`} from `model.safetensors.index.json`; without an index, a
    directory holding exactly one `*.safetensors` file maps all that file's tensors to it."""
    directory = Path(dir)
    index = directory / INDEX_NAME
    if index.exists():
        return _load_index(index)
    files = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
    if len(files) != 1:
        raise SafetensorsError(
            f"{directory}: no {INDEX_NAME} and {len(files)} *.safetensors files "
            f"(exactly one is needed without an index){': ' + ', '.join(files) if files else ''}"
        )
    with SafeFile(directory / files[0]) as f:
        return {name: files[0] for name in f.keys()}


def _load_index(index: Path) -> dict[str, str]:
    try:
        content = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{index}: not valid UTF-8 JSON: {e}") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        raise SafetensorsError(f"{index}: field 'weight_map' must be a JSON object")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise SafetensorsError(f"{index}: weight_map entry {name!r}: file must be a str, got {file!r}")
    return dict(weight_map)


def write_index(dir: PathLike, weight_map: Mapping[str, str], total_size: int) -> None:
    """Write `model.safetensors.index.json` (atomically), the weight map sorted by tensor name."""
    index = Path(dir) / INDEX_NAME
    content = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    tmp = index.with_name(index.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, index)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(index.parent)


def shard_name(i: int, n: int) -> str:
    """The final name of shard `i` (1-based) of `n`."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


class ShardedWriter:
    """Writes tensors into `model-0000i-of-0000N.safetensors` shards of at most `max_shard_bytes` of
    data each (a tensor larger than that gets a shard of its own), plus the index.

    The shard count is known only at `close`, so shards are written as `model-0000i.safetensors.tmp`
    and renamed there; a directory without the index is an unfinished write. `add` keeps a CPU copy of
    the tensor until its shard is written: at most one shard of tensors is held at a time. `metadata`
    goes into every shard's header.
    """

    def __init__(self, dir: PathLike, max_shard_bytes: int, metadata: Mapping[str, str] | None = None):
        if not _is_int(max_shard_bytes) or max_shard_bytes <= 0:
            raise SafetensorsError(f"{dir}: max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._metadata = _check_metadata(self.dir, metadata)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names of each written shard
        self._seen: set[str] = set()
        self._total_size = 0
        self._weight_map: dict[str, str] | None = None  # set by close()

    def _temp_path(self, i: int) -> Path:
        return self.dir / f"model-{i:05d}.safetensors.tmp"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue `tensor` (copied now: later changes to it are not written) under `name`."""
        if self._weight_map is not None:
            raise SafetensorsError(f"{self.dir}: tensor {name!r}: the writer is closed")
        _check_tensor(self.dir, name, tensor)
        if name in self._seen:
            raise SafetensorsError(f"{self.dir}: tensor {name!r} was already added")
        size = _nbytes(tensor)
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")  # one copy from any device/layout
        self._pending[name] = copy.copy_(tensor.detach())
        self._pending_bytes += size
        self._seen.add(name)
        self._total_size += size

    def _flush(self) -> None:
        write_file(self._temp_path(len(self._shards) + 1), self._pending, self._metadata)
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Write the last shard, give every shard its final name, write the index; returns the weight
        map (sorted by name, as in the index). Closing twice returns the same map."""
        if self._weight_map is not None:
            return dict(self._weight_map)
        if self._pending or not self._shards:  # no tensor at all still makes one (empty) loadable shard
            self._flush()
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self._shards, start=1):
            final = shard_name(i, n)
            os.replace(self._temp_path(i), self.dir / final)
            weight_map.update((name, final) for name in names)
        _fsync_dir(self.dir)
        write_index(self.dir, weight_map, self._total_size)
        self._weight_map = dict(sorted(weight_map.items()))
        return dict(self._weight_map)
