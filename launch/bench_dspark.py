"""Does the DSpark stage raise the drafter's acceptance? flash_small end to end (docs/training.md "DSpark"):

1. **backbone**: the README's main command, `torchrun --nproc_per_node=2 launch/pretrain.py +exp=flash_small
   train.max_steps=8` (`--backbone-procs 1`: one process), in OUT/backbone; a finished one is reused;
2. **stage**: `launch/pretrain.py +exp=flash_small_dspark train.backbone=OUT/backbone/checkpoints/step_00000008
   train.max_steps=STEPS data.seq_len=SEQ train.global_batch_tokens=TOKENS` in OUT/stage (one process; resumes an
   interrupted one). `--stage-seq-len` / `--stage-batch-tokens` (default 256 / 512: 2 sequences per step, a
   quarter of the exp's 2048-token step, so that a few hundred steps fit the shared 2-core machine; 0 keeps the
   exp's; the schedule then spans exactly STEPS steps);
3. **measure**: `launch/eval_dspark.py OUT/stage/checkpoints/step_<STEPS> --json --check-greedy` with
   `--prompts`, `--prompt-len`, `--new-tokens`: the trained drafter's mean accepted length per verification step
   against the untrained drafter's and a block of 1, and the per-position acceptance.

    python launch/bench_dspark.py [--out /tmp/bench_dspark] [--steps 300]

Prints the figures, the ratio trained / untrained, the stage's first and last records, and writes
OUT/bench_dspark.json. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["logging.wandb.mode=disabled", "logging.progress=false"]


def run(cmd: list[str], what: str) -> float:
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        raise SystemExit(f"{what} failed (exit {out.returncode})")
    return time.time() - t0


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "event" not in json.loads(line)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/bench_dspark", help="directory of the runs and bench_dspark.json "
                                                               "(default /tmp/bench_dspark; finished runs are reused)")
    ap.add_argument("--backbone-steps", type=int, default=8, help="the backbone's steps (default 8, the README demo's)")
    ap.add_argument("--backbone-procs", type=int, default=2, help="processes of the backbone run (default 2)")
    ap.add_argument("--steps", type=int, default=300, help="DSpark stage steps (default 300)")
    ap.add_argument("--stage-seq-len", type=int, default=256, help="the stage's data.seq_len (0: the exp's)")
    ap.add_argument("--stage-batch-tokens", type=int, default=512,
                    help="the stage's train.global_batch_tokens (0: the exp's)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts for launch/eval_dspark.py (default 8)")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default 64)")
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides (key=value) for both runs")
    args = ap.parse_args()
    out = Path(args.out)
    backbone_dir, stage_dir = out / "backbone", out / "stage"
    ckpt = backbone_dir / "checkpoints" / f"step_{args.backbone_steps:08d}"
    times = {}
    if not (ckpt / ".metadata").is_file():
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     f"--nproc_per_node={args.backbone_procs}"] if args.backbone_procs > 1 else [sys.executable])
        times["backbone_s"] = run(launcher + [str(ROOT / "launch" / "pretrain.py"), "+exp=flash_small",
                                              f"train.max_steps={args.backbone_steps}", f"hydra.run.dir={backbone_dir}",
                                              *QUIET, *args.overrides], "the backbone run")
    final = stage_dir / "checkpoints" / f"step_{args.steps:08d}"
    if not (final / ".metadata").is_file():
        shape = ([f"data.seq_len={args.stage_seq_len}"] if args.stage_seq_len else []) + (
            [f"train.global_batch_tokens={args.stage_batch_tokens}",  # the schedule over exactly STEPS steps
             f"schedule.total_tokens={args.steps * args.stage_batch_tokens}"] if args.stage_batch_tokens else [])
        times["stage_s"] = run([sys.executable, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_small_dspark",
                                f"train.backbone={ckpt}", f"train.max_steps={args.steps}", f"hydra.run.dir={stage_dir}",
                                "train.checkpoint.interval=50", *shape, *QUIET, *args.overrides], "the DSpark stage")
    cmd = [sys.executable, str(ROOT / "launch" / "eval_dspark.py"), str(final), "--json", "--check-greedy",
           "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-3000:])
        raise SystemExit("launch/eval_dspark.py failed")
    times["eval_s"] = time.time() - t0
    result = json.loads(res.stdout.strip().splitlines()[-1])
    recs = records(stage_dir)
    summary = {"backbone": str(ckpt), "stage_steps": args.steps, "times": times, "eval": result,
               "first_record": {k: recs[0][k] for k in ("step", "loss", "draft_loss", "acceptance_length")},
               "last_record": {k: recs[-1][k] for k in ("step", "loss", "draft_loss", "acceptance_length",
                                                         "confidence_ece")}}
    (out / "bench_dspark.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n" + "\n".join(report(summary)))
    return 0


def report(summary: dict) -> list[str]:
    """The printed lines from the summary written to bench_dspark.json: the trained drafter's mean accepted length
    per verification step, the untrained drafter's and the quotient trained / untrained (above 1: the stage
    helped), a block of 1's, the acceptance per position ("-" where no draft reached it), the stage's first and
    last records and the times."""
    result, steps = summary["eval"], summary["stage_steps"]
    trained, base = result["mean_accepted_length"], result["baselines"]
    untrained = base["untrained"]["mean_accepted_length"]
    return [f"mean accepted length per verification step ({result['prompts']} held-out prompts x "
            f"{result['new_tokens']} tokens, block {result['block_size']}):",
            f"  trained drafter ({steps} stage steps): {trained:.3f}",
            f"  untrained drafter:                  {untrained:.3f}  (trained / untrained = {trained / untrained:.2f})",
            f"  block of 1 (trained drafter):       {base['block_1']['mean_accepted_length']:.3f}",
            "  acceptance per position: " + ", ".join("-" if a is None else f"{a:.3f}"
                                                      for a in result["acceptance_per_position"]),
            f"  confidence ECE: {result['confidence_ece']}; verified output equals greedy decoding: "
            f"{result.get('equals_greedy')}",
            f"  stage records: step 1 {summary['first_record']}, step {steps} {summary['last_record']}",
            f"  times: {summary['times']}"]


if __name__ == "__main__":
    raise SystemExit(main())
