"""Score a checkpoint on held-out data: the mean loss and bits per byte, overall and per source and
modality (train/evaluation/heldout.py), the same numbers a run logs in its eval records.

    python launch/evaluate.py RUN/checkpoints/step_00000100 [--shards S ...] [--tokens N] [--json]
    torchrun --standalone --nproc_per_node=2 launch/evaluate.py CKPT parallel.pp=2
    python launch/evaluate.py IMPORTED_CKPT +exp=flash [model.* overrides]   # an import of the release

A flashtrain checkpoint carries its run's config: the held-out set is the run's (`data.val_shards`,
`train.eval.tokens`, or the default corpus's held-out part) unless `--shards` / `--tokens` say otherwise.
The layout is this launch's, not the run's: one process, or data parallelism over torchrun's processes,
unless key=value overrides set one (`parallel.pp=2`, `parallel.ep=2`, ...; other keys too); the training
batch is rounded up to fit it (the held-out set decides what is scored). A weights-only import
(launch/import_official.py) takes `+exp=NAME` and overrides, as for the import. The checkpoint is
verified as a resume verifies it: one whose files fail their checksums, or one set aside as damaged, is
refused (`--allow-damaged`: scored, with a warning). Prints one summary line per source (`--json`: the
eval record, `loss`, `bpb`, `tokens`, `per_source`, `per_modality`, on stdout, from rank 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import os


def main(argv: list[str] | None = None) -> int:
    from flashtrain.config.cli import overrides_help

    ap = argparse.ArgumentParser(prog="launch/evaluate.py", description=__doc__, epilog=overrides_help(),
                                 usage="python launch/evaluate.py CHECKPOINT [+exp=NAME] [HYDRA OVERRIDES...] "
                                       "[--shards S ...] [--tokens N] [--json]",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("checkpoint", help="a checkpoints/step_XXXXXXXX directory, or an imported checkpoint")
    ap.add_argument("--shards", nargs="+", help="held-out shards (paths, globs or URLs; default: the run's)")
    ap.add_argument("--tokens", type=int, help="positions to score (default: the run's train.eval.tokens)")
    ap.add_argument("--json", action="store_true", help="print the eval record as JSON (default: one line per source)")
    ap.add_argument("--allow-damaged", action="store_true",
                    help="score a checkpoint whose files fail their checksums, with a warning (default: refuse it)")
    args, overrides = ap.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from flashtrain.train.evaluation.checkpoint import checkpoint_config, checkpoint_label, evaluate_checkpoint

    if args.shards:
        overrides.append("data.val_shards=[" + ",".join(json.dumps(s) for s in args.shards) + "]")
    if args.tokens is not None:
        overrides.append(f"train.eval.tokens={args.tokens}")
    cfg, meta = checkpoint_config(args.checkpoint, overrides, args.allow_damaged)
    record = evaluate_checkpoint(cfg, args.checkpoint, args.allow_damaged)
    if os.environ.get("RANK", "0") != "0":
        return 0
    if args.json:
        print(json.dumps(record))
        return 0
    print("\n".join(summary(args.checkpoint, checkpoint_label(meta), record)))
    return 0


def summary(checkpoint: str, label: str, record: dict) -> list[str]:
    """The printed lines: the whole held-out set's loss, bits per byte and scored tokens, then each source's."""
    return [f"{checkpoint} ({label}): loss {record['loss']:.4f}, bpb {_f(record['bpb'])}, {record['tokens']} tokens",
            *[f"  {name:>8}: loss {s['loss']:.4f}, bpb {_f(s['bpb'])}, {s['tokens']} tokens"
              for name, s in record["per_source"].items()]]


def _f(value) -> str:
    return "-" if value is None else f"{value:.4f}"


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    raise SystemExit(exit_on_user_error(main))
