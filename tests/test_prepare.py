"""launch/prepare_data.py as a new user meets it (issue 32 item 3): every skipped input counted by reason and
named where it is, on stderr, in the closing summary and in manifest.json; the caption requirement checked
up front; image errors that name the file; and the loader's tokenizer found from the shard folders' own
manifests, or an error naming the choice."""

import io
import json
import runpy
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from flashtrain.config.errors import DataError
from flashtrain.data.config import DataConfig
from flashtrain.data.loader import data_sources
from flashtrain.train.config import compose, model_config, token_spec

SPEC = token_spec(model_config(compose(["+exp=flash_tiny"])))


def run_prepare(*argv: str) -> int:
    """launch/prepare_data.py in this process, as its command line runs it; its exit status."""
    old = sys.argv
    sys.argv = ["prepare_data.py", *argv]
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path("launch/prepare_data.py", run_name="__main__")
        return e.value.code
    finally:
        sys.argv = old


def png(width: int = 60, height: int = 30, seed: int = 0) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)  # incompressible
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_every_skipped_input_is_counted_by_reason_and_named(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "imgs").mkdir(parents=True)
    a = src / "a.jsonl"
    a.write_text("\n".join([json.dumps({"text": "the first document"}), json.dumps({"id": 7, "body": "no text"}),
                            '{"text": "cut off', json.dumps({"text": "the second document"})]) + "\n")
    (src / "imgs" / "cat.png").write_bytes(png())
    (src / "imgs" / "cat.txt").write_text("a noisy box")
    cut = src / "imgs" / "cut.png"
    cut.write_bytes(png(seed=1)[:2000])  # the header reads, the pixels end early
    (src / "imgs" / "cut.txt").write_text("half a box")
    lone = src / "imgs" / "lone.png"
    lone.write_bytes(png(seed=2))  # no lone.txt
    out = tmp_path / "out"
    assert run_prepare(str(out), "+exp=flash_tiny", "--text", str(a), "--images", str(src / "imgs")) == 0
    printed = capsys.readouterr()

    counts = {"text": {"no text field": 1, "not JSON": 1}, "mm": {"image undecodable": 1, "image without a caption": 1}}
    where = {"text": {"no text field": [f"{a}:2"], "not JSON": [f"{a}:3"]},
             "mm": {"image undecodable": [str(cut)], "image without a caption": [str(lone)]}}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"] == counts and manifest["skipped_where"] == where and manifest["skipped_documents"] == 4
    assert manifest["totals"]["text"]["documents"] == 2 and manifest["totals"]["mm"]["documents"] == 1
    last = json.loads(printed.out.strip().splitlines()[-1])
    assert last["skipped"] == counts and last["skipped_where"] == where
    # the closing summary names them; stderr reports each as found, the caption check before any work
    for line in (f"text, no text field: {a}:2", f"text, not JSON: {a}:3", f"mm, image undecodable: {cut}",
                 f"mm, image without a caption: {lone}"):
        assert line in printed.out, printed.out
    err = printed.err
    assert f"1 of 3 images have no caption (NAME.txt beside NAME.png) and are skipped: {lone}" in err
    assert err.index("have no caption") < err.index(f"skipping {a}:2: no text field (keys: id, body)")
    assert f"skipping {a}:3: not JSON (" in err and f"skipping {cut}: image undecodable (cannot decode image" in err
    assert "BytesIO" not in err + printed.out


def test_the_caption_requirement_is_checked_up_front(tmp_path, capsys):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png())
    assert run_prepare(str(tmp_path / "out"), "+exp=flash_tiny", "--images", str(tmp_path / "imgs")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --images {tmp_path / 'imgs'}: none of its 1 images has a caption; write each image's "
                   f"caption into a .txt of the same name beside it (a.png -> a.txt), or give images with their text "
                   f"as --interleaved"]
    assert not (tmp_path / "out").exists()  # nothing written


