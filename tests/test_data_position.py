"""The data position that does not depend on the layout (issue 48 item 1, data/loader.py): a cursor per
shard and the documents in flight, re-split over any number of readers, workers and any row length, with
every document read once -- checked against the shards' own contents, not the loader's counters."""

import collections
import io
import random

import numpy as np
import pytest
from PIL import Image

from flashtrain.data.config import DataConfig, TokenSpec
from flashtrain.data.images import IMAGE_START, TEXT, ImageProcessorConfig
from flashtrain.data.loader import (
    Counters,
    PackedLoader,
    Piece,
    ShardStream,
    cursors_of_state_v2,
    relayout,
    resplit,
)
from flashtrain.data.shards import Document, ReadStats, read_shard, write_shards
from flashtrain.data.sources import default_sources

SPEC = TokenSpec(vocab_size=512, image_token_id=496,
                 image=ImageProcessorConfig(patch_size=14, downsample_ratio=3, max_n_token=64, min_pixels=84 * 84))


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (60, 30), (seed % 255, 40, 90)).save(buf, format="PNG")  # 10 positions (test_data.py)
    return buf.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources: 60 text documents of 3-59 tokens in 12 shards, 24 documents of text around an image in 8."""
    out = tmp_path_factory.mktemp("position")
    rng = np.random.default_rng(0)

    def text(n):
        return [Document([("text", rng.integers(3, 490, int(rng.integers(3, 60))).astype(np.int32))])
                for _ in range(n)]

    mm = [Document([("text", rng.integers(3, 490, 4).astype(np.int32)), ("image", _png(i), "png"),
                    ("text", rng.integers(3, 490, int(rng.integers(1, 12))).astype(np.int32))]) for i in range(24)]
    t = [str(out / e["path"]) for e in write_shards(iter(text(60)), out, "text", 5)]
    m = [str(out / e["path"]) for e in write_shards(iter(mm), out, "mm", 3)]
    positions = {}  # (source, shard, key) -> positions of [BOS] + segments + [EOS], read from the shard itself
    for s, shards in enumerate((t, m)):
        for shard in shards:
            for d in read_shard(shard, ReadStats()):
                n_img = sum(1 for seg in d.segments if seg[0] == "image")
                positions[(s, shard, d.key)] = 2 + sum(len(seg[1]) for seg in d.segments if seg[0] == "text") \
                    + 10 * n_img
    return default_sources(t, m, [3, 1]), positions


def _read(loaders, batches, emitted, tokens):
    for _ in range(batches):
        for loader in loaders:
            batch = next(loader)
            for row in batch["trace"]:
                for s, (shard, key, epoch, start, end) in row:
                    emitted[(s, shard, key, epoch)].append((start, end))
                    tokens[s] += end - start


def test_every_document_is_read_once_across_reader_and_row_changes(corpus):
    """2 readers (rows of 33) -> 1 reader x 2 workers (rows of 21: the pieces in flight cut again) -> 3
    readers (rows of 49), each change at a saved state: every document's emitted ranges, per epoch, tile
    a prefix of its positions with no overlap, and every document of the first epoch is read whole."""
    sources, positions = corpus
    emitted, tokens = collections.defaultdict(list), [0, 0]
    first = DataConfig(seq_len=32, batch_size=2, pack_buffer=8)
    a = [PackedLoader(first, SPEC, sources, r, 2) for r in range(2)]
    _read(a, 5, emitted, tokens)
    b = PackedLoader(DataConfig(seq_len=20, batch_size=3, pack_buffer=8, num_workers=2), SPEC, sources, 0, 1)
    b.load_state_dict([x.state_dict() for x in a])
    _read([b], 30, emitted, tokens)
    c = [PackedLoader(DataConfig(seq_len=48, batch_size=1, pack_buffer=8), SPEC, sources, r, 3) for r in range(3)]
    for x in c:
        x.load_state_dict([b.state_dict()])
    _read(c, 30, emitted, tokens)
    assert {k[3] for k in emitted} >= {0, 1}  # the run went past the first epoch of both sources
    for (s, shard, key, epoch), ranges in emitted.items():  # no position of a document emitted twice in an epoch
        ranges.sort()
        assert all(b[0] >= a[1] for a, b in zip(ranges, ranges[1:])), (shard, key, epoch, ranges)
        assert ranges[-1][1] <= positions[(s, shard, key)]
    for (s, shard, key), n in positions.items():  # epoch 0 (drained long before the end): every document whole
        ranges = emitted[(s, shard, key, 0)]
        assert [r[0] for r in ranges] == [0] + [r[1] for r in ranges[:-1]] and ranges[-1][1] == n, (shard, key)
    assert 2.0 < tokens[0] / tokens[1] < 4.5  # the 3 : 1 mix held across the changes


def test_relayout_by_hand():
    """Two groups (shards 0 2 4 | 1 3) re-split over three (0 3 | 1 4 | 2): each shard's cursor goes to its
    new owner, the pieces in flight (group 0's buffer and pending, then group 1's) are dealt in turn, the mix
    tokens shared out, the skips summed into group 0 and each corrupt shard given to its new owner."""
    shards = [f"s{i}.tar" for i in range(5)]
    sources = default_sources(shards, [], [1, 1])[:1]

    def piece(n):
        return {"tokens": np.arange(n), "types": np.full(n, TEXT), "images": [], "stream": 0,
                "origin": (f"s{n}.tar", f"{n:09d}", 0, 0, n)}

    def group(epochs, skips, buffer, pending, mix, skipped, corrupt):
        counters = {**Counters().as_dict(), "skipped_empty": skipped, "corrupt_shards": len(corrupt)}
        return {"weights": {"text": 1}, "counters": counters, "corrupt_shards_found": corrupt,
                "sources": {"text": {"tag": 0, "cursors": {"epoch": np.array(epochs), "skip": np.array(skips)},
                                     "shards_sha": None, "mix_tokens": mix, "buffer": buffer, "pending": pending}}}

    state = {"version": 3, "rank": 0, "world": 1, "num_workers": 2, "capacity": 9, "next_worker": 1,
             "worker_states": {0: group([1, 0, 2], [0, 4, 0], [piece(5), piece(3)], [piece(2)], 10, 2, ["s4.tar"]),
                               1: group([1, 1], [7, 0], [piece(4)], [], 7, 1, ["s1.tar"])}}
    out = relayout([state], sources, 3, 9, seed=0)
    got = {g: out[g]["sources"]["text"] for g in range(3)}
    assert [list(got[g]["cursors"]["epoch"]) for g in range(3)] == [[1, 1], [1, 2], [0]]  # shards 0 3 | 1 4 | 2
    assert [list(got[g]["cursors"]["skip"]) for g in range(3)] == [[0, 0], [7, 0], [4]]
    assert [[len(p["tokens"]) for p in got[g]["pending"]] for g in range(3)] == [[5, 4], [3], [2]]
    assert [got[g]["mix_tokens"] for g in range(3)] == [6, 6, 5]  # 17 tokens shared out
    assert [out[g]["counters"]["skipped_empty"] for g in range(3)] == [3, 0, 0]
    assert [out[g]["corrupt_shards_found"] for g in range(3)] == [[], ["s1.tar", "s4.tar"], []]


def test_relayout_gives_a_corrupt_shard_to_its_owner_within_its_source():
    """Sources text (a0 a1 a2) and mm (b0 b1), one group re-split over two: each source's shards are dealt on their
    own (text a0 a2 | a1, mm b0 | b1), so the corrupt a2 goes to group 0 and b1 to group 1 -- not by their places
    in one list of all five shards (b1 the fifth: group 0) -- and each group counts the one it was given."""
    sources = default_sources(["a0.tar", "a1.tar", "a2.tar"], ["b0.tar", "b1.tar"], [1, 1])

    def source(tag, n):
        return {"tag": tag, "cursors": {"epoch": np.zeros(n, np.int32), "skip": np.zeros(n, np.int32)},
                "shards_sha": None, "mix_tokens": 0, "buffer": [], "pending": []}

    group = {"weights": {"text": 1, "mm": 1}, "counters": {**Counters().as_dict(), "corrupt_shards": 2},
             "corrupt_shards_found": ["a2.tar", "b1.tar"], "sources": {"text": source(0, 3), "mm": source(1, 2)}}
    state = {"version": 3, "rank": 0, "world": 1, "num_workers": 1, "capacity": 9, "next_worker": 0,
             "worker_states": {0: group}}
    out = relayout([state], sources, 2, 9, seed=0)
    assert [out[g]["corrupt_shards_found"] for g in range(2)] == [["a2.tar"], ["b1.tar"]]
    assert [out[g]["counters"]["corrupt_shards"] for g in range(2)] == [1, 1]


def test_resplit_cuts_text_anywhere_and_keeps_image_spans_whole():
    """A piece of 2 text, a 6-position image span, 5 text (origin from position 7 of its document), cut for
    rows of 7: [2 text] [image, 1 text] [4 text] -- the span moves whole to the next piece, text fills what
    is left -- with origins 7-9, 9-16, 16-20; for rows of 5 the span does not fit: the piece is dropped and
    counted."""
    types = np.array([TEXT, TEXT, IMAGE_START, 1, 1, 2, 1, 3, TEXT, TEXT, TEXT, TEXT, TEXT])
    p = Piece(np.arange(13), types, [(b"img", "png")], 1, origin=("s.tar", "k", 2, 7, 20))
    got = resplit(p, 7, Counters())
    assert [(q.types.tolist(), q.tokens.tolist(), q.origin) for q in got] == [
        ([TEXT, TEXT], [0, 1], ("s.tar", "k", 2, 7, 9)),
        ([IMAGE_START, 1, 1, 2, 1, 3, TEXT], [2, 3, 4, 5, 6, 7, 8], ("s.tar", "k", 2, 9, 16)),
        ([TEXT] * 4, [9, 10, 11, 12], ("s.tar", "k", 2, 16, 20))]
    assert [q.images for q in got] == [[], [(b"img", "png")], []] and all(q.stream == 1 for q in got)
    counters = Counters()
    assert resplit(p, 5, counters) == [] and counters.skipped_oversized_image == 1
    assert resplit(p, 13, counters) == [p]


def test_a_version_2_position_reads_on_as_before():
    """A state of before the cursors (epoch 1, position 2 of the epoch's order, 3 samples into that shard)
    means: the first two shards of the order done in epoch 1, the third read 3 samples in, the rest not yet;
    the order is the one the version-2 stream drew, `random.Random(seed/tag/epoch).shuffle`."""
    order = list(range(5))
    random.Random("7/3/2/1").shuffle(order)
    got = cursors_of_state_v2({"epoch": 1, "pos": 2, "skip": 3}, 5, "7/3", 2)
    want_epoch, want_skip = [1] * 5, [0] * 5
    want_epoch[order[0]] = want_epoch[order[1]] = 2
    want_skip[order[2]] = 3
    assert list(got["epoch"]) == want_epoch and list(got["skip"]) == want_skip
    stream = ShardStream([f"s{i}" for i in range(5)], 2, "7/3", Counters(), got)
    assert stream.epoch == 1 and stream._order == order  # the epoch and the order it read in


def test_a_resume_in_the_same_layout_continues_the_exact_batches(corpus):
    """The same readers, workers and rows: a loader restored from its own state gives the saved run's batches."""
    sources, _ = corpus
    cfg = DataConfig(seq_len=24, batch_size=2, pack_buffer=6, num_workers=0)
    straight = PackedLoader(cfg, SPEC, sources)
    for _ in range(7):
        next(straight)
    resumed = PackedLoader(cfg, SPEC, sources)
    resumed.load_state_dict(straight.state_dict())
    for _ in range(12):
        x, y = next(straight), next(resumed)
        assert x["trace"] == y["trace"] and (x["tokens"] == y["tokens"]).all()
