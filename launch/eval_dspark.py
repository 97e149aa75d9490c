"""Measure a DSpark drafter: greedy speculative decoding with its frozen backbone as the verifier on
held-out prompts, deterministic (train/dspark/speculative.py): the mean accepted length per verification step,
the per-position acceptance and the confidence head's calibration (ECE), against an untrained drafter and
a block of 1 (an MTP-1-like baseline).

    python launch/eval_dspark.py runs/flash_small_dspark/checkpoints/step_00000300 [--json]
    python launch/eval_dspark.py CKPT --prompts 16 --prompt-len 64 --new-tokens 64 --check-greedy
    python launch/eval_dspark.py IMPORTED_CKPT +exp=flash   # an import of the release (its mtp.* drafter)

A DSpark-stage checkpoint carries its config and names its backbone checkpoint; key=value overrides change
other keys (e.g. data.val_shards=[...]). `--check-greedy` also runs the backbone's own greedy decoding and
reports whether the verified output equals it. `--json` prints one object: `mean_accepted_length`,
`acceptance_per_position`, `confidence_ece`, `steps`, `tokens`, and `baselines` {`untrained`, `block_1`} with
the same fields.
"""

from __future__ import annotations

import argparse
import json
import logging


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a DSpark-stage checkpoints/step_XXXXXXXX directory, or an import with mtp.*")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (text rows), default 8")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens, default 64")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens to generate per prompt, default 64")
    ap.add_argument("--check-greedy", action="store_true", help="also compare with the backbone's greedy decoding")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args, overrides = ap.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from flashtrain.train.dspark.speculative import evaluate_dspark
    from flashtrain.train.evaluation.checkpoint import checkpoint_config

    cfg, _ = checkpoint_config(args.checkpoint, overrides)
    result = evaluate_dspark(cfg, args.checkpoint, args.prompts, args.prompt_len, args.new_tokens, args.check_greedy,
                             log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(result))
        return 0
    print("\n".join(summary(args.checkpoint, result)))
    return 0


def summary(checkpoint: str, result: dict) -> list[str]:
    """The printed lines of `evaluate_dspark`'s result: the trained drafter's mean accepted length, ECE and
    per-position acceptance ("-" where a position was never reached), each baseline's mean accepted length,
    and the greedy check when it ran."""
    lines = [f"{checkpoint}: mean accepted length {result['mean_accepted_length']:.3f} tokens per step "
             f"({result['prompts']} prompts x {result['new_tokens']} tokens), confidence ECE "
             f"{_f(result['confidence_ece'])}",
             "  acceptance per position: " + ", ".join(_f(a) for a in result["acceptance_per_position"])]
    for name, r in result["baselines"].items():
        lines.append(f"  baseline {name}: mean accepted length {r['mean_accepted_length']:.3f}")
    if "equals_greedy" in result:
        lines.append(f"  verified output equals greedy decoding: {result['equals_greedy']}")
    return lines


def _f(value) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    raise SystemExit(exit_on_user_error(main))
