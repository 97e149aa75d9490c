"""Weighted data sources (data/sources.py, data/loader.py): the opening rule by hand, the token shares of
three sources over 200 batches, exact resume, a resume with changed weights, and the two-source default
against the batches of the loader before sources had names."""

import hashlib
import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from flashtrain.config.errors import DataError
from flashtrain.data.config import DataConfig, TokenSpec
from flashtrain.data.images import TEXT, ImageProcessorConfig
from flashtrain.data.loader import PackedLoader, Piece, WorkerPipeline, configured_sources
from flashtrain.data.shards import Document, write_shards
from flashtrain.data.sources import Source, default_sources, modality_weights

SPEC = TokenSpec(vocab_size=512, image_token_id=496,
                 image=ImageProcessorConfig(patch_size=14, downsample_ratio=3, max_n_token=64, min_pixels=84 * 84))
BOS = SPEC.bos_id


def _png(i):
    buf = io.BytesIO()
    Image.new("RGB", (40 + 7 * (i % 5), 30 + 5 * (i % 3)), (i * 37 % 256, 90, 200)).save(buf, format="PNG")
    return buf.getvalue()


# --- the two-source default is the loader of before ---------------------------------------------------
# sha256 of 40 batches (tokens, labels, token types, stream tokens, pixels) of the shards below, measured
# with the loader before data.sources (commit 31dd965), in the main process and with 2 workers
BEFORE_SOURCES = {0: "6690904d3ab68a4082df98ed677a34fd2f23e903f7b905ba3f5b835fd5dc9bd8",
                  2: "80232775209a7840a393dd02ca3ebb2496a55ad93e1bcecdea39a6ca90961333"}


@pytest.mark.parametrize("workers", [0, 2])
def test_the_two_source_default_gives_the_batches_of_the_loader_before_sources(tmp_path, workers):
    rng = np.random.default_rng(0)
    text = [Document([("text", rng.integers(3, 490, size=int(rng.integers(5, 80)), dtype=np.int32))])
            for _ in range(120)]
    mm = [Document([("image", _png(i), "png"), ("text", rng.integers(3, 490, size=int(rng.integers(2, 12)),
                                                                      dtype=np.int32))]) for i in range(30)]
    t = [str(tmp_path / e["path"]) for e in write_shards(text, tmp_path, "text", 15)]
    m = [str(tmp_path / e["path"]) for e in write_shards(mm, tmp_path, "mm", 5)]
    cfg = DataConfig(seq_len=32, batch_size=2, pack_buffer=8, num_workers=workers)
    loader = PackedLoader(cfg, SPEC, configured_sources(
        DataConfig(text_shards=[str(tmp_path / "text-*.tar")], mm_shards=[str(tmp_path / "mm-*.tar")])))
    assert [s.name for s in loader.sources] == ["text", "mm"] and [s.weight for s in loader.sources] == [7, 1]
    assert list(loader.sources[0].shards) == t and list(loader.sources[1].shards) == m
    h = hashlib.sha256()
    for _ in range(40):
        b = next(loader)
        for k in ("tokens", "labels", "token_types", "stream_tokens"):
            h.update(b[k].numpy().tobytes())
        for row in b["images"]:
            for img in row:
                h.update(img.numpy().tobytes())
    assert h.hexdigest() == BEFORE_SOURCES[workers]


# --- the opening rule ----------------------------------------------------------------------------------
def test_each_row_opens_with_the_source_furthest_behind_its_weight():
    """Three sources weighted 5 : 3 : 2 and one-row pieces (each row is one piece of 10 positions), no
    stream to refill from. Worked by hand: emitted tokens / weight, smallest first, ties to the earlier
    source: a (0/5) b (0/3) c (0/2) all 0 -> a; then b and c at 0 -> b; c -> c; a 10/5=2, b 10/3, c 10/2 -> a;
    a 20/5=4, b 3.33 -> b; a 4, b 6.67, c 5 -> a; a 6, b 6.67, c 5 -> c; a 6, b 6.67, c 10 -> a; ..."""
    sources = [Source(n, (), w, "text", n) for n, w in (("a", 5), ("b", 3), ("c", 2))]
    w = WorkerPipeline(DataConfig(seq_len=9, batch_size=1, pack_buffer=30), SPEC, sources, [[], [], []], seed="0")
    for s in range(3):
        w.buffers[s] = [Piece(np.full(10, 10 * s + i + 3, dtype=np.int64), np.full(10, TEXT), [], s) for i in range(9)]
    w.streams = [object()] * 3  # all three present; nothing to refill
    w._refill = lambda: None
    order = "".join("abc"[w.next_row()[0].stream] for _ in range(10))
    assert order == "abcabacaba"  # by hand, as in the docstring (continued the same way)
    assert w.mix_tokens == [50, 30, 20]  # 5 : 3 : 2 exactly after 10 rows


