"""Turn user data into webdataset shards for flashtrain (format: data/README.md).

    python launch/prepare_data.py OUT_DIR [+exp=flash_small] [--text FILE_OR_DIR ...] [--lines]
        [--images DIR] [--interleaved FILE.jsonl] [--tokenizer tokenizer.json] [--docs-per-shard 256]
        [--shard-size 1G] [--name SOURCE]

`+exp=NAME` and model overrides give the vocabulary size and special ids of the tokenizer (default
+exp=flash_small); the other options below.

- `--text`: .txt files (one document per file, or per non-empty line with `--lines`), .jsonl /
  .jsonl.gz / .jsonl.zst files (one document per line, field "text") and .parquet files (one per row of
  the `text` column); a directory means every such file below it (data/inputs.py). Read as streams, twice
  when the tokenizer is trained (once for it, once to write the shards): nothing holds the whole input.
- `--images DIR`: image-caption documents, one per image (.png .jpg .jpeg .webp .bmp .gif below DIR), the
  caption from the .txt file of the same stem beside it (cat.png + cat.txt). Checked up front: images
  without one are named and skipped; none with one is an error.
- `--interleaved FILE.jsonl`: documents of interleaved text and images, one per line:
  {"segments": [{"text": "..."}, {"image": "path/relative/to/the/jsonl"}, ...]}.
- `--tokenizer`: an existing tokenizer.json for this model; without it a byte-level BPE is trained on
  the text given (vocabulary and special ids from the model config).
- `--docs-per-shard`, `--shard-size`: a shard is closed after that many documents or once its members
  hold that many bytes (K/M/G suffixes; one document may take it past the size), whichever comes first.
- `--name SOURCE`: write one named source for `data.sources` (data/sources.py): every document given
  goes into OUT_DIR/SOURCE-NNNNN.tar, and manifest.json gains (or replaces) the entry
  `sources.SOURCE` (its shards, modality, totals, skips); the other sources written there before are
  kept. Sources written into one OUT_DIR share its tokenizer.json: without `--tokenizer` the one
  already there is used, else one is trained. The last lines print the `data.sources` entry to add.
Writes OUT_DIR/{text,mm}-NNNNN.tar (with webdataset's ShardWriter), tokenizer.json, engram_map.json (the
Engram compressed map) and manifest.json (per shard: documents, text tokens, images; totals by modality,
with the sequence positions the images will take; what was skipped). A progress bar (documents/s, tokens,
images) runs on stderr while the shards are written (redrawn every 5 s when stderr is not a terminal).
Every input that cannot be used is counted by reason and named where it is (`file`, `file:line` of a
jsonl line or of a `.txt` line with --lines, `file:row N` of a parquet row; a line's number as an editor
shows it, blank lines counted): a line on stderr as it is found, and in manifest.json (`skipped`: counts
by modality and reason, `skipped_where`: the first 100 of each reason named). Text that is not UTF-8 --
more than 1% of its characters undecodable bytes or NUL (data/inputs.py MAX_UNDECODED_SHARE): a binary
file, UTF-16, Latin-1 -- is one such input ("not UTF-8 text"), in every text input and in captions and
interleaved text. A table per source ends the run: documents, tokens, images, what was skipped and why,
with the first few of each reason named (the last stdout line is the same as JSON). Point
`data.text_shards` / `data.mm_shards` at the tar files (globs work; so do webdataset URLs such as
`pipe:CMD` or `https://...` once the shards are served from elsewhere).

Exit status 0 when the shards are written; 2, with one line `error: <message>`, on a user error: no
input given, a bad --name, an input that does not exist, and inputs none of which holds a usable document
(checked before anything is written: the message counts why, by reason).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif"}
SHOWN = 5  # skipped inputs named per reason in the closing summary (manifest.json: data/inputs.py MAX_NAMED)
WITHOUT_CAPTION = "image without a caption"
BAD_INTERLEAVED = "bad interleaved document"
IMAGE_UNREADABLE = "image file unreadable"
IMAGE_UNDECODABLE = "image undecodable"


def byte_size(text: str) -> int:
    """'1G', '512M', '64K' or a plain number of bytes (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        n = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1G, 512M, 1000000)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a shard size must be positive")
    return int(n)


def positive_int(text: str) -> int:
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number")
    return n


