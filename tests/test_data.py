"""The data pipeline (DESIGN.md "Data", data/README.md): tokenizer, shards, default corpus, split,
mixing, packing, resumable state, bad input."""

import dataclasses
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flashtrain.data.config import DataConfig, TokenSpec
from flashtrain.data.images import ImageProcessorConfig
from flashtrain.data.loader import (
    Counters,
    PackedLoader,
    ShardStream,
    data_sources,
    document_pieces,
    heldout_shards,
    split_shards,
)
from flashtrain.data.shards import Document, ReadStats, read_shard, write_shards
from flashtrain.data.sources import default_sources
from flashtrain.data.tokenizer import IMAGE_TOKEN, train_tokenizer

pytestmark = pytest.mark.xdist_group("data")  # its module-scoped reference runs are shared

SPEC = TokenSpec(vocab_size=512, image_token_id=496,
                 image=ImageProcessorConfig(patch_size=14, downsample_ratio=3, max_n_token=64, min_pixels=84 * 84))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    cfg = DataConfig(seq_len=128, batch_size=4, corpus_dir=str(tmp_path_factory.mktemp("corpus")),
                     corpus_text_bytes=1_500_000, corpus_mm_docs=800, corpus_shards=8)
    sources, tok = data_sources(cfg, SPEC)
    assert [s.name for s in sources] == ["text", "mm"]
    return cfg, list(sources[0].shards), list(sources[1].shards), tok


def _png(w=60, h=30, color=(10, 200, 30)):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def _batches_equal(a, b):
    for k in ("tokens", "labels", "token_types", "stream_tokens"):
        if not torch.equal(a[k], b[k]):
            return False
    return a["pad_tokens"] == b["pad_tokens"] and all(
        len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y)) for x, y in zip(a["images"], b["images"]))


def test_tokenizer_round_trip_and_reserved_ids():
    texts = ["def f(x):\n    return x + 1\n", "héllo wörld — ünïcode ✓", "the quick brown fox"] * 50
    tok = train_tokenizer(texts, SPEC)
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>")] == [0, 1, 2]
    assert tok.token_to_id(IMAGE_TOKEN) == 496
    for t in texts[:3] + ["unseen ∆ text\twith tabs"]:
        ids = tok.encode(t, add_special_tokens=False).ids
        assert tok.decode(ids) == t
        assert 496 not in ids and not {0, 1, 2} & set(ids)


def test_default_corpus_builds_and_is_cached(corpus, tmp_path):
    cfg, text, mm, tok = corpus
    assert len(text) == 8 and len(mm) == 8
    stats = ReadStats()
    doc = next(read_shard(mm[0], stats))
    kinds = [s[0] for s in doc.segments]
    assert kinds == ["image", "text"]
    Image.open(io.BytesIO(doc.segments[0][1])).verify()
    again = data_sources(cfg, SPEC)
    assert again == (default_sources(text, mm), tok)  # the cache is reused


def test_default_corpus_holds_out_text_training_never_reads(corpus):
    """The held-out part (data.val_shards null): text documents none of which is a training document,
    and images rendered from them."""
    cfg, text, mm, _ = corpus
    val = heldout_shards(cfg, SPEC)
    assert [Path(v).name for v in val] == ["val-text-00000.tar", "val-mm-00000.tar"]
    stats = ReadStats()

    def texts(shards):
        return {bytes(np.asarray(seg[1], np.int32)) for sh in shards for d in read_shard(sh, stats) if d
                for seg in d.segments if seg[0] == "text"}

    held, train = texts(val[:1]), texts(text)
    assert len(held) >= 5 and len(train) >= 20 and not held & train
    assert sum(len(t) for t in held) >= 4 * cfg.corpus_val_text_bytes // 10  # bytes of int32 ids: ~1 per 2-4 chars
    assert all(d.segments[0][0] == "image" for d in read_shard(val[1], stats))


def prepare_data(*argv: str) -> None:
    """launch/prepare_data.py in this process, as its command line runs it; it must exit 0."""
    import runpy
    import sys

    old = sys.argv
    sys.argv = ["prepare_data.py", *argv]
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path("launch/prepare_data.py", run_name="__main__")
        assert e.value.code == 0
    finally:
        sys.argv = old


