"""Start from the released V4.1-Flash weights: convert a checkpoint in the official layout into a flashtrain
checkpoint (train/official/convert.py).

    python launch/import_official.py SRC_DIR OUT_CKPT +exp=flash [model.* overrides] [--part-gb 2]
    torchrun --nproc_per_node=8 launch/pretrain.py +exp=flash train.resume_from=OUT_CKPT ...

SRC_DIR holds `config.json`, `model*.safetensors` and `model.safetensors.index.json` (FP8 E4M3 weights
with their power-of-two 32 x 32 block scales, FP4 routed experts one tensor per expert, the FP8 Engram
tables, BF16 / FP32 tensors; or the BF16 variant). `config.json` is checked against the model config of
the given +exp, and every tensor's presence, dtype and shape, before anything is written; a mismatch names
the field or tensor. A release with the DSpark drafter (`config.json` `dspark_block_size` > 0) has its `mtp.*`
tensors imported as well, checked against the exp's drafter fields, so the DSpark stage can continue DeepSeek's
drafter (`+exp=flash_dspark train.backbone=OUT_CKPT`); `--backbone-only` leaves them out. Tensors the model does
not use are listed.

OUT_CKPT is a DCP checkpoint of the weights alone (fp32, the experts stacked): `train.resume_from=OUT_CKPT`
starts a run from it at step 0 with fresh optimizer state and the data from the start; the LR schedule is
the config's (docs/official_formats.md "Continued pre-training" says which to use). Once the run has written its own
checkpoints, a restart resumes from those even with resume_from still set.

Memory: one source tensor at a time plus at most --part-gb of converted tensors before they are written.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    from flashtrain.config.cli import overrides_help

    ap = argparse.ArgumentParser(prog="launch/import_official.py", description=__doc__, epilog=overrides_help(),
                                 usage="python launch/import_official.py SRC_DIR OUT_CKPT +exp=NAME "
                                       "[HYDRA OVERRIDES...] [--part-gb 2]",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("src", help="directory of the released checkpoint")
    ap.add_argument("out", help="flashtrain checkpoint directory to write")
    ap.add_argument("--part-gb", type=float, default=2.0,
                    help="converted tensors held before writing them out (GiB; default 2)")
    ap.add_argument("--backbone-only", action="store_true",
                    help="leave a released DSpark drafter (mtp.*) out of the import")
    args, overrides = ap.parse_known_args(argv)
    from omegaconf import OmegaConf

    from flashtrain.train.config import compose, model_config
    from flashtrain.train.official.convert import GiB, import_official, peak_rss_gib

    t0 = time.time()
    conf = compose(overrides)
    cfg = model_config(conf)
    report = import_official(args.src, args.out, cfg, {"model": OmegaConf.to_container(conf.model, resolve=True)},
                             int(args.part_gb * GiB), drafter=False if args.backbone_only else None)
    for note in report.notes:
        print(f"note: {note}")
    if report.unused:
        more = f" ... ({len(report.unused)} in all)" if len(report.unused) > 20 else ""
        shown = ", ".join(report.unused[:20]) + more
        print(f"not used by the model (left out): {shown}")
    peak = peak_rss_gib()
    print(f"wrote {report.out}: {report.tensors} tensors from {report.bytes_read / 1e9:.3f} GB "
          f"in {time.time() - t0:.1f} s, peak RSS {peak:.2f} GiB; start from it with train.resume_from={report.out}")
    return 0


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    raise SystemExit(exit_on_user_error(main))