def test_the_tokenizer_comes_from_the_shard_folders_manifests(tmp_path):
    """Shards from two folders: the tokenizer their manifests name (not whatever sits beside the first
    shard of the list); different tokenizers are an error naming both; the same one is fine."""
    (tmp_path / "a.txt").write_text("".join(f"alpha beta gamma document {i}\n" for i in range(40)))
    (tmp_path / "b.txt").write_text("".join(f"zeta eta theta {i} other words\n" for i in range(40)))
    a, b = tmp_path / "A", tmp_path / "B"
    assert run_prepare(str(a), "+exp=flash_tiny", "--text", str(tmp_path / "a.txt"), "--lines") == 0
    assert run_prepare(str(b), "+exp=flash_tiny", "--text", str(tmp_path / "b.txt"), "--lines") == 0
    other = tmp_path / "copied"  # shards copied without their tokenizer: listed first
    other.mkdir()
    shutil.copy(next(a.glob("text-*.tar")), other / "text-00009.tar")

    cfg = DataConfig(seq_len=32, text_shards=[str(other / "*.tar"), str(a / "text-*.tar")], mm_shards=[])
    assert data_sources(cfg, SPEC)[1] == str(a / "tokenizer.json")
    cfg = DataConfig(seq_len=32, text_shards=[str(a / "text-*.tar"), str(b / "text-*.tar")], mm_shards=[])
    with pytest.raises(DataError) as e:
        data_sources(cfg, SPEC)
    assert str(e.value).startswith(f"the shards come from folders with different tokenizers ({a / 'tokenizer.json'}, "
                                   f"{b / 'tokenizer.json'}): ")
    assert "set data.tokenizer" in str(e.value)
    shutil.rmtree(b)
    assert run_prepare(str(b), "+exp=flash_tiny", "--text", str(tmp_path / "b.txt"), "--lines", "--tokenizer",
                       str(a / "tokenizer.json")) == 0
    assert data_sources(cfg, SPEC)[1] == str(a / "tokenizer.json")  # the same tokenizer in both folders


# --- issue 47: what a new user hit on real data (the input side) --------------------------------------------------

