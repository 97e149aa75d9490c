"""Shard I/O through webdataset (data/shards.py, data/README.md): URL shard lists, the writer's limits,
the error accounting on streams, compatibility with shards written before, header-only image planning."""

import dataclasses
import io
import json
import shlex
import tarfile

import numpy as np
import pytest
import torch
from test_data import _batches_equal, _png

import flashtrain.data.loader as L
from flashtrain.data.config import DataConfig, DataConfigError, TokenSpec, resolve_shards
from flashtrain.data.images import ImageProcessorConfig, load_image
from flashtrain.data.loader import PackedLoader, data_sources, image_grid
from flashtrain.data.shards import Document, ReadStats, is_url, read_shard, write_shards
from flashtrain.data.sources import default_sources

SPEC = TokenSpec(vocab_size=512, image_token_id=496,
                 image=ImageProcessorConfig(patch_size=14, downsample_ratio=3, max_n_token=64, min_pixels=84 * 84))




def _pipe(paths):
    return [f"pipe:cat {shlex.quote(p)}" for p in paths]


@pytest.fixture
def shards(tmp_path):
    """Small text and multimodal shards (several images sizes) plus a tokenizer file beside them."""
    rng = np.random.default_rng(0)
    text = [Document([("text", rng.integers(3, 490, size=int(rng.integers(5, 90))).astype(np.int32))])
            for _ in range(120)]
    mm = [Document([("image", _png(30 + 7 * (i % 9), 20 + 5 * (i % 7), (i, 3 * i % 255, 90)), "png"),
                    ("text", rng.integers(3, 490, size=int(rng.integers(2, 12))).astype(np.int32))])
          for i in range(40)]
    out = tmp_path / "shards"
    t = [str(out / e["path"]) for e in write_shards(text, out, "text", 15)]
    m = [str(out / e["path"]) for e in write_shards(mm, out, "mm", 5)]
    (out / "tokenizer.json").write_text("{}")  # data_sources only checks that it exists
    return out, t, m


def test_pipe_url_shards_give_the_same_batches_as_local_paths(shards):
    out, t, m = shards
    local = DataConfig(seq_len=64, batch_size=2, pack_buffer=8,
                       text_shards=[str(out / "text-*.tar")], mm_shards=[str(out / "mm-*.tar")])
    url = dataclasses.replace(local, text_shards=_pipe(t), mm_shards=_pipe(m), tokenizer=str(out / "tokenizer.json"))
    ls, _ = data_sources(local, SPEC)
    us, tok = data_sources(url, SPEC)
    assert ls == default_sources(t, m) and us == default_sources(_pipe(t), _pipe(m))
    assert tok == str(out / "tokenizer.json")
    a, b = PackedLoader(local, SPEC, ls), PackedLoader(url, SPEC, us)
    for i in range(40):  # past one epoch of the multimodal stream
        assert _batches_equal(next(a), next(b)), i
    assert a.counters() == b.counters() and a.counters()["corrupt_shards"] == 0
    assert b.worker_states[0]["sources"]["mm"]["cursors"]["epoch"].min() >= 1

    # a URL loader's state restores exactly, from the saved position inside the current (piped) shard
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    c = PackedLoader(url, SPEC, us, state=torch.load(buf, weights_only=False))
    for i in range(6):
        assert _batches_equal(next(b), next(c)), i


def test_url_shard_lists_are_passed_through_not_globbed(tmp_path):
    urls = ["pipe:cat /nowhere/text-{00000..00002}.tar", "https://example.com/mm-*.tar"]
    assert resolve_shards(urls, "text_shards") == sorted(
        ["https://example.com/mm-*.tar"] + [f"pipe:cat /nowhere/text-0000{i}.tar" for i in range(3)])
    assert all(is_url(u) for u in urls + ["http://h/x.tar"]) and not is_url(str(tmp_path / "x.tar"))
    with pytest.raises(FileNotFoundError, match=r"data\.mm_shards: .*nope-\*\.tar.* matches no shard"):
        resolve_shards([str(tmp_path / "nope-*.tar")], "mm_shards")
    with pytest.raises(DataConfigError, match="s3://"):
        resolve_shards(["s3://bucket/x.tar"], "text_shards")
    with pytest.raises(ValueError, match="data.tokenizer"):  # no directory to find tokenizer.json beside
        data_sources(DataConfig(text_shards=["pipe:cat /nowhere/x.tar"]), SPEC)