def test_inputs_stream_compressed_jsonl_and_parquet_and_count_what_they_skip(tmp_path):
    """data/inputs.py: .jsonl.gz / .jsonl.zst / .parquet documents in order, the unusable ones counted by
    reason; a truncated .gz gives its first documents before the damage is found (it is read as a stream,
    not whole), and launch/prepare_data.py writes the same documents and reports the skips."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from flashtrain.data.inputs import InputStats, iter_texts, text_files

    src = tmp_path / "src"
    src.mkdir()
    lines = [json.dumps({"text": "gz one"}), "not json", json.dumps({"text": "gz two"}), json.dumps({"id": 3})]
    (src / "a.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    (src / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        (json.dumps({"text": "zst one"}) + "\n" + json.dumps({"text": 7}) + "\n").encode()))
    pq.write_table(pa.table({"text": ["pq one", None, "pq two", "  "], "n": [1, 2, 3, 4]}), src / "c.parquet")
    stats = InputStats()
    assert list(iter_texts(text_files([str(src)]), False, stats)) == ["gz one", "gz two", "zst one", "pq one", "pq two"]
    assert stats.documents == 5 and dict(stats.skipped) == {
        "not JSON": 1, "no text field": 1, "text field not a string": 1,
        "parquet row whose text is not a string": 1, "empty document": 1}
    assert stats.named == {"not JSON": [f"{src}/a.jsonl.gz:2"], "no text field": [f"{src}/a.jsonl.gz:4"],
                           "text field not a string": [f"{src}/b.jsonl.zst:2"],
                           "parquet row whose text is not a string": [f"{src}/c.parquet:row 2"],
                           "empty document": [f"{src}/c.parquet:row 4"]}

    rng = np.random.default_rng(0)  # incompressible text: the cut falls well inside the documents
    texts = ["".join(rng.choice(list("abcdefghij"), 60)) for _ in range(20000)]
    many = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(many)[:60000])  # the end of the stream is gone
    cut = InputStats()
    docs = iter_texts([tmp_path / "cut.jsonl.gz"], False, cut)
    assert next(docs) == texts[0]
    rest = list(docs)
    assert 100 < len(rest) < 19999 and cut.skipped == {"rest of a truncated or corrupt file": 1}
    # named at the line where reading stopped: the first one after the 1 + len(rest) documents read whole
    assert cut.named == {"rest of a truncated or corrupt file": [f"{tmp_path / 'cut.jsonl.gz'}:{len(rest) + 2}"]}

    out = tmp_path / "shards"
    prepare_data(str(out), "+exp=flash_tiny", "--text", str(src))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["totals"]["text"]["documents"] == 5 and manifest["skipped_documents"] == 5
    assert manifest["skipped"]["text"] == dict(stats.skipped)


def test_prepare_then_load_round_trip(tmp_path):

    src = tmp_path / "src"
    (src / "imgs").mkdir(parents=True)
    (src / "a.txt").write_text("first document about parsing\nsecond line")
    (src / "b.jsonl").write_text(json.dumps({"text": "a json document"}) + "\n"
                                 + json.dumps({"text": "another one"}) + "\n")
    (src / "imgs" / "cat.png").write_bytes(_png())
    (src / "imgs" / "cat.txt").write_text("a green box")
    (src / "inter.jsonl").write_text(json.dumps({"segments": [{"text": "look:"}, {"image": "imgs/cat.png"},
                                                              {"text": "it is green"}]}) + "\n")
    out = tmp_path / "shards"
    argv = [str(out), "+exp=flash_tiny", "--text", str(src / "a.txt"), str(src / "b.jsonl"),
            "--images", str(src / "imgs"), "--interleaved", str(src / "inter.jsonl"), "--docs-per-shard", "2"]
    prepare_data(*argv)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["totals"]["text"]["documents"] == 3 and manifest["totals"]["mm"]["documents"] == 2
    # what the shards were written for, named when a run of another model finds them (issue 47 item 1)
    assert manifest["written_for"] == {"overrides": ["+exp=flash_tiny"], "model": "flash_tiny", "vocab_size": 512}
    # 60 x 30 px -> upscaled to >= 84^2 px: x1.98 -> 118 x 59 -> rounded up to 126 x 70 (9 x 5 patches) ->
    # 3 x 2 image tokens -> 2 * (3 + 1) + 2 = 10 positions, per image
    assert manifest["totals"]["mm"]["images"] == 2 and manifest["totals"]["mm"]["image_positions"] == 2 * 10
    emap = json.loads((out / "engram_map.json").read_text())
    assert len(emap["map"]) == 512
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    stats = ReadStats()
    texts = [tok.decode(d.segments[0][1].tolist())
             for p in sorted(out.glob("text-*.tar")) for d in read_shard(str(p), stats)]
    assert texts == ["first document about parsing\nsecond line", "a json document", "another one"]
    mm_docs = [d for p in sorted(out.glob("mm-*.tar")) for d in read_shard(str(p), stats)]
    inter = mm_docs[1]
    assert [s[0] for s in inter.segments] == ["text", "image", "text"]
    assert inter.segments[1][1] == _png() and tok.decode(inter.segments[2][1].tolist()) == "it is green"

    cfg = DataConfig(seq_len=64, batch_size=2, text_shards=[str(out / "text-*.tar")], mm_shards=[str(out / "mm-*.tar")])
    sources, tokp = data_sources(cfg, SPEC)
    batch = next(PackedLoader(cfg, SPEC, sources))
    for b in range(2):
        types = batch["token_types"][b]
        assert int((types == 0).sum()) == len(batch["images"][b])  # one START per image in the row
        assert int((types == 1).sum()) == 6 * len(batch["images"][b])  # 3 x 2 IMAGE tokens each
    assert sum(len(r) for r in batch["images"]) >= 1
    labels, tokens, types = batch["labels"], batch["tokens"], batch["token_types"]
    assert (labels[:, :-1][types[:, 1:] >= 0] == -100).all()  # no loss on predicting image positions
    assert (labels[:, :-1][tokens[:, 1:] == SPEC.pad_id] == -100).all()  # nor on padding
    keep = labels[:, :-1] != -100
    assert keep.any() and torch.equal(labels[:, :-1][keep], tokens[:, 1:][keep])  # labels are the next tokens


def test_split_covers_every_document_once_over_2_ranks_x_2_workers(tmp_path):
    docs = [Document([("text", np.array([3 + i] * 5, dtype=np.int32))]) for i in range(203)]
    entries = write_shards(docs, tmp_path, "text", 9)
    shards = [str(tmp_path / e["path"]) for e in entries]
    seen = []
    for rank in range(2):
        for worker in range(2):
            mine = split_shards(shards, rank, 2, worker, 2)
            assert mine
            stream = ShardStream(mine, 0, "0/x", Counters())
            assert mine == split_shards(shards, 0, 1, rank * 2 + worker, 4)  # the same group in a 1 x 4 layout
            n = sum(e["documents"] for e in entries if str(tmp_path / e["path"]) in mine)
            seen += [int(stream.next_document()[0].segments[0][1][0]) for _ in range(n)]
            counts = {str(tmp_path / e["path"]): e["documents"] for e in entries}
            assert stream.epoch == 0 and all(  # every shard done, or its every sample read (its end not yet seen)
                (e, k) in ((1, 0), (0, counts[sh])) for sh, e, k in zip(mine, stream.epochs, stream.skips))
    assert sorted(seen) == [3 + i for i in range(203)]


def test_mix_ratio_and_padding_on_the_default_corpus(corpus):
    cfg, text, mm, _ = corpus
    loader = PackedLoader(cfg, SPEC, default_sources(text, mm))
    st = torch.zeros(2, dtype=torch.long)
    for _ in range(75):  # 300 sequences
        st += next(loader)["stream_tokens"].sum(0)
    ratio = st[0].item() / st[1].item()
    assert abs(ratio / 7 - 1) < 0.05, ratio
    c = loader.counters()
    assert c["rows"] == 300 and c["pad_tokens"] / c["tokens"] < 0.01, c


def _advanced_and_saved(cfg, text, mm, batches=7):
    """A loader `batches` batches into the stream, and its state after a round trip through torch.save."""
    a = PackedLoader(cfg, SPEC, default_sources(text, mm))
    for _ in range(batches):
        next(a)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    return a, torch.load(buf, weights_only=False)


@pytest.mark.parametrize("workers", [0, 2])
def test_restore_mid_stream_reproduces_the_next_batches(corpus, workers, monkeypatch):
    cfg, text, mm, _ = corpus
    cfg = dataclasses.replace(cfg, num_workers=workers)
    a, state = _advanced_and_saved(cfg, text, mm)
    want = [next(a) for _ in range(4)]

    if workers:
        b = PackedLoader(cfg, SPEC, default_sources(text, mm), state=state)
        assert all(_batches_equal(x, next(b)) for x in want)
        return
    # in-process: also check which shards the restored loader opens, against an uninterrupted twin
    import flashtrain.data.loader as L

    real = L.read_shard

    def opened_by(loader):
        log = []
        monkeypatch.setattr(L, "read_shard", lambda path, stats, skip=0: (log.append((path, skip)),
                                                                            real(path, stats, skip))[1])
        batches = [next(loader) for _ in range(4)]
        monkeypatch.setattr(L, "read_shard", real)
        return batches, log

    twin = PackedLoader(cfg, SPEC, default_sources(text, mm))
    for _ in range(7):
        next(twin)
    _, straight = opened_by(twin)
    got, restored = opened_by(PackedLoader(cfg, SPEC, default_sources(text, mm), state=state))
    assert all(_batches_equal(x, y) for x, y in zip(want, got))
    extra = [o for o in restored if o not in straight]
    assert len(extra) <= 2  # at most the current shard of each stream is re-read ...
    assert any(skip > 0 for _, skip in extra)  # ... from the saved position, skipping consumed documents


def _piece_keys(worker_state):
    """The pieces a worker holds (packing buffers and split-document queues), as comparable keys."""
    held = [(name, p) for name, s in worker_state["sources"].items() for p in s["buffer"] + s["pending"]]
    return {(name, np.asarray(p["tokens"]).tobytes(), np.asarray(p["types"]).tobytes()) for name, p in held}


def test_restore_reproduces_batches_until_every_saved_piece_has_drained(corpus):
    """The packing buffer holds `pack_buffer` pieces (plus the rest of split documents), several
    batches' worth: a restore that lost or reordered one would only show once that piece is due. So
    compare the restored loader with the uninterrupted one for as long as any piece held at the save
    is still held, then one batch more."""
    cfg, text, mm, _ = corpus
    a, state = _advanced_and_saved(cfg, text, mm)
    saved = _piece_keys(state["worker_states"][0])
    assert len(saved) >= cfg.pack_buffer
    b = PackedLoader(cfg, SPEC, default_sources(text, mm), state=state)
    rows_bound = 4 * len(saved) * max(cfg.mix) // min(cfg.mix)  # each row opens with a held piece of one stream
    batches = 0
    while saved & _piece_keys(a.worker_states[0]):
        assert _batches_equal(next(a), next(b)), f"batch {batches + 1} after the restore differs"
        batches += 1
        assert batches * cfg.batch_size <= rows_bound, "saved pieces never drained"
    assert _batches_equal(next(a), next(b))
    assert batches > 4  # longer than a fixed look-ahead of 4 batches would check


def test_bad_input_is_skipped_and_counted(tmp_path):
    good = [Document([("text", np.arange(3, 40, dtype=np.int32))]) for _ in range(30)]
    bad_image = Document([("image", b"not an image at all", "png"), ("text", np.array([5, 6], dtype=np.int32))])
    empty = Document([("text", np.zeros(0, dtype=np.int32))])
    ok_image = Document([("image", _png(), "png"), ("text", np.array([7, 8, 9], dtype=np.int32))])
    mm_docs = [bad_image, empty, ok_image] * 5
    text = [str(tmp_path / e["path"]) for e in write_shards(good, tmp_path, "text", 10)]
    mm = [str(tmp_path / e["path"]) for e in write_shards(mm_docs, tmp_path, "mm", 5)]
    # truncate one text shard mid-member and write garbage into another's json
    raw = open(text[0], "rb").read()
    open(text[0], "wb").write(raw[: len(raw) // 2 + 100])
    with tarfile.open(text[1], "w") as t:
        for name, data in (("000000001.json", b"{broken"), ("000000001.tokens.npy", b"xx")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    cfg = DataConfig(seq_len=32, batch_size=2)
    loader = PackedLoader(cfg, SPEC, default_sources(text, mm))
    for _ in range(20):
        b = next(loader)
        assert b["tokens"].shape == (2, 32)
    c = loader.counters()
    assert c["corrupt_shards"] >= 1 and c["bad_samples"] >= 1
    assert c["skipped_bad_image"] >= 1 and c["skipped_empty"] >= 1
    # a resume carries every counter, the bad samples and the corrupt shards too: a batch later, the resumed loader
    # counts what the uninterrupted one does
    resumed = PackedLoader(cfg, SPEC, default_sources(text, mm), state=loader.state_dict())
    assert resumed.counters() == c
    next(loader), next(resumed)
    assert resumed.counters() == loader.counters()
    with pytest.raises(FileNotFoundError, match="matches no shard"):
        data_sources(DataConfig(text_shards=[str(tmp_path / "nope-*.tar")]), SPEC)


def test_each_document_is_counted_once_as_read_or_under_its_skip():
    """Five documents cut for rows of 9 positions: two of text (read: documents 2), an empty one (skipped_empty),
    one whose image cannot be decoded (skipped_bad_image) and one whose image span -- 10 positions for the 60 x 30
    PNG, 2 x 3 tokens and their markers -- exceeds the row (skipped_oversized_image): each counted once, under its
    one key. With rows of 16 the same image fits and its document is read."""
    text = Document([("text", np.arange(3, 8, dtype=np.int32))])
    empty = Document([("text", np.zeros(0, dtype=np.int32))])
    bad_image = Document([("image", b"not an image at all", "png"), ("text", np.array([5, 6], dtype=np.int32))])
    big_image = Document([("image", _png(), "png"), ("text", np.array([7, 8], dtype=np.int32))])
    c = Counters()
    pieces = [document_pieces(d, SPEC, 9, 0, c) for d in (text, empty, bad_image, big_image, text)]
    assert [len(p) > 0 for p in pieces] == [True, False, False, False, True]
    assert c.as_dict() == {"documents": 2, "skipped_empty": 1, "skipped_bad_image": 1, "skipped_oversized_image": 1,
                           "rows": 0, "pad_tokens": 0, "tokens": 0, "corrupt_shards": 0, "bad_samples": 0}
    assert document_pieces(big_image, SPEC, 16, 0, c)
    assert (c.documents, c.skipped_oversized_image) == (3, 1)


def test_one_rank_two_workers_reads_what_two_ranks_one_worker_read(tmp_path):
    """Reader groups, not ranks, own shards and seeds: 1 rank x 2 workers yields, alternately, exactly the
    batches of rank 0 and rank 1 of a 2 x 1 layout (what makes data-parallel parity possible)."""
    docs = [Document([("text", np.arange(3 + i, 3 + i + 20, dtype=np.int32) % 490 + 3)]) for i in range(60)]
    shards = [str(tmp_path / e["path"]) for e in write_shards(docs, tmp_path, "text", 5)]  # 12 small shards
    base = DataConfig(seq_len=16, batch_size=2, pack_buffer=4)
    one = PackedLoader(dataclasses.replace(base, num_workers=2), SPEC, default_sources(shards, []))
    ranks = [PackedLoader(base, SPEC, default_sources(shards, []), rank=r, world=2) for r in range(2)]
    for i in range(24):  # several epochs of each group's 6 shards
        assert _batches_equal(next(one), next(ranks[i % 2])), i


def test_prepare_data_writes_named_sources_that_data_sources_reads(tmp_path, capsys):
    """`--name SOURCE`: SOURCE-NNNNN.tar and a manifest entry per source; a second source written into the
    same directory keeps the first and its tokenizer; the printed entry goes into data.sources as is."""
    src = tmp_path / "src"
    (src / "imgs").mkdir(parents=True)
    (src / "web.txt").write_text("".join(f"web page number {i} about the weather\n" for i in range(30)))
    (src / "code.txt").write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(30)))
    (src / "imgs" / "cat.png").write_bytes(_png())
    (src / "imgs" / "cat.txt").write_text("a green box")
    out = tmp_path / "shards"
    prepare_data(str(out), "+exp=flash_tiny", "--text", str(src / "web.txt"), "--lines", "--name", "web",
                 "--docs-per-shard", "10")
    tokenizer = (out / "tokenizer.json").read_bytes()
    prepare_data(str(out), "+exp=flash_tiny", "--text", str(src / "code.txt"), "--images", str(src / "imgs"),
                 "--name", "code")
    printed = capsys.readouterr().out.strip().splitlines()
    assert (out / "tokenizer.json").read_bytes() == tokenizer  # the directory's tokenizer, reused
    assert sorted(p.name for p in out.glob("*.tar")) == ["code-00000.tar", "web-00000.tar", "web-00001.tar",
                                                         "web-00002.tar"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["sources"]) == ["web", "code"]
    assert manifest["written_for"] == {"overrides": ["+exp=flash_tiny"], "model": "flash_tiny", "vocab_size": 512}
    assert manifest["sources"]["web"]["totals"]["documents"] == 30 and manifest["sources"]["web"]["modality"] == "text"
    assert manifest["sources"]["code"]["modality"] == "multimodal"  # an image-caption document among them
    entry = json.loads(printed[-1])["source"]
    assert entry == {"name": "code", "shards": [str(out.resolve() / "code-*.tar")], "weight": 1,
                     "modality": "multimodal"}
    web = {"name": "web", "shards": [str(out / "web-*.tar")], "weight": 3}
    cfg = DataConfig(seq_len=32, batch_size=2, sources=[web, dict(entry)])
    cfg.validate()
    sources, tok = data_sources(cfg, SPEC)
    assert [s.name for s in sources] == ["web", "code"] and tok == str(out / "tokenizer.json")
    batch = next(PackedLoader(cfg, SPEC, sources))
    assert batch["stream_tokens"].shape == (2, 2) and int(batch["stream_tokens"].sum()) > 0


def test_shards_written_for_another_model_are_refused_at_start(tmp_path):
    """Issue 47 item 1: shards tokenized for another exp (another vocabulary, other special ids) are refused by
    the start-up check, before any process group or model exists, with one line naming the tokenizer, both
    vocabularies and the exp the shards were written with (manifest.json `written_for`); the same shards with
    the model's own tokenizer pass."""
    from flashtrain.config.errors import DataError
    from flashtrain.data.loader import check_sources

    texts = ["def f(x):\n    return x + 1\n", "the quick brown fox jumps"] * 20
    folder = tmp_path / "shards"
    write_shards(iter([Document([("text", np.arange(3, 40, dtype=np.int32))])] * 4), folder, "text", 2)
    cfg = DataConfig(seq_len=16, batch_size=1, text_shards=[str(folder / "text-*.tar")], mm_shards=[])
    other = dataclasses.replace(SPEC, vocab_size=640, image_token_id=600)  # another exp's vocabulary
    train_tokenizer(texts, other).save(str(folder / "tokenizer.json"))
    (folder / "manifest.json").write_text(json.dumps({"tokenizer": "tokenizer.json", "written_for": {
        "overrides": ["+exp=flash_small", "model.dim=96"], "model": "flash_small", "vocab_size": 640}}))
    with pytest.raises(DataError) as refused:
        check_sources(cfg, 1, SPEC)
    assert str(refused.value) == (
        f"the tokenizer beside the shards {folder / 'tokenizer.json'} does not fit this run's model (640 ids, the "
        f"model has model.vocab_size=512): the shards were written with launch/prepare_data.py +exp=flash_small "
        f"model.dim=96; write them again with this run's +exp and model overrides (python launch/prepare_data.py "
        f"OUT_DIR +exp=NAME --text ...), or train with +exp=flash_small model.dim=96")
    # the same vocabulary with the image token elsewhere, named by data.tokenizer, and no manifest record
    moved = dataclasses.replace(SPEC, image_token_id=500)
    train_tokenizer(texts, moved).save(str(tmp_path / "moved.json"))
    (folder / "manifest.json").write_text(json.dumps({"tokenizer": "tokenizer.json"}))
    with pytest.raises(DataError) as refused:
        check_sources(dataclasses.replace(cfg, tokenizer=str(tmp_path / "moved.json")), 1, SPEC)
    assert str(refused.value).startswith(
        f"data.tokenizer {tmp_path / 'moved.json'} does not fit this run's model (<|image|> at 500, the model has "
        f"<|image|> at 496): the shards were written for another model config; write them again")
    train_tokenizer(texts, SPEC).save(str(folder / "tokenizer.json"))  # the model's own: the start goes on
    check_sources(cfg, 1, SPEC)