def bad_parquet(path, values: list[bytes]) -> None:
    """A parquet file whose string column `text` holds `values` as they are, bytes that are not UTF-8 included
    (pyarrow checks them neither on writing through buffers nor on reading)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = pa.array(values, type=pa.binary())
    pq.write_table(pa.table({"text": pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())}), path)


def test_text_that_is_not_utf8_is_skipped_and_named_in_every_text_input(tmp_path):
    """data/inputs.py: a document with more than 1% of its characters undecodable bytes (U+FFFD) or NUL is
    skipped as "not UTF-8 text" and named where it is -- a .txt file, a .txt line (--lines; a whole file that
    is not text once, by its name), a jsonl line (its "text", or the line itself when it does not parse), a
    compressed jsonl line, a parquet row -- while a stray bad byte in a long enough document is kept."""
    import gzip

    from flashtrain.data.inputs import InputStats, iter_texts

    src = tmp_path / "src"
    src.mkdir()
    rand = src / "rand.txt"
    rand.write_bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    utf16 = src / "utf16.txt"
    utf16.write_bytes("hello world".encode("utf-16-le"))  # h NUL e NUL ...: 11 NUL of 22 characters
    at_limit = src / "at_limit.txt"
    at_limit.write_bytes(b"a" * 99 + b"\xff")  # 1 of 100 characters: 1%, kept
    over = src / "over.txt"
    over.write_bytes(b"a" * 98 + b"\xff")  # 1 of 99: over 1%
    jl = src / "t.jsonl"
    jl.write_bytes(b'{"text": "fine"}\n'
                   b'{"text": "\xff\xfe\xfd ok"}\n'  # parses; its text: 3 of 6 characters U+FFFD
                   b'\xff\xfe\x00\xfa{\n'  # does not parse, and is not text: 4 of 5
                   b'not json at all\n'  # does not parse, but is text
                   + json.dumps({"text": "\u0000\u0000 two NULs"}).encode() + b"\n")  # 2 of 11
    gz = src / "z.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"text": "gz fine"}\n{"text": "\xc3\xc3\xc3"}\n'))  # 3 of 3
    pq = src / "p.parquet"
    bad_parquet(pq, [b"pq fine", b"\xff\xfe bad", b"a stray \xff in a row of more than a hundred characters, "
                     b"which is kept with it read as U+FFFD, as the rule says it should be."])
    reported = []
    stats = InputStats(report=reported.append)
    files = [rand, utf16, at_limit, over, jl, gz, pq]
    docs = list(iter_texts(files, False, stats))
    assert docs == ["a" * 99 + "\ufffd", "fine", "gz fine", "pq fine",
                    "a stray \ufffd in a row of more than a hundred characters, which is kept with it read as U+FFFD, "
                    "as the rule says it should be."]
    assert dict(stats.skipped) == {"not UTF-8 text": 8, "not JSON": 1} and stats.documents == 5
    assert stats.named["not UTF-8 text"] == [str(rand), str(utf16), str(over), f"{jl}:2", f"{jl}:3", f"{jl}:5",
                                             f"{gz}:2", f"{pq}:row 2"]
    for line in (f"skipping {utf16}: not UTF-8 text (11 of 22 characters are bytes that are not UTF-8 or NUL; at "
                 f"most 1% may be)",
                 f"skipping {over}: not UTF-8 text (1 of 99 characters",
                 f"skipping {jl}:2: not UTF-8 text (3 of 6 characters", f"skipping {jl}:3: not UTF-8 text (4 of 5 ",
                 f"skipping {jl}:4: not JSON (", f"skipping {jl}:5: not UTF-8 text (2 of 11 characters",
                 f"skipping {gz}:2: not UTF-8 text (3 of 3 characters", f"skipping {pq}:row 2: not UTF-8 text (2 of 6"):
        assert any(r.startswith(line) for r in reported), (line, reported)

    lines = src / "lines.txt"  # as a whole 5 of 631 characters are bad (under 1%): read line by line
    lines.write_bytes(b"x" * 600 + b"\n\xff\xfe\n\n" + "second \u2028 same line\n".encode() + b"\x00\x00\x00 nul\n")
    by_line = InputStats()
    assert list(iter_texts([rand, lines], True, by_line)) == ["x" * 600, "second \u2028 same line"]
    assert by_line.named == {"not UTF-8 text": [str(rand), f"{lines}:2", f"{lines}:5"]}  # rand.txt: once, whole
    assert dict(by_line.skipped) == {"not UTF-8 text": 3}


def test_prepare_data_names_text_captions_and_interleaved_lines_that_are_not_utf8(tmp_path, capsys):
    """launch/prepare_data.py: "not UTF-8 text" skips counted, named on stderr as found, in manifest.json and
    in the closing table, for a .txt, an image's caption (the image is skipped, named by its caption's file)
    and an interleaved line's text; a caption that is not UTF-8 no longer stops the tool."""
    src = tmp_path / "src"
    (src / "imgs").mkdir(parents=True)
    good, rand = src / "good.txt", src / "rand.txt"
    good.write_text("a document of plain words")
    rand.write_bytes(np.random.default_rng(1).integers(0, 256, 2000, dtype=np.uint8).tobytes())
    (src / "imgs" / "cat.png").write_bytes(png())
    (src / "imgs" / "cat.txt").write_text("a noisy box")
    (src / "imgs" / "dog.png").write_bytes(png(seed=3))
    dog = src / "imgs" / "dog.txt"
    dog.write_bytes("a noisy box".encode("utf-16"))  # a BOM, then a NUL beside every letter
    inter = src / "inter.jsonl"
    inter.write_bytes(b'{"segments": [{"text": "look:"}, {"image": "imgs/cat.png"}]}\n'
                      b'{"segments": [{"text": "\xff\xfe\xfd"}, {"image": "imgs/cat.png"}]}\n')
    out = tmp_path / "out"
    assert run_prepare(str(out), "+exp=flash_tiny", "--text", str(good), str(rand), "--images", str(src / "imgs"),
                       "--interleaved", str(inter)) == 0
    printed = capsys.readouterr()
    counts = {"text": {"not UTF-8 text": 1}, "mm": {"not UTF-8 text": 2}}
    where = {"text": {"not UTF-8 text": [str(rand)]}, "mm": {"not UTF-8 text": [str(dog), f"{inter}:2"]}}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"] == counts and manifest["skipped_where"] == where and manifest["skipped_documents"] == 3
    assert manifest["totals"]["text"]["documents"] == 1 and manifest["totals"]["mm"]["documents"] == 2
    assert f"text, not UTF-8 text: {rand}" in printed.out and f"mm, not UTF-8 text: {dog}, {inter}:2" in printed.out
    for name in (rand, dog, f"{inter}:2"):
        assert f"skipping {name}: not UTF-8 text (" in printed.err, printed.err


