"""Serve a flashtrain checkpoint with DeepSeek's inference code: write it in the released V4.1-Flash layout
(train/official/convert.py, train/official/layout.py).

    python launch/export_official.py CKPT OUT_DIR                 # FP8 weights, FP4 experts, FP8 Engram
    python launch/export_official.py CKPT OUT_DIR --dtype bf16    # unquantised BF16 variant
    python launch/export_official.py CKPT OUT_DIR --shard-gb 5
    python launch/export_official.py runs/flash_dspark/checkpoints/step_XXXXXXXX OUT_DIR   # backbone + drafter

CKPT is a `<run dir>/checkpoints/step_XXXXXXXX` directory (any pp / ep / dp layout). OUT_DIR receives
`config.json` (the public ModelArgs fields), `model-0000i-of-0000N.safetensors` shards of at most
--shard-gb each (a larger tensor gets its own) and `model.safetensors.index.json`. Names, dtypes and
formats are the release's: FP8 E4M3 weights with one power-of-two (E8M0) scale per 32 x 32 tile, routed
experts as one tensor per expert in FP4 E2M1 (two per byte) with an E8M0 scale per 32 inputs, Engram
tables in FP8 with an E8M0 scale per 32 channels, the rest BF16 / FP32. A DSpark-stage checkpoint
(train.stage=dspark) exports the whole release: the backbone checkpoint it was trained against (named in its
meta, its fingerprint checked) and the drafter `mtp.*` in the same formats, with the drafter's config fields
(`n_mtp_layers`, `dspark_*`, `compress_ratios` with the drafter's zeros).

The checkpoint (and a DSpark checkpoint's backbone) is verified first, as a resume verifies it: one whose
files fail their checksums, or one set aside as damaged (`.damaged-step_*`), is refused before anything is
written (`--allow-damaged`: exported, with a warning).

Memory: checkpoint tensors are read --shard-gb at a time (DCP reads only what is asked for; a larger
tensor alone, a stacked expert tensor as a whole) plus at most one output shard.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launch/export_official.py", description=__doc__,
                                 epilog="No +exp or overrides: the checkpoint carries its run's config.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("ckpt", help="a flashtrain checkpoint directory (<run dir>/checkpoints/step_XXXXXXXX)")
    ap.add_argument("out", help="directory to write the released layout into")
    ap.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8",
                    help="fp8: the release's quantised formats (default); bf16: unquantised")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors shard (GiB; default 5)")
    ap.add_argument("--allow-damaged", action="store_true",
                    help="export a checkpoint whose files fail their checksums, with a warning (default: refuse it)")
    args = ap.parse_args(argv)
    from flashtrain.train.checkpoint import check_readable, read_meta
    from flashtrain.train.official.convert import GiB, export_official, peak_rss_gib

    warn = lambda line: print(f"warning: {line}", file=sys.stderr)  # noqa: E731
    check_readable(args.ckpt, args.allow_damaged, report=warn)  # as a resume verifies it, before a byte is written
    if backbone := read_meta(args.ckpt).get("backbone"):  # a DSpark-stage checkpoint: the backbone it names too
        check_readable(backbone["path"], args.allow_damaged, report=warn)

    t0 = time.time()
    report = export_official(args.ckpt, args.out, args.dtype == "fp8", int(args.shard_gb * GiB),
                             read_bytes=int(args.shard_gb * GiB))
    peak = peak_rss_gib()
    print(f"wrote {report.out}: {report.tensors} tensors, {report.bytes_written / 1e9:.3f} GB in {report.shards} "
          f"shard(s) in {time.time() - t0:.1f} s, peak RSS {peak:.2f} GiB")
    return 0


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    raise SystemExit(exit_on_user_error(main))
