"""Does training in the release's formats cost loss? The same run three times -- plain, with every QAT
switch, with FP8 GEMMs -- and their loss curves side by side (docs/official_formats.md "Does training in
the formats cost loss?"; issue 35).

    python launch/bench_formats.py [--run-dir DIR] [--out docs/formats] [--last N] [OVERRIDES ...]
    python launch/bench_formats.py --replot [--out docs/formats]     # the picture again, from formats.json

OVERRIDES are the runs' Hydra overrides. The default is flash_small's widths on the 8-layer plan of the tests
(every layer role, both Engram modules), one 512-token sequence a step and a whole schedule (warmup, stable,
decay) of 300 steps: `+exp=flash_small` + tests/layer_plans.py's EIGHT_LAYERS + `data.batch_size=1
train.global_batch_tokens=512 schedule.total_tokens=153600 train.eval.tokens=8192` (the 40 layers and
2048-token steps of flash_small take ~30x longer a step on a CPU). The variants add:

1. **plain**: nothing (on the CPU the step runs in fp32; on CUDA in bf16 autocast);
2. **qat**: `model.qat.*=true`, all six switches -- the weights (`experts_fp4`, `weights_fp8`,
   `weights_bf16`: the export is then exactly the model trained) and the KV / indexer activations
   (`indexer_fp4`, `compressed_kv_fp4`, `window_kv_fp8`: the public inference kernels' formats);
3. **fp8**: `model.fp8.enabled=true` (the FP8 Linears' three GEMMs on E4M3 operands with scales per 32; on
   the CPU the exact emulation of model/fp8_linear.py).

Each is `launch/pretrain.py OVERRIDES VARIANT` in DIR/<variant> (default /tmp/bench_formats/<hash of the
overrides>/<variant>), one process, the same data in the same order (same seed); a finished run is reused,
an interrupted one resumes from its last checkpoint. Its held-out eval is taken at the last step
(`train.eval.interval` = the step count). Reports, against plain: the mean training loss of the last
`--last` steps (default 20) and the final held-out loss, with the relative differences. Writes
OUT/formats.json (the summary and each variant's per-step training losses) and OUT/formats.png drawn from
it (training loss per step, a moving average, for the three; each against plain in %); `--replot` draws
the picture again from formats.json alone.
A measurement, not a test; CPU-heavy: on a shared machine run it under `flock` with `OMP_NUM_THREADS=1` (the
runs inherit the environment; an oversubscribed OpenMP pool is many times slower).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from flashtrain.config.errors import DataError, InputNotFoundError

ROOT = Path(__file__).resolve().parent.parent
EIGHT_LAYERS = ["model.n_layers=8", "model.compress_ratios=[0,0,2,2,2,1,1,1]", "model.kv_source_layers=[2,5]",
                "model.index_source_layers=[2,5,6]", "model.candidate_source_layer=5", "model.engram_layer_ids=[1,4]"]
DEFAULT_OVERRIDES = ["+exp=flash_small", *EIGHT_LAYERS, "data.batch_size=1", "train.global_batch_tokens=512",
                     "schedule.total_tokens=153600", "train.eval.tokens=8192"]
QAT = ["model.qat.experts_fp4=true", "model.qat.weights_fp8=true", "model.qat.weights_bf16=true",
       "model.qat.indexer_fp4=true", "model.qat.compressed_kv_fp4=true", "model.qat.window_kv_fp8=true"]
VARIANTS = {"plain": [], "qat": QAT, "fp8": ["model.fp8.enabled=true"]}
SMOOTH = 10  # steps in the plot's moving average
TITLE_CHARS = 150  # the picture's title is wrapped to lines of at most this many characters (its width at 9 pt)


def is_done(run_dir: Path, steps: int) -> bool:
    """Whether the run in `run_dir` has logged its last training step."""
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and any(json.loads(line).get("step") == steps and "event" not in json.loads(line)
                                     for line in metrics.read_text().splitlines() if line.strip())


def start_variant(overrides: list[str], extra: list[str], steps: int, run_dir: Path) -> subprocess.Popen | None:
    """launch/pretrain.py in `run_dir`, started (None when that run has finished already; an interrupted one
    resumes from its last checkpoint); its output goes to `run_dir`/pretrain.log, as the trainer writes it."""
    if is_done(run_dir, steps):
        return None
    cmd = [sys.executable, str(ROOT / "launch" / "pretrain.py"), *overrides, *extra, f"hydra.run.dir={run_dir}",
           "logging.wandb.mode=disabled", "logging.progress=false", "logging.heatmap_interval=0",
           f"train.eval.interval={steps}"]
    print(" ".join(cmd[1:]), flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)


def wait_variant(proc: subprocess.Popen | None, name: str, t0: float) -> None:
    if proc is None:
        return
    if proc.wait():
        raise SystemExit(f"error: the {name} run exited with {proc.returncode} (its pretrain.log says why)")
    print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics lines, the last record of each step (a resumed run rewrites none, but be safe)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step: dict[tuple, dict] = {}
    for r in lines:
        by_step[(r["step"], r.get("event", "train"))] = r
    return sorted(by_step.values(), key=lambda r: r["step"])


def moving(values: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def curves(runs: dict[str, list[dict]]) -> dict[str, dict[str, list]]:
    """Per variant its training records' `step` and `loss` lists: what formats.png draws, kept in
    formats.json so that the picture can be drawn again without the runs (`--replot`)."""
    return {name: {"step": [r["step"] for r in recs if "event" not in r],
                   "loss": [r["loss"] for r in recs if "event" not in r]} for name, recs in runs.items()}


def figure_title(result: dict) -> str:
    """The picture's title from formats.json: the runs' overrides, steps, tokens a step and device."""
    return (f"{' '.join(result['overrides'])}: {result['steps']} steps of {result['tokens_per_step']} tokens, "
            f"{result['device']}; qat = all six model.qat switches, fp8 = model.fp8.enabled")


def formats_figure(result: dict):
    """formats.json's curves as a Figure (no pyplot state): the training loss of each variant, a `SMOOTH`-
    step moving average (left), and each one's moving average against plain's, in % (right); the title
    wrapped to the figure's width, the layout constrained so that nothing is cut."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    base = moving(result["curves"]["plain"]["loss"], SMOOTH)
    for name, c in result["curves"].items():
        smooth = moving(c["loss"], SMOOTH)
        axes[0].plot(c["step"], smooth, label=name)
        axes[1].plot(c["step"], [100 * (a / b - 1) for a, b in zip(smooth, base)], label=name)
    axes[0].set_ylabel(f"training loss ({SMOOTH}-step moving average)")
    axes[1].set_ylabel(f"loss vs plain, % ({SMOOTH}-step moving average)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(figure_title(result), TITLE_CHARS)), fontsize=9)
    return fig


def replot(out: Path) -> Path:
    """Draw OUT/formats.png from OUT/formats.json alone (no run is needed); returns the picture's path."""
    path = out / "formats.json"
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputNotFoundError(f"{path}: no such file; run launch/bench_formats.py (without --replot) to write "
                                 f"it") from None
    missing = [k for k in ("curves", "tokens_per_step") if k not in result]
    if missing:
        raise DataError(f"{path} has no {' / '.join(missing)} (written before bench_formats.py kept the per-step "
                        f"losses): run launch/bench_formats.py again (its finished runs are reused) to write them")
    fig = formats_figure(result)
    fig.savefig(out / "formats.png", dpi=110)
    return out / "formats.png"


def main(argv: list[str]) -> int:
    from flashtrain.config.cli import overrides_help

    ap = argparse.ArgumentParser(prog="launch/bench_formats.py", description=__doc__, epilog=overrides_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--run-dir", type=Path,
                    help="the runs' parent directory (default /tmp/bench_formats/<hash of the overrides>)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "formats",
                    help="where formats.png and formats.json go (default docs/formats)")
    ap.add_argument("--parallel", action="store_true",
                    help="run the three variants at the same time (one process each; their step times then "
                         "share the CPU)")
    ap.add_argument("--last", type=int, default=20, help="steps averaged for the final training loss (default 20)")
    ap.add_argument("--replot", action="store_true",
                    help="only draw OUT/formats.png again from OUT/formats.json (its per-step losses); runs nothing")
    args, overrides = ap.parse_known_args(argv)
    if args.replot:
        print(f"wrote {replot(args.out)}")
        return 0
    overrides = overrides or DEFAULT_OVERRIDES
    from flashtrain.train.build import read_configs
    from flashtrain.train.config import compose

    c = read_configs(compose(overrides))
    steps = c.train.max_steps or c.schedule.total_steps
    key = hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:10]
    base_dir = args.run_dir or Path("/tmp/bench_formats") / key
    if args.parallel:  # the three at once, one process each
        t0 = time.perf_counter()
        procs = {name: start_variant(overrides, extra, steps, base_dir / name) for name, extra in VARIANTS.items()}
        for name, proc in procs.items():
            wait_variant(proc, name, t0)
    else:
        for name, extra in VARIANTS.items():
            t0 = time.perf_counter()
            wait_variant(start_variant(overrides, extra, steps, base_dir / name), name, t0)
    runs = {name: read_metrics(base_dir / name) for name in VARIANTS}

    summary = {}
    for name, recs in runs.items():
        train = [r for r in recs if "event" not in r]
        evals = [r for r in recs if r.get("event") == "eval"]
        summary[name] = {"train_loss_last": sum(r["loss"] for r in train[-args.last:]) / len(train[-args.last:]),
                         "eval_loss": evals[-1]["loss"] if evals else None,
                         "step_time_s": sorted(r["step_time_s"] for r in train)[len(train) // 2]}
    plain = summary["plain"]
    for s in summary.values():
        s["train_vs_plain"] = s["train_loss_last"] / plain["train_loss_last"] - 1
        s["eval_vs_plain"] = None if s["eval_loss"] is None else s["eval_loss"] / plain["eval_loss"] - 1
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda (bf16 autocast)" if _cuda() else "cpu (fp32)"
    (args.out / "formats.json").write_text(json.dumps({"overrides": overrides, "steps": steps,
                                                       "tokens_per_step": c.schedule.tokens_per_step, "device": device,
                                                       "parallel": args.parallel, "variants": VARIANTS,
                                                       "summary": summary, "curves": curves(runs)}, indent=1))
    replot(args.out)
    print(f"\n| variant | train loss, last {args.last} steps | vs plain | held-out loss at step {steps} | vs plain "
          f"| median step s |\n|---|---|---|---|---|---|")
    for name, s in summary.items():
        ev = "-" if s["eval_loss"] is None else f"{s['eval_loss']:.4f}"
        ev_rel = "-" if s["eval_vs_plain"] is None else f"{100 * s['eval_vs_plain']:+.2f}%"
        print(f"| {name} | {s['train_loss_last']:.4f} | {100 * s['train_vs_plain']:+.2f}% | {ev} | {ev_rel} "
              f"| {s['step_time_s']:.1f} |")
    print(f"\nwrote {args.out / 'formats.png'} and {args.out / 'formats.json'}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    sys.exit(exit_on_user_error(main, sys.argv[1:]))
