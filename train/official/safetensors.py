"""Reading and writing the safetensors format (Hugging Face's), without the `safetensors` package.

File layout::

    [8 bytes]  N, the header length, unsigned little-endian
    [N bytes]  UTF-8 JSON object, optionally padded with trailing spaces (0x20)
    [rest]     the data buffer

The JSON object maps every tensor name to ``{"dtype": str, "shape": [int, ...], "data_offsets":
[begin, end]}``; offsets count bytes from the start of the data buffer (not of the file), ``end`` is
exclusive, and the tensors cover the buffer contiguously: sorted by offset, each begins where the
previous one ends, with no gap, no overlap and nothing after the last one. ``end - begin`` is
``prod(shape) * itemsize`` (0 for a tensor without elements). An optional ``"__metadata__"`` entry
holds a ``{str: str}`` map. Data is row-major, little-endian (this module assumes a little-endian
host, like every platform torch trains on). The writer pads the header with spaces so that the data
buffer starts 8-byte aligned; the reader accepts any padding and any alignment.

Memory bounds:

- `write_file` writes the header, then each tensor's bytes straight to the file, one tensor at a time;
  the only extra memory is one CPU-contiguous copy of the tensor being written (none when it already
  is CPU-contiguous). Files are written to ``<path>.tmp``, fsynced and renamed, so a file under its
  final name is always complete.
- `SafeFile` maps the file with mmap and copies out one tensor per `SafeFile.get`; a file is never read
  whole.
- `ShardedWriter` must know every entry of a shard before writing its header, so it keeps the current
  shard's tensors (CPU copies made at `ShardedWriter.add`) until the shard is full: at most one shard
  (``max_shard_bytes``, or one tensor when that tensor alone is larger) is held at a time.

Sharded checkpoints follow the Hugging Face convention: ``model-00001-of-00003.safetensors`` ... plus
``model.safetensors.index.json`` = ``{"metadata": {"total_size": <data bytes>}, "weight_map":
{tensor name: file name}}``.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Union

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
_ALIGN = 8
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # a larger header is a corrupt length field, not a real file
_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")


def _dtype_table() -> dict[str, torch.dtype]:
    table = {
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
    }
    # float8 types exist from torch 2.1 (e4m3fn, e5m2) and 2.7 (e8m0fnu); the project allows torch >= 2.5
    for name, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu")):
        if hasattr(torch, attr):
            table[name] = getattr(torch, attr)
    return table


DTYPES: dict[str, torch.dtype] = _dtype_table()
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsError(FlashtrainError, ValueError):
    """A malformed safetensors file or index, or a tensor the format cannot hold."""


# ---------------------------------------------------------------------------------------------------
# writing


def _dtype_name(path: PathLike, name: str, tensor: torch.Tensor) -> str:
    if not isinstance(tensor, torch.Tensor):
        raise SafetensorsError(f"{path}: tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise SafetensorsError(f"{path}: tensor {name!r}: layout {tensor.layout} is not supported (dense only)")
    try:
        return _DTYPE_NAMES[tensor.dtype]
    except KeyError:
        raise SafetensorsError(
            f"{path}: tensor {name!r}: dtype {tensor.dtype} is not supported by safetensors "
            f"(supported: {', '.join(str(d) for d in DTYPES.values())})"
        ) from None


def _check_name(path: PathLike, name: object) -> str:
    if not isinstance(name, str):
        raise SafetensorsError(f"{path}: tensor name {name!r} is not a str")
    if name == METADATA_KEY:
        raise SafetensorsError(f"{path}: tensor name {METADATA_KEY!r} is reserved for the metadata")
    return name


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


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's row-major bytes, from a CPU-contiguous copy (no copy when it already is one)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu" or not tensor.is_contiguous():  # one copy, whatever the device/strides
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu").copy_(tensor)
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _encode_header(header: dict) -> bytes:
    """JSON, padded with spaces so that the data buffer (after the 8-byte length) starts aligned."""
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-(8 + len(raw)) % _ALIGN)


def _build_header(path: PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    meta = _check_metadata(path, metadata)
    if meta:
        header[METADATA_KEY] = meta
    offset = 0
    for name, tensor in tensors.items():
        dtype = _dtype_name(path, _check_name(path, name), tensor)
        size = _nbytes(tensor)
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    return _encode_header(header)


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


def write_file(path: PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write `tensors` (in the given order) and `metadata` to `path` atomically; returns the file size.

    Each tensor is copied to CPU-contiguous memory and written on its own, so at most one tensor's copy
    is alive at a time. Raises SafetensorsError for an unsupported dtype or a non-str name / metadata.
    """
    path = Path(path)
    header = _build_header(path, tensors, metadata)
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    try:
        with open(tmp, "wb") as f:
            written += f.write(struct.pack("<Q", len(header)))
            written += f.write(header)
            for name, tensor in tensors.items():
                data = _tensor_bytes(tensor)
                if len(data) != _nbytes(tensor):  # the tensor changed between header and data
                    raise SafetensorsError(f"{path}: tensor {name!r}: size changed while writing")
                written += f.write(data)
                del data
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return written