def test_writer_limits_shards_by_count_and_by_size(tmp_path):
    docs = [Document([("text", np.arange(i, i + 100, dtype=np.int32))]) for i in range(20)]
    by_count = write_shards(docs, tmp_path / "c", "text", 6)
    assert [e["documents"] for e in by_count] == [6, 6, 6, 2]
    assert [e["path"] for e in by_count] == [f"text-0000{i}.tar" for i in range(4)]
    by_size = write_shards(docs, tmp_path / "s", "text", 6, max_bytes=1500)  # a document is ~600 bytes of members
    assert [e["documents"] for e in by_size] == [3] * 6 + [2]
    got = [d.segments[0][1] for e in by_size for d in read_shard(str(tmp_path / "s" / e["path"]), ReadStats())]
    assert all(np.array_equal(g, d.segments[0][1]) for g, d in zip(got, docs)) and len(got) == 20
    assert write_shards(iter([]), tmp_path / "none", "mm", 5) == [] and not list((tmp_path / "none").iterdir())


def _old_writer(docs, path):
    """The hand-written tarfile layout of shards written before webdataset (must keep loading)."""
    def add(tar, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(path, "w") as tar:
        for i, doc in enumerate(docs):
            key, layout, tokens, n = f"{i:09d}", [], [], 0
            for seg in doc.segments:
                if seg[0] == "text":
                    layout.append({"text": len(seg[1])})
                    tokens.append(np.asarray(seg[1], dtype=np.int32))
                else:
                    layout.append({"image": f"{n}.{seg[2]}"})
                    add(tar, f"{key}.{n}.{seg[2]}", seg[1])
                    n += 1
            buf = io.BytesIO()
            np.save(buf, np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32))
            add(tar, f"{key}.json", json.dumps({"segments": layout}).encode())
            add(tar, f"{key}.tokens.npy", buf.getvalue())


def test_shards_written_before_still_load_and_match_the_new_writer(tmp_path):
    docs = [Document([("image", _png(20 + i, 40, (i, i, i)), "PNG"), ("text", np.arange(3, 9 + i, dtype=np.int32)),
                      ("image", _png(33, 21), "jpg")]) for i in range(7)]
    _old_writer(docs, tmp_path / "old.tar")
    (entry,) = write_shards(docs, tmp_path / "new", "mm", 100)
    assert (tmp_path / "new" / entry["path"]).read_bytes() == (tmp_path / "old.tar").read_bytes()
    stats = ReadStats()
    got = list(read_shard(str(tmp_path / "old.tar"), stats, skip=2))
    assert len(got) == 5 and stats.as_dict() == {"corrupt_shards": 0, "bad_samples": 0}
    for d, want in zip(got, docs[2:]):
        assert [s[0] for s in d.segments] == ["image", "text", "image"]
        assert d.segments[0][1:] == want.segments[0][1:] and d.segments[2][2] == "jpg"  # extension case kept
        assert np.array_equal(d.segments[1][1], want.segments[1][1])


def test_stream_errors_are_counted_like_local_ones(tmp_path):
    docs = [Document([("text", np.arange(3, 40 + i, dtype=np.int32))]) for i in range(10)]
    (entry,) = write_shards(docs, tmp_path, "text", 100)
    path = tmp_path / entry["path"]
    raw = path.read_bytes()
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    for end, parts in ((members[11].offset_data + 10, "inside a member"), (members[11].offset, "at a header")):
        cut = tmp_path / "cut.tar"
        cut.write_bytes(raw[:end])
        local, piped = ReadStats(), ReadStats()
        a = list(read_shard(str(cut), local))
        b = list(read_shard(_pipe([str(cut)])[0], piped))
        assert len(a) == len(b) and all((x is None and y is None) or np.array_equal(x.segments[0][1], y.segments[0][1])
                                        for x, y in zip(a, b)), parts
        assert [d is not None for d in b] == [True] * 5 + ([] if parts == "inside a member" else [False]), parts
        assert piped.corrupt_shards == 1 and local.corrupt_shards >= 1, parts  # local: also noticed up front
        assert local.bad_samples == piped.bad_samples == (0 if parts == "inside a member" else 1), parts
    # a command that fails is a corrupt shard, not an exception
    s = ReadStats()
    assert list(read_shard(f"pipe:cat {shlex.quote(str(tmp_path / 'missing.tar'))}", s)) == [] and s.corrupt_shards == 1
    # a clean stream counts nothing; skip passes over the first samples
    s = ReadStats()
    assert len(list(read_shard(_pipe([str(path)])[0], s, skip=4))) == 6 and s.as_dict() == {"corrupt_shards": 0,
                                                                                           "bad_samples": 0}