def parser() -> argparse.ArgumentParser:
    from flashtrain.config.cli import overrides_help

    ap = argparse.ArgumentParser(prog="launch/prepare_data.py", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=overrides_help("Default here: +exp=flash_small."))
    ap.add_argument("out_dir", help="directory for the shards, tokenizer.json, engram_map.json and manifest.json")
    ap.add_argument("--text", nargs="*", default=[],
                    help=".txt / .jsonl / .jsonl.gz / .jsonl.zst / .parquet files or directories of them "
                         "(default none)")
    ap.add_argument("--lines", action="store_true",
                    help="one document per non-empty line of .txt files (default: one per file)")
    ap.add_argument("--images", metavar="DIR",
                    help="image-caption pairs: each image with NAME.txt, its caption, beside it (default none)")
    ap.add_argument("--interleaved", metavar="FILE.jsonl",
                    help='documents of text and images, one per line: {"segments": [{"text": ...}, {"image": '
                         'PATH}]} (default none)')
    ap.add_argument("--tokenizer", metavar="tokenizer.json",
                    help="an existing tokenizer for this model (default: the one already in OUT_DIR with --name, "
                         "else a byte-level BPE trained on the given text)")
    ap.add_argument("--docs-per-shard", type=positive_int, default=256,
                    help="documents per shard at most (default 256)")
    ap.add_argument("--shard-size", type=byte_size, default=byte_size("1G"),
                    help="bytes of members per shard at most, e.g. 1G, 256M (default 1G)")
    ap.add_argument("--name", help="write one named source (SOURCE-NNNNN.tar) for data.sources (default: the two "
                                   "unnamed sources text-NNNNN.tar and mm-NNNNN.tar)")
    return ap


if __name__ == "__main__" and any(a in ("-h", "--help") for a in sys.argv[1:]):
    parser().print_help()  # before the slow imports
    raise SystemExit(0)

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from flashtrain.config.cli import exit_on_user_error  # noqa: E402
from flashtrain.config.errors import ConfigError, DataError, InputNotFoundError  # noqa: E402
from flashtrain.data.images import ImageDecodeError, decode_image, num_image_positions, plan_image_size  # noqa: E402
from flashtrain.data.inputs import (  # noqa: E402
    EMPTY,
    NOT_UTF8,
    TEXT_SUFFIXES,
    InputStats,
    iter_texts,
    numbered_lines,
    text_files,
    undecoded,
)
from flashtrain.data.loader import WRITTEN_FOR  # noqa: E402
from flashtrain.data.shards import Document, write_shards  # noqa: E402
from flashtrain.data.sources import SOURCE_NAME  # noqa: E402
from flashtrain.data.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402
from flashtrain.train.config import compose, model_config, token_spec  # noqa: E402
from flashtrain.train.engram_map import load_or_build_engram_map  # noqa: E402


def report(line: str) -> None:
    """A skipped input's line on stderr as it is found (above the progress bar once there is one)."""
    tqdm.write(line, file=sys.stderr)


def image_caption_documents(folder: str, stats: InputStats) -> list[tuple[str, list]]:
    """(where, raw segments) per image with a caption; the caption requirement checked up front: images
    without one are named once and counted, none with one is an error; a caption that is not UTF-8 text
    skips its image (named by the caption's file)."""
    if not Path(folder).is_dir():
        raise DataError(f"--images {folder}: not a directory")
    images = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in IMAGE_EXTS)
    if not images:
        raise DataError(f"--images {folder}: no image files ({' '.join(sorted(IMAGE_EXTS))}) below it")
    missing = [img for img in images if not img.with_suffix(".txt").is_file()]
    if len(missing) == len(images):
        raise DataError(f"--images {folder}: none of its {len(images)} images has a caption; write each image's "
                        f"caption into a .txt of the same name beside it ({images[0].name} -> "
                        f"{images[0].with_suffix('.txt').name}), or give images with their text as --interleaved")
    if missing:
        print(f"--images {folder}: {len(missing)} of {len(images)} images have no caption (NAME.txt beside NAME.png) "
              f"and are skipped: {', '.join(str(m) for m in missing[:SHOWN])}"
              + (f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""), file=sys.stderr)
    for img in missing:
        stats.skip(WITHOUT_CAPTION, str(img), quiet=True)
    out, lacking = [], set(missing)
    for img in images:
        caption = img.with_suffix(".txt")
        if img in lacking:
            continue
        text = caption.read_text(encoding="utf-8", errors="replace").strip()
        if why := undecoded(text):
            stats.skip(NOT_UTF8, str(caption), why)
            continue
        out.append((str(img), [("image", img), ("text", text)]))
    return out