def test_inputs_without_a_usable_document_are_refused_before_anything_is_written(tmp_path, capsys):
    """A --text folder where nothing is usable: exit 2, one `error:` line counting why by reason and naming
    the first of each, and no OUT_DIR -- not a tokenizer trained on nothing and an empty manifest."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_bytes(np.random.default_rng(2).integers(0, 256, 2000, dtype=np.uint8).tobytes())
    (d / "b.txt").write_bytes("hello".encode("utf-16-le"))
    (d / "c.jsonl").write_text('{"text": "   "}\n')
    out = tmp_path / "out"
    assert run_prepare(str(out), "+exp=flash_tiny", "--text", str(d)) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: nothing to write, no input holds a usable document: --text {d}: none of its 3 files holds a usable "
        f"document (2 not UTF-8 text: {d / 'a.txt'}, ...; 1 empty document: {d / 'c.jsonl'}:1); nothing written to "
        f"{out}"]
    assert not out.exists()


def test_multimodal_inputs_without_a_usable_document_and_no_text_are_refused(tmp_path, capsys):
    """Images and interleaved lines none of which is usable, without text: exit 2 and one `error:` line (the
    skips found while reading the inputs are reported above it as found), nothing written."""
    (tmp_path / "imgs").mkdir()
    cut = tmp_path / "imgs" / "cut.png"
    cut.write_bytes(png(seed=1)[:2000])  # the header reads, the pixels end early
    (tmp_path / "imgs" / "cut.txt").write_text("half a box")
    inter = tmp_path / "inter.jsonl"
    inter.write_text('\n{"segments": [{"image": "missing.png"}]}\n{"segs": []}\n')
    out = tmp_path / "out"
    assert run_prepare(str(out), "+exp=flash_tiny", "--images", str(tmp_path / "imgs"), "--interleaved",
                       str(inter)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"skipping {inter}:3: bad interleaved document (KeyError: 'segments')",
        f"error: nothing to write, no input holds a usable document: --images {tmp_path / 'imgs'} --interleaved "
        f"{inter}: none of 3 documents is usable (1 bad interleaved document: {inter}:3; 1 image file unreadable: "
        f"{tmp_path / 'missing.png'} (in {inter}:2); 1 image undecodable: {cut}); nothing written to {out}"]
    assert not out.exists()


def test_interleaved_skips_are_named_by_their_line_on_stderr_as_found(tmp_path, capsys):
    """--interleaved: each unusable line is named `file:line` by its line in the file (blank lines counted;
    a U+2028 inside a JSON string is no line break), on stderr as it is found (before the progress bar and
    the text's skips) as well as in the closing table and manifest.json."""
    (tmp_path / "cat.png").write_bytes(png())
    inter = tmp_path / "inter.jsonl"
    inter.write_text("\n\n"  # lines 1, 2
                     + json.dumps({"segments": [{"text": "one\u2028line"}, {"image": "cat.png"}]}, ensure_ascii=False)
                     + "\n\n"  # line 3, then a blank line 4
                     + '{"segments": [{"text": "cut off"\n'  # line 5
                     + "   \n"  # line 6, blank
                     + json.dumps({"segments": [{"text": 5}]}) + "\n"  # line 7
                     + json.dumps({"segments": []}) + "\n")  # line 8
    text = tmp_path / "t.jsonl"
    text.write_text("not json\n" + json.dumps({"text": "a text document"}) + "\n")
    out = tmp_path / "out"
    assert run_prepare(str(out), "+exp=flash_tiny", "--text", str(text), "--interleaved", str(inter)) == 0
    printed = capsys.readouterr()
    where = {"bad interleaved document": [f"{inter}:5", f"{inter}:7"], "empty document": [f"{inter}:8"]}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped_where"]["mm"] == where and manifest["totals"]["mm"]["documents"] == 1
    err = printed.err
    found = [err.index(f"skipping {inter}:5: bad interleaved document (JSONDecodeError: "),
             err.index(f"skipping {inter}:7: bad interleaved document (TypeError: segment 1's text is int, not a "
                       f"string)"),
             err.index(f"skipping {inter}:8: empty document"), err.index(f"skipping {text}:1: not JSON (")]
    assert found == sorted(found)  # as found: the interleaved file is read before the text
    assert f"mm, bad interleaved document: {inter}:5, {inter}:7" in printed.out


def test_a_skipped_jsonl_line_is_named_by_its_line_in_the_file(tmp_path):
    """`file:line` is the line's number as an editor shows it: blank lines counted, a U+2028 inside a JSON
    string no line break (numbers written by hand)."""
    from flashtrain.data.inputs import InputStats, iter_texts

    jl = tmp_path / "a.jsonl"
    jl.write_text("\n"  # 1
                  + json.dumps({"text": "first\u2028still line 2"}, ensure_ascii=False) + "\n"  # 2
                  + "\n  \n\n"  # 3, 4, 5
                  + "{broken\n"  # 6
                  + json.dumps({"id": 1}) + "\n"  # 7
                  + "\n"  # 8
                  + json.dumps({"text": 3}) + "\n")  # 9
    stats = InputStats()
    assert list(iter_texts([jl], False, stats)) == ["first\u2028still line 2"]
    assert stats.named == {"not JSON": [f"{jl}:6"], "no text field": [f"{jl}:7"],
                           "text field not a string": [f"{jl}:9"]}


def test_prepare_data_says_every_user_error_as_error_line(tmp_path, capsys):
    """No input given, a bad --name, a missing --interleaved file (not a file cut short) and a --text folder
    without text files: `error: <message>` on one stderr line, exit 2 (exit_on_user_error), nothing written."""
    assert run_prepare(str(tmp_path / "out")) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: no documents given: name them with --text, --images or --interleaved (--help)"]
    assert run_prepare(str(tmp_path / "out"), "--text", "x.txt", "--name", "my source") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --name 'my source': a source name is letters, digits, '_', '.', '-' (e.g. --name web)"]
    missing = tmp_path / "missing.jsonl"  # not read as a file cut short
    assert run_prepare(str(tmp_path / "out"), "+exp=flash_tiny", "--interleaved", str(missing)) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: --interleaved '{missing}' does not exist"]
    (tmp_path / "empty").mkdir()
    assert run_prepare(str(tmp_path / "out"), "+exp=flash_tiny", "--text", str(tmp_path / "empty")) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: nothing to write, no input holds a usable document: --text {tmp_path / 'empty'}: no .txt, .jsonl, "
        f".jsonl.gz, .jsonl.zst, .parquet files in it; nothing written to {tmp_path / 'out'}"]
    assert not (tmp_path / "out").exists()


