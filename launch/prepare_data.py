"""Turn user data into webdataset shards for flashtrain (format: data/README.md).

    python launch/prepare_data.py OUT_DIR [+exp=flash_small] [--text FILE_OR_DIR ...] [--lines]
        [--images DIR] [--interleaved FILE.jsonl] [--tokenizer tokenizer.json] [--docs-per-shard 256]
        [--shard-size 1G]

- `--text`: .txt files (one document per file, or per non-empty line with `--lines`) and .jsonl files
  (one document per line, field "text"); a directory means every .txt/.jsonl below it.
- `--images DIR`: image-caption documents, one per image, caption from the .txt file of the same stem.
- `--interleaved FILE.jsonl`: documents of interleaved text and images, one per line:
  {"segments": [{"text": "..."}, {"image": "path/relative/to/the/jsonl"}, ...]}.
- `--tokenizer`: an existing tokenizer.json for this model; without it a byte-level BPE is trained on
  the text given (vocabulary and special ids from the model config).
- `--docs-per-shard`, `--shard-size`: a shard is closed after that many documents or once its members
  hold that many bytes (K/M/G suffixes; one document may take it past the size), whichever comes first.
Writes OUT_DIR/{text,mm}-NNNNN.tar (with webdataset's ShardWriter), tokenizer.json, engram_map.json (the
Engram compressed map) and manifest.json (per shard: documents, text tokens, images; totals by modality,
with the sequence positions the images will take). Point `data.text_shards` / `data.mm_shards` at the tar
files (globs work; so do webdataset URLs such as `pipe:CMD` or `https://...` once the shards are served
from elsewhere).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np  # noqa: E402

from flashtrain.config.cli import exit_on_user_error  # noqa: E402
from flashtrain.data.images import ImageDecodeError, decode_image, num_image_positions, plan_image_size  # noqa: E402
from flashtrain.data.shards import Document, write_shards  # noqa: E402
from flashtrain.data.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402
from flashtrain.train.config import compose, model_config, token_spec  # noqa: E402
from flashtrain.train.engram_map import load_or_build_engram_map  # noqa: E402

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif"}


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


def text_documents(paths: list[str], per_line: bool) -> list[str]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.suffix in (".txt", ".jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"--text {str(p)!r} does not exist")
    docs = []
    for f in files:
        content = f.read_text(encoding="utf-8", errors="replace")
        if f.suffix == ".jsonl":
            for n, line in enumerate(content.splitlines(), 1):
                if line.strip():
                    try:
                        docs.append(json.loads(line)["text"])
                    except (ValueError, KeyError, TypeError) as e:
                        print(f"skipping {f}:{n}: not a JSON object with a 'text' field ({e})", file=sys.stderr)
        elif per_line:
            docs += [line for line in content.splitlines() if line.strip()]
        else:
            docs.append(content)
    return [d for d in docs if d.strip()]


def image_caption_documents(folder: str) -> list[list]:
    out = []
    for img in sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in IMAGE_EXTS):
        cap = img.with_suffix(".txt")
        out.append([("image", img), ("text", cap.read_text(encoding="utf-8").strip() if cap.is_file() else "")])
    return out


def interleaved_documents(path: str) -> list[list]:
    base = Path(path).parent
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            segs = json.loads(line)["segments"]
            out.append([("text", s["text"]) if "text" in s else ("image", base / s["image"]) for s in segs])
        except (ValueError, KeyError, TypeError) as e:
            print(f"skipping {path}:{n}: bad interleaved document ({e})", file=sys.stderr)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--text", nargs="*", default=[])
    ap.add_argument("--lines", action="store_true", help="one document per non-empty line of .txt files")
    ap.add_argument("--images")
    ap.add_argument("--interleaved")
    ap.add_argument("--tokenizer")
    ap.add_argument("--docs-per-shard", type=positive_int, default=256, help="documents per shard at most")
    ap.add_argument("--shard-size", type=byte_size, default=byte_size("1G"),
                    help="bytes of members per shard at most, e.g. 1G, 256M (default 1G)")
    args, overrides = ap.parse_known_args(argv)
    spec = token_spec(model_config(compose(overrides or ["+exp=flash_small"])))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    texts = text_documents(args.text, args.lines)
    mm_raw = (image_caption_documents(args.images) if args.images else []) + \
        (interleaved_documents(args.interleaved) if args.interleaved else [])
    if not texts and not mm_raw:
        print("prepare_data.py: no documents given (use --text, --images or --interleaved)", file=sys.stderr)
        return 2
    captions = [s[1] for d in mm_raw for s in d if s[0] == "text"]
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer, spec)
    else:
        tok = train_tokenizer(texts + captions, spec)
    tok.save(str(out / "tokenizer.json"))
    load_or_build_engram_map(out / "tokenizer.json")

    def ids(text: str) -> np.ndarray:
        return np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    mm_docs, bad, image_positions = [], 0, 0
    for raw in mm_raw:
        doc = Document()
        try:
            for kind, value in raw:
                if kind == "text":
                    doc.segments.append(("text", ids(value)))
                else:
                    data = Path(value).read_bytes()
                    img = decode_image(data)  # reject unreadable images now rather than at training time
                    n_h, n_w, _, _ = plan_image_size(img.width, img.height, spec.image)
                    image_positions += num_image_positions(n_h, n_w)
                    doc.segments.append(("image", data, Path(value).suffix.lstrip(".").lower() or "png"))
        except (OSError, ImageDecodeError) as e:
            bad += 1
            print(f"skipping a document: {e}", file=sys.stderr)
            continue
        mm_docs.append(doc)
    manifest = {"version": 1, "tokenizer": "tokenizer.json", "skipped_documents": bad,
                "text": write_shards((Document([("text", ids(t))]) for t in texts), out, "text", args.docs_per_shard,
                                     args.shard_size),
                "mm": write_shards(iter(mm_docs), out, "mm", args.docs_per_shard, args.shard_size)}
    totals = {k: {f: sum(e[f] for e in manifest[k]) for f in ("documents", "text_tokens", "images")}
              for k in ("text", "mm")}
    totals["mm"]["image_positions"] = image_positions
    manifest["totals"] = totals
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps({"out_dir": str(out), **totals, "skipped_documents": bad}))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main, sys.argv[1:]))