def interleaved_segments(line: str, base: Path) -> list:
    """The raw segments of one interleaved jsonl line; ValueError / KeyError / TypeError if it is not
    {"segments": [{"text": STRING} or {"image": PATH}, ...]}."""
    segs = json.loads(line)["segments"]
    if not isinstance(segs, list) or not all(isinstance(s, dict) for s in segs):
        raise TypeError("segments is not a list of objects")
    out = []
    for i, s in enumerate(segs, 1):
        if "text" in s:
            if not isinstance(s["text"], str):
                raise TypeError(f"segment {i}'s text is {type(s['text']).__name__}, not a string")
            out.append(("text", s["text"]))
        else:
            out.append(("image", base / s["image"]))
    return out


def interleaved_documents(path: str, stats: InputStats) -> list[tuple[str, list]]:
    """(where, raw segments) per usable line of an --interleaved jsonl, `where` = `file:line` (the line's number
    in the file, blank lines counted: data/inputs.py numbered_lines); a line that is not a document, holds
    neither an image nor text, or whose text is not UTF-8 text is skipped and named as it is found."""
    if not Path(path).is_file():  # here, not a "truncated file" skip when reading it fails
        raise InputNotFoundError(f"--interleaved {path!r} does not exist" if not Path(path).exists() else
                                 f"--interleaved {path!r}: not a file; give the jsonl of interleaved documents")
    base = Path(path).parent
    out = []
    for n, line in numbered_lines(Path(path), stats):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            raw = interleaved_segments(line, base)
        except (ValueError, KeyError, TypeError) as e:
            if why := undecoded(line):
                stats.skip(NOT_UTF8, where, why)
            else:
                stats.skip(BAD_INTERLEAVED, where, f"{type(e).__name__}: {e}")
            continue
        text = "".join(v for k, v in raw if k == "text")
        if why := undecoded(text):
            stats.skip(NOT_UTF8, where, why)
        elif not text.strip() and all(k == "text" for k, _ in raw):
            stats.skip(EMPTY, where)
        else:
            out.append((where, raw))
    return out


def read_image(value: Path, where: str, stats: InputStats):
    """(bytes, decoded image) of an image segment of the document at `where`, or None once it is counted and
    named in `stats` as unreadable or undecodable (rejected now rather than at training time)."""
    image = str(value) if where == str(value) else f"{value} (in {where})"
    try:
        data = Path(value).read_bytes()
        return data, decode_image(data)
    except OSError as e:
        stats.skip(IMAGE_UNREADABLE, image, e.strerror or type(e).__name__)
    except ImageDecodeError as e:
        stats.skip(IMAGE_UNDECODABLE, image, str(e))
    return None


def refuse_if_nothing_usable(args, files: list[Path], mm_raw: list, mm_stats: InputStats) -> None:
    """A DataError when no input holds a usable document: found before anything is written, by reading up to
    the first usable document (the text, then the multimodal documents' images), quietly -- the writing pass
    reports each skip. When nothing is usable, everything has been read and the message counts why."""
    text_probe, mm_probe = InputStats(), InputStats()
    if next(iter_texts(files, args.lines, text_probe), None) is not None:
        return
    if any(all(read_image(v, where, mm_probe) for k, v in raw if k == "image") for where, raw in mm_raw):
        return
    parts = []
    if args.text:
        given, many = " ".join(args.text), len(args.text) > 1
        parts.append(f"--text {given}: " + (f"none of {'their' if many else 'its'} {len(files)} files holds a usable "
                                            f"document ({reasons(text_probe)})" if files else
                                            f"no {', '.join(TEXT_SUFFIXES)} files in {'them' if many else 'it'}"))
    if mm_raw or mm_stats.skipped:
        given = " ".join(f"--{o} {v}" for o, v in (("images", args.images), ("interleaved", args.interleaved)) if v)
        both = InputStats(skipped=mm_stats.skipped + mm_probe.skipped,
                          named={r: mm_stats.named.get(r, []) + mm_probe.named.get(r, [])
                                 for r in {**mm_stats.named, **mm_probe.named}})
        parts.append(f"{given}: none of {len(mm_raw) + sum(mm_stats.skipped.values())} documents is usable "
                     f"({reasons(both)})")
    elif args.interleaved:
        parts.append(f"--interleaved {args.interleaved}: no document in it")
    raise DataError("nothing to write, no input holds a usable document: " + "; ".join(parts)
                    + f"; nothing written to {args.out_dir}")