def test_a_palette_image_with_transparency_decodes_to_its_colours_without_a_warning():
    """data/images.py decode_image: an 8-bit PNG whose palette has per-entry transparency (tRNS bytes) gives
    the palette's colours, written here by hand, and no PIL UserWarning."""
    import warnings

    from PIL import Image

    from flashtrain.data.images import decode_image

    colours = [(200, 10, 30), (5, 250, 60), (90, 80, 220)]
    im = Image.new("P", (4, 2))
    im.putpalette([c for rgb in colours for c in rgb] + [0] * (768 - 9))
    im.putdata([0, 1, 2, 0, 2, 1, 0, 1])
    buf = io.BytesIO()
    im.save(buf, format="PNG", transparency=bytes([0, 128, 255]))  # entry 0 clear, 1 half, 2 opaque
    assert Image.open(io.BytesIO(buf.getvalue())).info["transparency"] == b"\x00\x80\xff"  # kept as bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rgb = decode_image(buf.getvalue())
    assert rgb.mode == "RGB" and np.asarray(rgb).tolist() == [
        [[200, 10, 30], [5, 250, 60], [90, 80, 220], [200, 10, 30]],
        [[90, 80, 220], [5, 250, 60], [200, 10, 30], [5, 250, 60]]]


def shard_counts(paths) -> tuple[int, int, int]:
    """(documents, text tokens, images) read back from written shards: their samples, tokens.npy lengths and
    image members -- independent of the counts prepare_data.py keeps as it writes."""
    import tarfile

    docs, tokens, images = 0, 0, 0
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".tokens.npy"):
                    docs += 1
                    tokens += len(np.load(io.BytesIO(tar.extractfile(member).read())))
                elif member.name.rsplit(".", 1)[-1] in ("png", "jpg"):
                    images += 1
    return docs, tokens, images


