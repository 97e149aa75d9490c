"""train/official/safetensors.py (the `safetensors` package plus flashtrain's checks) against the published
format: files written by the module are parsed here byte by byte (struct + json), files built here by hand
(struct + json) are read by the module, and float8 / bf16 bit patterns are decoded by hand. Round trips are
checked bit-exactly via uint8 views; damaged files must give one-line errors naming the file and the tensor."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from flashtrain.train.official.safetensors import (
    DTYPES,
    INDEX_NAME,
    SafeFile,
    SafetensorsError,
    ShardedWriter,
    read_index,
    write_file,
    write_index,
)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def build_file(path: Path, header: dict, data: bytes, pad: int = 0) -> Path:
    """A safetensors file built by hand: <Q length, JSON + `pad` spaces, data."""
    text = json.dumps(header).encode("utf-8") + b" " * pad
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def parse_file(path: Path) -> tuple[dict, bytes, bytes]:
    """(header JSON, raw header bytes, data buffer) of a file, parsed here independently."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    raw = blob[8 : 8 + n]
    return json.loads(raw.decode("utf-8")), raw, blob[8 + n :]


# ---------------------------------------------------------------------------------------------------
# writer: exact bytes


def test_write_file_exact_bytes(tmp_path):
    b = torch.tensor([1.0, -2.5, 3.140625, 0.0078125], dtype=torch.bfloat16)
    path = tmp_path / "x.safetensors"
    size = write_file(path, {"a": torch.arange(6, dtype=torch.int32).reshape(2, 3), "b": b})

    header, raw, data = parse_file(path)
    assert size == path.stat().st_size == 8 + len(raw) + 32
    assert (8 + len(raw)) % 8 == 0  # the data buffer starts 8-byte aligned
    assert raw.rstrip(b" ").endswith(b"}")  # JSON, then only space padding
    assert header == {
        "a": {"dtype": "I32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
    }
    assert list(header) == ["a", "b"]  # I32 before BF16: the package stores by decreasing dtype alignment
    assert len(data) == 32
    assert struct.unpack("<6i", data[:24]) == (0, 1, 2, 3, 4, 5)
    bits = struct.unpack("<4h", data[24:32])
    assert list(bits) == b.view(torch.int16).tolist()
    # bf16 = the top 16 bits of the float32, worked out by hand
    assert bits == (0x3F80, -0x3FE0, 0x4049, 0x3C00)  # 1.0, -2.5 (0xC020), 3.140625, 2**-7


def test_write_file_metadata_order_and_noncontiguous(tmp_path):
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # non-contiguous: written row-major
    path = tmp_path / "y.safetensors"
    write_file(path, {"z": t, "a": torch.tensor(7, dtype=torch.int64)}, metadata={"format": "pt", "é": "ü"})
    header, _, data = parse_file(path)
    assert header.pop("__metadata__") == {"format": "pt", "é": "ü"}
    assert list(header) == ["a", "z"]  # not the given order: the package stores I64 before F32 (alignment)
    assert header["z"] == {"dtype": "F32", "shape": [3, 2], "data_offsets": [8, 32]}
    assert header["a"] == {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}
    assert struct.unpack("<6f", data[8:]) == (0.0, 3.0, 1.0, 4.0, 2.0, 5.0)
    assert struct.unpack("<q", data[:8]) == (7,)
    assert not list(tmp_path.glob("*.tmp"))


# one storage under several names: a = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] written as x and y (the same
# tensor), z = a[1:] (a view starting at element 4) and w = a.t() (strided): each entry its own bytes, by hand
SHARED_EXPECTED = {
    "x": ([3, 4], list(range(12))),
    "y": ([3, 4], list(range(12))),
    "z": ([2, 4], list(range(4, 12))),
    "w": ([4, 3], [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]),
}


def shared_state(order: str) -> dict[str, torch.Tensor]:
    a = torch.arange(12.0).reshape(3, 4)
    views = {"x": a, "y": a, "z": a[1:], "w": a.t()}
    return {name: views[name] for name in order}


def assert_independent_copies(path: Path, names: str) -> None:
    """Parsed here (struct + json): every name its own span of the data buffer, holding its own values."""
    header, _, data = parse_file(path)
    spans = []
    for name in names:
        shape, values = SHARED_EXPECTED[name]
        entry = header[name]
        begin, end = entry["data_offsets"]
        assert entry["dtype"] == "F32" and entry["shape"] == shape and end - begin == 4 * len(values), name
        assert list(struct.unpack(f"<{len(values)}f", data[begin:end])) == values, name
        spans.append((begin, end))
    spans.sort()
    assert spans[0][0] == 0 and all(e == b for (_, e), (b, _) in zip(spans, spans[1:]))  # no overlap, no gap
    assert spans[-1][1] == len(data)  # the data buffer holds these tensors and nothing else


@pytest.mark.parametrize("order", ["xyzw", "zwyx"])
def test_tensors_sharing_memory_are_written_as_separate_copies(tmp_path, order):
    """The package refuses entries that share memory; write_file copies them (and strided ones) first: the same
    tensor under two names, a view that starts inside the storage, a transposed view -- first in the dict or
    after the tensor owning the storage -- each written with exactly its own bytes. The source is unchanged."""
    state = shared_state(order)
    storage = {t.untyped_storage().data_ptr() for t in state.values()}
    assert len(storage) == 1 and state["z"].storage_offset() == 4 and not state["w"].is_contiguous()
    path = write_file_path(tmp_path, state)
    assert_independent_copies(path, order)
    assert torch.equal(state["x"], torch.arange(12.0).reshape(3, 4))


def test_sharded_writer_writes_shared_memory_as_separate_copies(tmp_path):
    """The export's writer (ShardedWriter, train/official/convert.py) given the same four names: one shard, each
    tensor its own bytes, the index listing all four."""
    writer = ShardedWriter(tmp_path, max_shard_bytes=1 << 20)
    for name, tensor in shared_state("xyzw").items():
        writer.add(name, tensor)
    weight_map = writer.close()
    assert weight_map == dict.fromkeys("wxyz", "model-00001-of-00001.safetensors")
    assert_independent_copies(tmp_path / "model-00001-of-00001.safetensors", "xyzw")


def test_write_file_rejects(tmp_path):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(SafetensorsError, match=r"'c'.*complex64"):
        write_file(path, {"ok": torch.zeros(2), "c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(SafetensorsError, match="reserved"):
        write_file(path, {"__metadata__": torch.zeros(2)})
    with pytest.raises(SafetensorsError, match="'k'"):
        write_file(path, {"x": torch.zeros(2)}, metadata={"k": 1})
    assert not path.exists() and not list(tmp_path.iterdir())


def test_write_file_replaces_atomically(tmp_path):
    path = tmp_path / "r.safetensors"
    write_file(path, {"old": torch.zeros(100)})
    write_file(path, {"new": torch.ones(3)})
    with SafeFile(path) as f:
        assert f.keys() == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["r.safetensors"]


def test_write_interrupted_keeps_the_old_file(tmp_path, monkeypatch):
    """The package writes in place; write_file must not: a write that dies half-way leaves the previous
    file under the final name, byte for byte, and no temporary behind."""
    import safetensors.torch

    path = tmp_path / "r.safetensors"
    write_file(path, {"old": torch.arange(5)})
    before = path.read_bytes()

    def dies_half_way(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # a header length and nothing more
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        write_file(path, {"new": torch.ones(3)})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.safetensors"]


# ---------------------------------------------------------------------------------------------------
# reader: hand-built files


def test_read_hand_built_file(tmp_path):
    data = (
        bytes([0x38, 0x40, 0x3C, 0xC0])  # e4m3: 0|0111|000 = 1.0, 0|1000|000 = 2.0, 0|0111|100 = 1.5, -2.0
        + bytes([127, 128, 126])  # e8m0: 2**(b - 127) = 1.0, 2.0, 0.5
        + struct.pack("<2f", 1.5, -2.25)  # F32 at data offset 7: deliberately unaligned
        + bytes([0x3C, 0xC1])  # e5m2: 0|01111|00 = 1.0, 1|10000|01 = -2.5
        + struct.pack("<3h", -7, 300, 12)
        + struct.pack("<H", 0x4049)  # bf16 3.140625
    )
    header = {  # JSON order differs from data order: keys() follows the data order
        "i16": {"dtype": "I16", "shape": [3, 1], "data_offsets": [17, 23]},
        "e4": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 4]},
        "__metadata__": {"format": "pt"},
        "f": {"dtype": "F32", "shape": [2], "data_offsets": [7, 15]},
        "e8": {"dtype": "F8_E8M0", "shape": [3], "data_offsets": [4, 7]},
        "e5": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [15, 17]},
        "bf": {"dtype": "BF16", "shape": [], "data_offsets": [23, 25]},
        "empty": {"dtype": "F64", "shape": [0, 3], "data_offsets": [25, 25]},
    }
    text_len = len(json.dumps(header))
    path = build_file(tmp_path / "hand.safetensors", header, data, pad=(-(8 + text_len)) % 8 + 16)

    with SafeFile(path) as f:
        assert f.keys() == ["e4", "e8", "f", "e5", "i16", "bf", "empty"]
        assert f.metadata() == {"format": "pt"}
        assert f.info("e4") == (torch.float8_e4m3fn, (2, 2))
        assert f.info("bf") == (torch.bfloat16, ())
        e4 = f.get("e4")
        assert e4.dtype == torch.float8_e4m3fn and e4.shape == (2, 2)
        assert e4.float().tolist() == [[1.0, 2.0], [1.5, -2.0]]
        e8 = f.get("e8")
        assert e8.dtype == torch.float8_e8m0fnu and e8.float().tolist() == [1.0, 2.0, 0.5]
        assert f.get("f").tolist() == [1.5, -2.25]
        assert f.get("e5").float().tolist() == [1.0, -2.5]
        i16 = f.get("i16")
        assert i16.dtype == torch.int16 and i16.tolist() == [[-7], [300], [12]]
        bf = f.get("bf")
        assert bf.shape == () and bf.item() == 3.140625
        empty = f.get("empty")
        assert empty.dtype == torch.float64 and empty.shape == (0, 3)
        t = f.get("f")
        t += 1  # owned memory: writable, the file is untouched
    assert path.read_bytes()[-18:-10] == struct.pack("<2f", 1.5, -2.25)


def test_get_returns_owned_memory_after_close(tmp_path):
    path = write_file_path(tmp_path, {"x": torch.arange(10, dtype=torch.int64)})
    f = SafeFile(path)
    x = f.get("x")
    f.close()
    f.close()  # idempotent
    assert x.tolist() == list(range(10))
    with pytest.raises(SafetensorsError, match="closed"):
        f.get("x")


def write_file_path(tmp_path: Path, tensors, metadata=None, name="t.safetensors") -> Path:
    path = tmp_path / name
    write_file(path, tensors, metadata)
    return path


# ---------------------------------------------------------------------------------------------------
# round trips


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = torch.Size(shape).numel() * dtype.itemsize
    bits = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)  # every bit pattern, NaNs included
    return bits.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def test_dtype_table():
    assert DTYPES["F8_E4M3"] == torch.float8_e4m3fn
    assert DTYPES["F8_E5M2"] == torch.float8_e5m2
    assert DTYPES["F8_E8M0"] == torch.float8_e8m0fnu
    assert DTYPES["BF16"] == torch.bfloat16 and DTYPES["BOOL"] == torch.bool and DTYPES["U16"] == torch.uint16
    assert len(DTYPES) == 14