def reasons(stats: InputStats) -> str:
    """`N reason: first named[, ...]` per reason of `stats`, most frequent first."""
    if not stats.skipped:
        return "blank lines only"
    return "; ".join(f"{n} {reason}: {stats.named[reason][0]}{', ...' if n > 1 else ''}"
                     for reason, n in sorted(stats.skipped.items(), key=lambda kv: (-kv[1], kv[0])))


def main(argv: list[str]) -> int:
    args, overrides = parser().parse_known_args(argv)
    if args.name is not None and not SOURCE_NAME.match(args.name):  # a usable source name, before any work
        raise ConfigError(f"--name {args.name!r}: a source name is letters, digits, '_', '.', '-' (e.g. --name web)")
    if not (args.text or args.images or args.interleaved):
        raise DataError("no documents given: name them with --text, --images or --interleaved (--help)")
    overrides = overrides or ["+exp=flash_small"]
    cfg = compose(overrides)
    spec = token_spec(model_config(cfg))
    # what the shards are for, named by a run of another model that finds them (data/loader.py)
    written_for = {"overrides": [o for o in overrides if o.lstrip("+").startswith(("exp=", "model"))],
                   "model": cfg.run_name, "vocab_size": spec.vocab_size}
    out = Path(args.out_dir)

    text_stats, mm_stats = InputStats(report=report), InputStats(report=report)
    files = text_files(args.text)
    mm_raw = (image_caption_documents(args.images, mm_stats) if args.images else []) + \
        (interleaved_documents(args.interleaved, mm_stats) if args.interleaved else [])
    refuse_if_nothing_usable(args, files, mm_raw, mm_stats)  # before anything is written
    out.mkdir(parents=True, exist_ok=True)
    captions = [s[1] for _, d in mm_raw for s in d if s[0] == "text"]
    shared = out / "tokenizer.json"
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer, spec)
    elif args.name is not None and shared.is_file():  # the sources of one directory share its tokenizer
        print(f"prepare_data.py: source {args.name!r} uses the tokenizer already in {out} (give --tokenizer for "
              f"another)", file=sys.stderr)
        tok = load_tokenizer(str(shared), spec)
    else:  # a first pass over the text, streamed into the tokenizer trainer (its skips are counted below)
        tok = train_tokenizer(itertools.chain(iter_texts(files, args.lines, InputStats()), captions), spec)
    tok.save(str(out / "tokenizer.json"))
    load_or_build_engram_map(out / "tokenizer.json")

    def ids(text: str) -> np.ndarray:
        return np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    tty = sys.stderr.isatty()
    bar = tqdm(desc="documents", unit="doc", file=sys.stderr, mininterval=0.1 if tty else 5.0, dynamic_ncols=tty)
    counts = {"text": 0, "mm": 0, "images": 0}
    image_positions = [0]

    def counted(docs, source: str):
        for doc in docs:
            counts[source] += sum(len(seg[1]) for seg in doc.segments if seg[0] == "text")
            counts["images"] += sum(1 for seg in doc.segments if seg[0] == "image")
            bar.update(1)
            bar.set_postfix(tokens=f"{counts['text'] + counts['mm']:,}", images=f"{counts['images']:,}", refresh=False)
            yield doc

    def mm_documents():
        for where, raw in mm_raw:
            doc, positions = Document(), 0
            for kind, value in raw:
                if kind == "text":
                    doc.segments.append(("text", ids(value)))
                    continue
                if (read := read_image(value, where, mm_stats)) is None:
                    break  # the document is skipped whole: none of its images' positions count
                data, img = read
                n_h, n_w, _, _ = plan_image_size(img.width, img.height, spec.image)
                positions += num_image_positions(n_h, n_w)
                doc.segments.append(("image", data, Path(value).suffix.lstrip(".").lower() or "png"))
            else:
                mm_stats.documents += 1
                image_positions[0] += positions
                yield doc

    text_docs = (Document([("text", ids(t))]) for t in iter_texts(files, args.lines, text_stats))
    if args.name is not None:
        return write_source(out, args, counted(text_docs, "text"), counted(mm_documents(), "mm"), text_stats,
                            mm_stats, counts, image_positions, bar, written_for)
    manifest = {"version": 1, "tokenizer": "tokenizer.json", WRITTEN_FOR: written_for,
                "text": write_shards(counted(text_docs, "text"), out, "text", args.docs_per_shard, args.shard_size),
                "mm": write_shards(counted(mm_documents(), "mm"), out, "mm", args.docs_per_shard, args.shard_size)}
    bar.close()
    skipped, where = skips(text_stats, mm_stats)
    manifest["skipped_documents"] = sum(sum(v.values()) for v in skipped.values())
    manifest["skipped"], manifest["skipped_where"] = skipped, where
    totals = {k: {f: sum(e[f] for e in manifest[k]) for f in ("documents", "text_tokens", "images")}
              for k in ("text", "mm")}
    totals["mm"]["image_positions"] = image_positions[0]
    manifest["totals"] = totals
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(summary_table(totals, skipped, where))
    print(json.dumps({"out_dir": str(out), **totals, "skipped_documents": manifest["skipped_documents"],
                      "skipped": skipped, "skipped_where": where}))
    return 0