def test_the_totals_count_every_token_image_and_position_of_the_written_documents(tmp_path, capsys):
    """manifest.json's totals, the closing table's rows and the JSON line against the shards read back; the image
    positions by hand (flash_tiny: a 60 x 30 image is scaled up to the 7056-pixel minimum, 126 x 70, a 3 x 2 grid of
    image tokens: 2 x (3 + 1) + 2 = 10 positions; 300 x 120 -> 308 x 126, 8 x 3: 3 x 9 + 2 = 29); a document
    skipped for its second image counts none of its first image's positions."""
    (tmp_path / "small.png").write_bytes(png(60, 30))
    (tmp_path / "wide.png").write_bytes(png(300, 120, seed=1))
    text = tmp_path / "t.txt"
    text.write_text("the first text document here\nanother one, a little longer than the first\nthird\n")
    inter = tmp_path / "inter.jsonl"
    inter.write_text("\n".join(json.dumps({"segments": s}) for s in (
        [{"text": "a small picture"}, {"image": "small.png"}],
        [{"text": "two pictures, one missing"}, {"image": "wide.png"}, {"image": "missing.png"}],
        [{"image": "wide.png"}, {"text": "a wide picture and its words"}])) + "\n")
    out = tmp_path / "out"
    assert run_prepare(str(out), "+exp=flash_tiny", "--text", str(text), "--lines", "--interleaved", str(inter)) == 0
    printed = capsys.readouterr().out.splitlines()
    manifest = json.loads((out / "manifest.json").read_text())
    t_docs, t_tokens, _ = shard_counts(sorted(out.glob("text-*.tar")))
    m_docs, m_tokens, m_images = shard_counts(sorted(out.glob("mm-*.tar")))
    assert (t_docs, m_docs, m_images) == (3, 2, 2) and t_tokens > 3 and m_tokens > 2
    totals = {"text": {"documents": 3, "text_tokens": t_tokens, "images": 0},
              "mm": {"documents": 2, "text_tokens": m_tokens, "images": 2, "image_positions": 10 + 29}}
    assert manifest["totals"] == totals
    assert manifest["skipped_documents"] == 1 and manifest["skipped"]["mm"] == {"image file unreadable": 1}
    last = json.loads(printed[-1])
    assert {k: last[k] for k in ("text", "mm", "skipped_documents")} == {**totals, "skipped_documents": 1}
    rows = {line.split()[0]: line.split()[1:5] for line in printed if line.split()[:1] in (["text"], ["mm"])}
    assert rows == {"text": ["3", f"{t_tokens:,}", "0", "0"], "mm": ["2", f"{m_tokens:,}", "2", "1"]}