def test_round_trip_every_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, dtype in DTYPES.items():
        tensors[name] = random_tensor(dtype, (3, 5), g)
        tensors[name + ".scalar"] = random_tensor(dtype, (), g)
        tensors[name + ".empty"] = random_tensor(dtype, (2, 0, 4), g)
    meta = {"format": "pt", "step": "12"}
    path = write_file_path(tmp_path, tensors, meta)

    header, _, _ = parse_file(path)
    for name, dtype in DTYPES.items():
        assert header[name]["dtype"] == name
        begin, end = header[name + ".empty"]["data_offsets"]
        assert begin == end
    by_offset = sorted(header, key=lambda n: tuple(header[n]["data_offsets"]) if n != "__metadata__" else (-1, -1))
    with SafeFile(path) as f:
        assert sorted(f.keys()) == sorted(tensors)
        assert f.keys() == by_offset[1:]  # file order, from the header parsed here
        assert f.metadata() == meta
        for name, ref in tensors.items():
            assert f.info(name) == (ref.dtype, tuple(ref.shape))
            got = f.get(name)
            assert got.dtype == ref.dtype and got.shape == ref.shape, name
            assert raw_bytes(got) == raw_bytes(ref), name


def test_round_trip_empty_file(tmp_path):
    path = write_file_path(tmp_path, {})
    with SafeFile(path) as f:
        assert f.keys() == [] and f.metadata() == {}