def skips(text_stats: InputStats, mm_stats: InputStats) -> tuple[dict, dict]:
    """(counts, names) of the skipped inputs, by modality and reason."""
    return ({"text": dict(text_stats.skipped), "mm": dict(mm_stats.skipped)},
            {"text": dict(text_stats.named), "mm": dict(mm_stats.named)})


def write_source(out: Path, args, text_docs, mm_docs, text_stats: InputStats, mm_stats: InputStats,
                 counts: dict[str, int], image_positions: list[int], bar, written_for: dict) -> int:
    """`--name SOURCE`: the text and then the multimodal documents into SOURCE-NNNNN.tar; its entry in
    manifest.json (other sources kept); the data.sources entry to add."""
    name = args.name
    for old in out.glob(f"{name}-[0-9][0-9][0-9][0-9][0-9].tar"):  # a source written again replaces its shards
        old.unlink()
    entries = write_shards(itertools.chain(text_docs, mm_docs), out, name, args.docs_per_shard, args.shard_size)
    bar.close()
    path = out / "manifest.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    manifest.setdefault("version", 1)
    manifest["tokenizer"] = "tokenizer.json"
    manifest[WRITTEN_FOR] = written_for
    skipped, where = skips(text_stats, mm_stats)
    totals = {f: sum(e[f] for e in entries) for f in ("documents", "text_tokens", "images")}
    totals["image_positions"] = image_positions[0]
    modality = "multimodal" if totals["images"] else "text"
    manifest.setdefault("sources", {})[name] = {"modality": modality, "shards": entries, "totals": totals,
                                                "skipped": skipped, "skipped_where": where}
    tmp = path.with_name(f".manifest.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)
    rows = {"text": {"documents": text_stats.documents, "text_tokens": counts["text"], "images": 0},
            "mm": {"documents": mm_stats.documents, "text_tokens": counts["mm"], "images": totals["images"]}}
    print(summary_table(rows, skipped, where, labels={"text": f"{name} (text)", "mm": f"{name} (with images)"}))
    entry = {"name": name, "shards": [str(out.resolve() / f"{name}-*.tar")], "weight": 1, "modality": modality}
    print("add to data.sources (set the weight):  - {" + ", ".join(
        f"{k}: {json.dumps(v) if k == 'shards' else v}" for k, v in entry.items()) + "}")
    print(json.dumps({"out_dir": str(out), "source": entry, "totals": totals,
                      "skipped_documents": sum(sum(v.values()) for v in skipped.values()), "skipped": skipped,
                      "skipped_where": where}))
    return 0


def summary_table(totals: dict, skipped: dict, where: dict | None = None, labels: dict | None = None) -> str:
    """One row per source: documents, text tokens, images, skipped (and why); then the first few skipped
    inputs of each reason, named."""
    rows = [("source", "documents", "tokens", "images", "skipped")]
    for source in ("text", "mm"):
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped[source].items()))
        n_skipped = f"{sum(skipped[source].values())}" + (f" ({why})" if why else "")
        t = totals[source]
        rows.append(((labels or {}).get(source, source), f"{t['documents']:,}", f"{t['text_tokens']:,}",
                     f"{t['images']:,}", n_skipped))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r[:4], widths))) + "  " + r[4]
             for r in rows]
    named = [(source, reason, names) for source in ("text", "mm") for reason, names in sorted((where or {}).get(
        source, {}).items())]
    if named:
        lines.append("skipped, where (manifest.json skipped_where names up to 100 of each reason):")
        for source, reason, names in named:
            more = skipped[source][reason] - min(len(names), SHOWN)
            lines.append(f"  {(labels or {}).get(source, source)}, {reason}: {', '.join(names[:SHOWN])}"
                         + (f" and {more} more" if more > 0 else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main, sys.argv[1:]))