# ---------------------------------------------------------------------------------------------------
# reading


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Entry:
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


def _parse_entry(path: PathLike, name: str, info: object) -> _Entry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise SafetensorsError(f"{where}: entry must be a JSON object, got {info!r}")
    for field in _ENTRY_FIELDS:
        if field not in info:
            raise SafetensorsError(f"{where}: missing field {field!r}")
    extra = sorted(set(info) - set(_ENTRY_FIELDS))
    if extra:
        raise SafetensorsError(f"{where}: unknown field(s) {extra}")
    dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype_name not in DTYPES:
        raise SafetensorsError(f"{where}: field 'dtype': unknown dtype {dtype_name!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise SafetensorsError(f"{where}: field 'shape' must be a list of non-negative ints, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise SafetensorsError(f"{where}: field 'data_offsets' must be [begin, end] ints, got {offsets!r}")
    begin, end = offsets
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if begin < 0 or end < begin or end - begin != expected:
        raise SafetensorsError(
            f"{where}: field 'data_offsets' {offsets} does not hold shape {shape} of {dtype_name} "
            f"({expected} bytes)"
        )
    return _Entry(name, dtype, tuple(shape), begin, end)


def _check_layout(path: PathLike, entries: list[_Entry], buffer_size: int) -> None:
    """Entries (sorted by offset) cover [0, buffer_size) contiguously, without gap or overlap."""
    position, previous = 0, None
    for entry in entries:
        if entry.begin < position:
            raise SafetensorsError(
                f"{path}: tensor {entry.name!r}: data_offsets [{entry.begin}, {entry.end}] overlap "
                f"tensor {previous.name!r} [{previous.begin}, {previous.end}]"
            )
        if entry.begin > position:
            raise SafetensorsError(
                f"{path}: tensor {entry.name!r}: data_offsets [{entry.begin}, {entry.end}] leave a gap "
                f"after byte {position} of the data buffer"
            )
        if entry.end > buffer_size:
            raise SafetensorsError(
                f"{path}: tensor {entry.name!r}: data_offsets [{entry.begin}, {entry.end}] run past the end "
                f"of the data buffer ({buffer_size} bytes): the file is truncated"
            )
        position, previous = entry.end, entry
    if position != buffer_size:
        raise SafetensorsError(
            f"{path}: the tensors cover {position} bytes but the data buffer holds {buffer_size}: "
            f"{buffer_size - position} trailing bytes"
        )


def _read_header(path: PathLike, f, file_size: int) -> tuple[dict, int]:
    """The decoded JSON header and the file offset of the data buffer."""
    if file_size < 8:
        raise SafetensorsError(f"{path}: {file_size} bytes is too short for the 8-byte header length")
    (length,) = struct.unpack("<Q", f.read(8))
    if length > file_size - 8:
        raise SafetensorsError(f"{path}: header length {length} is larger than the file ({file_size} bytes)")
    if length > _MAX_HEADER_BYTES:
        raise SafetensorsError(f"{path}: header length {length} exceeds the {_MAX_HEADER_BYTES}-byte limit")
    raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header, 8 + length


class SafeFile:
    """A safetensors file opened for lazy reading: the header is parsed and validated on open, tensor
    data is copied out of an mmap one tensor at a time by `get`."""

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self._file = open(self.path, "rb")
        self._mmap: mmap.mmap | None = None
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        file_size = os.fstat(self._file.fileno()).st_size
        header, self._data_start = _read_header(self.path, self._file, file_size)
        self._metadata = _check_metadata(self.path, header.pop(METADATA_KEY, None))
        entries = [_parse_entry(self.path, name, info) for name, info in header.items()]
        entries.sort(key=lambda e: (e.begin, e.end))  # stable: ties keep the header's order
        _check_layout(self.path, entries, file_size - self._data_start)
        self._entries = {e.name: e for e in entries}
        if file_size > self._data_start:  # mmap cannot map an empty range
            self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def keys(self) -> list[str]:
        """Tensor names in file order (by data offset)."""
        return list(self._entries)

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """The stored dtype and shape, without reading data."""
        entry = self._entry(name)
        return entry.dtype, entry.shape

    def get(self, name: str) -> torch.Tensor:
        """A new tensor (owned memory) holding the stored values."""
        entry = self._entry(name)
        if self._file is None:
            raise SafetensorsError(f"{self.path}: file is closed")
        if entry.end == entry.begin:
            return torch.empty(entry.shape, dtype=entry.dtype)
        with warnings.catch_warnings():  # the mapping is read-only; the clone below is what we hand out
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            view = torch.frombuffer(
                self._mmap, dtype=torch.uint8, count=entry.end - entry.begin, offset=self._data_start + entry.begin
            )
        data = view.clone()  # owned and aligned, so the view to a wider dtype is valid
        del view  # release the mmap export so that close() can unmap
        return data.view(entry.dtype).reshape(entry.shape)

    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> SafeFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafeFile({str(self.path)!r}, {len(self._entries)} tensors)"


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
        _dtype_name(self.dir, _check_name(self.dir, name), tensor)
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