# ---------------------------------------------------------------------------------------------------
# reader errors


def test_truncated_file_names_the_tensor(tmp_path):
    path = write_file_path(tmp_path, {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(4)})
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(SafetensorsError, match=r"'c'.*truncated") as e:
        SafeFile(path)
    assert str(path) in str(e.value)


def test_overlapping_offsets(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    path = build_file(tmp_path / "o.safetensors", header, bytes(12))
    with pytest.raises(SafetensorsError, match=r"'b'.*overlap.*'a'"):
        SafeFile(path)


def test_gap_and_trailing_bytes(tmp_path):
    gap = {
        "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
        "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]},
    }
    with pytest.raises(SafetensorsError, match=r"'b'.*gap"):
        SafeFile(build_file(tmp_path / "g.safetensors", gap, bytes(6)))
    one = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}
    with pytest.raises(SafetensorsError, match="trailing"):
        SafeFile(build_file(tmp_path / "t.safetensors", one, bytes(5)))


def test_unknown_dtype(tmp_path):
    header = {"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}
    with pytest.raises(SafetensorsError, match=r"'w'.*'F7'"):
        SafeFile(build_file(tmp_path / "d.safetensors", header, bytes(1)))


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}, "data_offsets"),  # 24 bytes needed
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "shape"),
        ({"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}, "shape"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [1]}, "data_offsets"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}, "extra"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_entries(tmp_path, entry, match):
    path = build_file(tmp_path / "e.safetensors", {"w": entry}, bytes(24))
    with pytest.raises(SafetensorsError, match=match) as e:
        SafeFile(path)
    assert "'w'" in str(e.value)


def test_bad_headers(tmp_path):
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(SafetensorsError, match="header length 1000 is larger than the file"):
        SafeFile(path)
    path.write_bytes(b"\x01\x00")
    with pytest.raises(SafetensorsError, match="too short"):
        SafeFile(path)
    path.write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(SafetensorsError, match="JSON"):
        SafeFile(path)
    path.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(SafetensorsError, match="JSON object"):
        SafeFile(path)
    build_file(path, {"__metadata__": {"k": 3}}, b"")
    with pytest.raises(SafetensorsError, match="'k'"):
        SafeFile(path)


def damaged_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """{case: (file, the tensor at fault)}: files the package refuses (or flashtrain, for C64)."""
    good = write_file_path(tmp_path, {"a": torch.zeros(4), "b": torch.zeros(4), "w": torch.zeros(4)})
    cases = {"truncated": (tmp_path / "truncated.safetensors", "w")}  # 'w' is stored last (same dtype: by name)
    cases["truncated"][0].write_bytes(good.read_bytes()[:-3])
    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    for case, entry, data in [
        ("out of bounds", {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}, 12),  # 4 of its 8 bytes exist
        ("unknown dtype", {"dtype": "F7", "shape": [2], "data_offsets": [8, 16]}, 16),
        ("dtype size", {"dtype": "F64", "shape": [2], "data_offsets": [8, 16]}, 16),  # F64 x 2 needs 16 bytes
        ("unsupported dtype", {"dtype": "C64", "shape": [1], "data_offsets": [8, 16]}, 16),  # the package reads it
    ]:
        path = build_file(tmp_path / f"{case.replace(' ', '_')}.safetensors", {"a": f32, "w": entry}, bytes(data))
        cases[case] = (path, "w")
    return cases


@pytest.mark.parametrize("case", ["truncated", "out of bounds", "unknown dtype", "dtype size", "unsupported dtype"])
def test_damaged_file_error_names_file_and_tensor(tmp_path, case):
    path, tensor = damaged_files(tmp_path)[case]
    with pytest.raises(SafetensorsError) as e:
        SafeFile(path)
    message = str(e.value)
    assert str(path) in message and repr(tensor) in message and "\n" not in message, message


def test_missing_name_is_key_error(tmp_path):
    path = write_file_path(tmp_path, {"a": torch.zeros(1)})
    with SafeFile(path) as f:
        with pytest.raises(KeyError, match=r"nope") as e:
            f.get("nope")
        assert str(path) in str(e.value)
        with pytest.raises(KeyError, match="nope"):
            f.info("nope")


# ---------------------------------------------------------------------------------------------------
# sharded writer and index


def test_sharded_writer(tmp_path):
    out = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(1)
    tensors = {
        "t1": torch.randn(10, generator=g),  # 40 bytes
        "t2": torch.randn(2, 5, generator=g),  # 40: shard 1 = 80
        "t3": torch.randint(-9, 9, (5,), generator=g),  # 40 (int64): 120 > 100, new shard
        "t4": torch.randn(50, generator=g),  # 200 > limit: a shard of its own
        "t5": torch.randn(8, generator=g).bfloat16(),  # 16: after t4, a new shard
    }
    w = ShardedWriter(out, max_shard_bytes=100, metadata={"format": "pt"})
    for name, t in tensors.items():
        w.add(name, t)
    with pytest.raises(SafetensorsError, match="'t2' was already added"):
        w.add("t2", torch.zeros(1))
    t1_before = tensors["t1"].clone()
    tensors["t1"].add_(100)  # add() copied: later changes are not written
    tensors["t1"] = t1_before
    weight_map = w.close()

    names = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    expected = {"t1": names[0], "t2": names[0], "t3": names[1], "t4": names[2], "t5": names[3]}
    assert weight_map == expected
    assert sorted(p.name for p in out.iterdir()) == sorted(names + [INDEX_NAME])

    index = json.loads((out / INDEX_NAME).read_text())
    assert index["weight_map"] == expected and list(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == 40 + 40 + 40 + 200 + 16
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())

    assert read_index(out) == expected
    for name, file in read_index(out).items():
        with SafeFile(out / file) as f:
            assert f.metadata() == {"format": "pt"}
            assert raw_bytes(f.get(name)) == raw_bytes(tensors[name])
    with SafeFile(out / names[2]) as f:
        assert f.keys() == ["t4"]
    assert w.close() == expected  # idempotent
    with pytest.raises(SafetensorsError, match="closed"):
        w.add("t6", torch.zeros(1))


def test_sharded_writer_big_tensor_first_and_empty(tmp_path):
    w = ShardedWriter(tmp_path / "a", max_shard_bytes=8)
    w.add("big", torch.zeros(10))  # 40 bytes, first: alone
    w.add("small", torch.zeros(1, dtype=torch.int16))
    w.add("none", torch.zeros(0))
    assert w.close() == {
        "big": "model-00001-of-00002.safetensors",
        "none": "model-00002-of-00002.safetensors",
        "small": "model-00002-of-00002.safetensors",
    }
    empty = ShardedWriter(tmp_path / "b", max_shard_bytes=8)
    assert empty.close() == {}
    assert (tmp_path / "b" / "model-00001-of-00001.safetensors").exists()
    assert read_index(tmp_path / "b") == {}
    with pytest.raises(SafetensorsError, match="max_shard_bytes"):
        ShardedWriter(tmp_path / "c", max_shard_bytes=0)


def test_read_index_fallback_and_errors(tmp_path):
    with pytest.raises(SafetensorsError, match="0 \\*.safetensors"):
        read_index(tmp_path)
    write_file(tmp_path / "model.safetensors", {"b": torch.zeros(1), "a": torch.zeros(2)})
    assert read_index(tmp_path) == {"b": "model.safetensors", "a": "model.safetensors"}
    write_file(tmp_path / "other.safetensors", {"c": torch.zeros(1)})
    with pytest.raises(SafetensorsError, match="2 \\*.safetensors"):
        read_index(tmp_path)
    write_index(tmp_path, {"c": "other.safetensors", "b": "model.safetensors", "a": "model.safetensors"}, 16)
    text = (tmp_path / INDEX_NAME).read_text()
    assert json.loads(text) == {
        "metadata": {"total_size": 16},
        "weight_map": {"a": "model.safetensors", "b": "model.safetensors", "c": "other.safetensors"},
    }
    assert text.index('"a"') < text.index('"b"') < text.index('"c"')
    assert read_index(tmp_path)["c"] == "other.safetensors"
    (tmp_path / INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(SafetensorsError, match="weight_map"):
        read_index(tmp_path)