def test_a_corrupt_shard_is_named_once_per_reader_in_words(tmp_path, caplog):
    """Issue 47 item 6: a shard cut inside its first header (tarfile's "truncated header", which webdataset
    hands over with its stream object and URL in the arguments) is reported in words, once per reader:
    the up-front check's line for a local file (not also the tar error's), the tar error's for a stream,
    and nothing more on a second read of the same shard."""
    import logging

    (entry,) = write_shards([Document([("text", np.arange(3, 40, dtype=np.int32))])] * 3, tmp_path, "text", 100)
    cut = tmp_path / "cut.tar"
    cut.write_bytes((tmp_path / entry["path"]).read_bytes()[:300])
    stats = ReadStats()
    with caplog.at_level(logging.WARNING, logger="flashtrain.data.shards"):
        for shard in (str(cut), _pipe([str(cut)])[0], str(cut), _pipe([str(cut)])[0]):
            assert list(read_shard(shard, stats)) == []
    assert [r.getMessage() for r in caplog.records] == [
        f"shard {cut} is truncated (no end-of-archive blocks); reading its complete samples only",
        f"shard {_pipe([str(cut)])[0]} is corrupt or truncated (truncated header); skipping the rest of it"]
    assert stats.corrupt_shards == 2


def test_duplicate_members_make_a_bad_sample(tmp_path):
    buf = io.BytesIO()
    np.save(buf, np.arange(3, 9, dtype=np.int32))
    layout = json.dumps({"segments": [{"text": 6}]}).encode()
    with tarfile.open(tmp_path / "dup.tar", "w") as tar:
        for name, data in (("a.json", layout), ("a.tokens.npy", buf.getvalue()), ("b.json", layout),
                           ("b.json", layout), ("b.tokens.npy", buf.getvalue()), ("c.json", layout),
                           ("c.tokens.npy", buf.getvalue())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    stats = ReadStats()
    got = list(read_shard(str(tmp_path / "dup.tar"), stats))
    assert [d is None for d in got] == [False, True, False] and stats.bad_samples == 1


def test_images_are_planned_from_the_header_and_decoded_once(shards, monkeypatch):
    out, t, m = shards
    for w, h in ((60, 30), (400, 90), (17, 300), (900, 900)):
        data = _png(w, h)
        img = load_image(data, SPEC.image)
        assert image_grid(data, SPEC.image) == (img.n_llm_h, img.n_llm_w)
    calls = []
    real = L.load_image
    monkeypatch.setattr(L, "load_image", lambda data, cfg: (calls.append(1), real(data, cfg))[1])
    loader = PackedLoader(DataConfig(seq_len=64, batch_size=2, pack_buffer=8), SPEC, default_sources(t, m))
    images = sum(len(r) for _ in range(30) for r in next(loader)["images"])
    assert images > 0 and len(calls) == images  # one decode per image emitted, none to plan


def test_an_image_whose_header_reads_but_pixels_do_not_is_dropped_and_counted(tmp_path):
    good = _png(70, 40, (200, 10, 10))
    broken = _png(64, 64, (1, 2, 3))
    broken = broken[: len(broken) - 40]  # header fine, pixel data cut short
    image_grid(broken, SPEC.image)  # plans fine ...
    mm = [Document([("image", broken if i % 2 else good, "png"), ("text", np.array([7, 8, 9], dtype=np.int32))])
          for i in range(8)]
    text = [Document([("text", np.arange(3, 30, dtype=np.int32))]) for _ in range(16)]
    tt = [str(tmp_path / e["path"]) for e in write_shards(text, tmp_path, "text", 8)]
    mt = [str(tmp_path / e["path"]) for e in write_shards(mm, tmp_path, "mm", 4)]
    loader = PackedLoader(DataConfig(seq_len=32, batch_size=2, pack_buffer=4), SPEC, default_sources(tt, mt))
    for _ in range(20):
        b = next(loader)
        for r in range(2):  # one START per emitted image, and only the good image is emitted
            assert int((b["token_types"][r] == 0).sum()) == len(b["images"][r])
            assert all(torch.equal(x, load_image(good, SPEC.image).pixels) for x in b["images"][r])
    assert loader.counters()["skipped_bad_image"] >= 1  # ... and is dropped when its piece is placed