# --- three sources 5 : 3 : 2 ---------------------------------------------------------------------------
def _doc(source: int, i: int, rng) -> Document:
    """Document i of a source: [source tag, i // 100, i % 100] then random tokens, so a row's documents
    can be named (the three tokens after each BOS)."""
    head = np.array([400 + source, 3 + i // 100, 3 + i % 100], dtype=np.int32)
    return Document([("text", np.concatenate([head, rng.integers(3, 390, size=int(rng.integers(2, 50)),
                                                                 dtype=np.int32)]))])


@pytest.fixture(scope="module")
def three_sources(tmp_path_factory):
    """Sources web (text), code (text) and caps (multimodal), 5 : 3 : 2, in shards of their own."""
    root = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(1)
    sizes = {"web": 400, "code": 300, "caps": 120}
    for k, (name, n) in enumerate(sizes.items()):
        docs = [_doc(k, i, rng) for i in range(n)]
        if name == "caps":  # an image in front of every third caption
            docs = [Document([("image", _png(i), "png")] + d.segments) if i % 3 == 0 else d for i, d in enumerate(docs)]
        write_shards(docs, root, name, 40)
    return [{"name": "web", "shards": [str(root / "web-*.tar")], "weight": 5, "modality": "text"},
            {"name": "code", "shards": [str(root / "code-*.tar")], "weight": 3, "modality": "text"},
            {"name": "caps", "shards": [str(root / "caps-*.tar")], "weight": 2, "modality": "multimodal"}]


def _loader(entries, state=None, **over):
    cfg = DataConfig(**{"seq_len": 32, "batch_size": 2, "pack_buffer": 12, "sources": entries, **over})
    cfg.validate()
    return PackedLoader(cfg, SPEC, configured_sources(cfg), state=state)


def _shares(loader, batches: int) -> np.ndarray:
    n = np.zeros(len(loader.sources))
    for _ in range(batches):
        n += next(loader)["stream_tokens"].sum(0).numpy()
    return n / n.sum()


def _saved(loader) -> dict:
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("tokens", "labels", "token_types", "stream_tokens", "label_sources"))


def test_three_sources_5_3_2_hold_their_token_shares_and_resume_exactly(three_sources):
    loader = _loader(three_sources)
    shares = _shares(loader, 200)
    assert np.abs(shares - [0.5, 0.3, 0.2]).max() < 0.02, shares
    cfg = DataConfig(sources=three_sources)
    assert modality_weights(cfg) == (8, 2)  # the held-out set's text : multimodal shares
    state = _saved(loader)
    want = [next(loader) for _ in range(30)]
    resumed = _loader(three_sources, state=state)
    assert all(_same(x, next(resumed)) for x in want)
    # every label's source: the source whose piece holds the target position, also across a boundary,
    # where the label before a BOS targets the next document's first token (a source change is seen)
    changes = 0
    for b in want:
        for r in range(b["tokens"].shape[0]):
            starts = torch.nonzero(b["tokens"][r] == BOS).flatten().tolist()
            for at in starts:  # documents that open with their name token (400 + source; not an image)
                if at + 1 >= b["tokens"].shape[1] or not 400 <= int(b["tokens"][r, at + 1]) < 403:
                    continue
                own = int(b["tokens"][r, at + 1]) - 400
                assert int(b["label_sources"][r, at]) == own
                if at >= 2:
                    assert int(b["label_sources"][r, at - 1]) == own
                    changes += int(b["label_sources"][r, at - 2]) != own
    assert changes > 0  # some boundary joins two sources: the check above could fail


def _documents(batch) -> list[tuple[int, int]]:
    """(source, document index) of every document start in a batch (BOS + its three name tokens)."""
    out = []
    for row in batch["tokens"]:
        row = row.tolist()
        for at, t in enumerate(row[:-3]):
            if t == BOS and 400 <= row[at + 1] < 403:
                out.append((row[at + 1] - 400, (row[at + 2] - 3) * 100 + row[at + 3] - 3))
    return out


def test_a_resume_with_changed_weights_keeps_each_source_position_and_follows_the_new_weights(three_sources,
                                                                                              caplog):
    loader = _loader(three_sources)
    seen = [d for _ in range(40) for d in _documents(next(loader))]
    state = _saved(loader)
    even = [dict(e, weight=1) for e in three_sources]
    with caplog.at_level(logging.WARNING, logger="flashtrain.data.loader"):
        resumed = _loader(even, state=state)
    assert "data sources changed at this resume" in caplog.text and "'web': 5" in caplog.text
    shares = _shares(resumed, 200)
    assert np.abs(shares - 1 / 3).max() < 0.02, shares  # the new shares hold from the resume on
    again = _loader(even, state=state)
    after = [d for _ in range(40) for d in _documents(next(again))]
    # positions kept: no document of the first 40 batches comes again within an epoch, none is lost
    # (the caps source, 120 documents, is read past its first epoch in neither part)
    assert not set(seen) & set(after)
    for s in range(3):
        got = sorted(i for src, i in seen + after if src == s)
        assert got == sorted(set(got))


def test_a_source_added_or_removed_at_a_resume(three_sources, caplog):
    loader = _loader(three_sources[:2])
    for _ in range(10):
        next(loader)
    state = _saved(loader)
    with caplog.at_level(logging.WARNING, logger="flashtrain.data.loader"):
        grown = _loader(three_sources, state=state)
    assert "added (from their start): caps" in caplog.text
    assert np.abs(_shares(grown, 100) - [0.5, 0.3, 0.2]).max() < 0.03
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashtrain.data.loader"):
        shrunk = _loader(three_sources[:1], state=state)
    assert "removed: code" in caplog.text
    assert _shares(shrunk, 5).tolist() == [1.0]


@pytest.mark.parametrize("over, match", [
    ({"sources": [{"name": "a", "shards": ["x"]}], "text_shards": ["y"]}, "data.sources and data.text_shards"),
    ({"sources": [{"name": "a", "shards": ["x"]}], "mix": [1, 1]}, "leave data.mix null"),
    ({"sources": [{"name": "a", "shards": ["x"]}, {"name": "a", "shards": ["y"]}]}, "a appear more than once"),
    ({"sources": [{"name": "a", "shards": ["x"], "weight": 0}]},
     r"data.sources\[a\].weight=0: must be a positive number"),
    ({"sources": [{"name": "a", "shards": "x"}]}, r"data.sources\[a\].shards='x': give a list"),
    ({"sources": [{"name": "a b", "shards": ["x"]}]}, "name='a b'"),
    ({"sources": [{"name": "a", "shards": ["x"], "modality": "image"}]}, "must be one of text, multimodal"),
    ({"sources": [{"name": "a", "shard": ["x"]}]}, "did you mean 'shards'"),
    ({"sources": []}, "give a non-empty list"),
])
def test_bad_sources_are_one_line_errors_naming_the_entry(over, match):
    from flashtrain.config.errors import ConfigError

    with pytest.raises((DataError, ConfigError), match=match) as e:
        DataConfig(**over).validate()
    assert "\n" not in str(e.value)


def test_a_source_pattern_that_matches_nothing_names_the_source(tmp_path):
    cfg = DataConfig(sources=[{"name": "web", "shards": [str(tmp_path / "nope-*.tar")]}])
    with pytest.raises(FileNotFoundError, match=r"data.sources\[web\].shards: .* matches no shard"):
        configured_sources(cfg)


def test_default_sources_weights_and_names():
    s = default_sources(["b.tar", "a.tar"], [], [3, 1])
    assert [(x.name, x.shards, x.weight, x.modality) for x in s] == [("text", ("a.tar", "b.tar"), 3, "text"),
                                                                     ("mm", (), 1, "multimodal")]


def test_a_reordered_source_list_reads_every_source_on_in_its_own_order(three_sources, monkeypatch):
    """A source's epochs are shuffled by the index it had when its stream began (kept in the state), so a
    resume with the list reordered opens each source's shards in the order the unchanged list would."""
    import flashtrain.data.loader as L

    real = L.read_shard

    def opened(loader, batches=200):
        log = []
        monkeypatch.setattr(L, "read_shard", lambda path, stats, skip=0: (log.append(path), real(path, stats, skip))[1])
        for _ in range(batches):
            next(loader)
        monkeypatch.setattr(L, "read_shard", real)
        names = ("web", "code", "caps")
        return {name: [p for p in log if p.rsplit("/", 1)[1].startswith(name + "-")] for name in names}

    loader = _loader(three_sources)
    for _ in range(20):
        next(loader)
    state = _saved(loader)
    straight = opened(loader)
    reordered = opened(_loader(three_sources[::-1], state=state))
    for name in straight:
        a, b = straight[name], reordered[name][1:]  # the resumed stream first re-opens its current shard
        n = min(len(a), len(b))
        assert n >= 2 and a[:n] == b[:n], name