def test_a_named_source_counts_its_text_and_its_multimodal_documents_apart(tmp_path, capsys):
    """--name SOURCE: one set of shards for both; the table's two rows each count their own documents' tokens
    (the text documents' against the multimodal ones'), the totals all of them; the image positions by hand (10,
    as above)."""
    (tmp_path / "small.png").write_bytes(png(60, 30))
    text = tmp_path / "t.txt"
    text.write_text("one text document\n")
    inter = tmp_path / "inter.jsonl"
    inter.write_text(json.dumps({"segments": [{"text": "a small picture with many more words in its caption "
                                                       "than the text document has"}, {"image": "small.png"}]}) + "\n")
    out = tmp_path / "out"
    assert run_prepare(str(out), "+exp=flash_tiny", "--name", "web", "--text", str(text), "--lines",
                       "--interleaved", str(inter)) == 0
    printed = capsys.readouterr().out.splitlines()
    entry = json.loads((out / "manifest.json").read_text())["sources"]["web"]
    docs, tokens, images = shard_counts(sorted(out.glob("web-*.tar")))
    assert entry["totals"] == {"documents": 2, "text_tokens": tokens, "images": 1, "image_positions": 10}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    t_tokens = len(tok.encode("one text document", add_special_tokens=False).ids)
    m_tokens = tokens - t_tokens
    assert (docs, images) == (2, 1) and 0 < t_tokens < m_tokens
    rows = {line.split("  ")[0].strip(): line.split()[-4:] for line in printed if line.startswith("web (")}
    assert rows == {"web (text)": ["1", f"{t_tokens:,}", "0", "0"],
                    "web (with images)": ["1", f"{m_tokens:,}", "1", "0"]}


def test_the_table_names_the_first_skipped_inputs_and_counts_the_rest():
    """summary_table: SHOWN (5) names per reason, then "and N more" with N the reason's count less the names
    shown: 7 skipped, 7 named -> and 2 more; 150 skipped, 100 named (manifest.json keeps 100) -> and 145 more;
    3 skipped, 3 named -> no "more"."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))
    import prepare_data

    row = {"documents": 1, "text_tokens": 1234, "images": 0}
    skipped = {"text": {"empty document": 7, "not JSON": 150}, "mm": {"image undecodable": 3}}
    where = {"text": {"empty document": [f"a.txt:{i}" for i in range(1, 8)],
                      "not JSON": [f"b.jsonl:{i}" for i in range(1, 101)]},
             "mm": {"image undecodable": ["x.png", "y.png", "z.png"]}}
    lines = prepare_data.summary_table({"text": row, "mm": {**row, "images": 2}}, skipped, where).splitlines()
    # columns as wide as their headers (source 6, documents 9, tokens 6, images 6), two spaces apart
    assert lines[:3] == ["source  documents  tokens  images  skipped",
                         "text            1   1,234       0  157 (7 empty document, 150 not JSON)",
                         "mm              1   1,234       2  3 (3 image undecodable)"]
    assert lines[4:] == ["  text, empty document: a.txt:1, a.txt:2, a.txt:3, a.txt:4, a.txt:5 and 2 more",
                         "  text, not JSON: b.jsonl:1, b.jsonl:2, b.jsonl:3, b.jsonl:4, b.jsonl:5 and 145 more",
                         "  mm, image undecodable: x.png, y.png, z.png"]
