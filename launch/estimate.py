"""Per-GPU memory of a real training step, simulated on a laptop (train/plan/estimate.py).

    python launch/estimate.py +exp=flash --world 1024 parallel.pp=16 parallel.ep=64 train.recompute=full
    python launch/estimate.py +exp=flash_tiny --world 2 parallel.pp=2 --rank 1 --json
    python launch/estimate.py +exp=flash_2048gpu --json      # --world defaults to parallel.world (2048)

Takes `+exp=NAME` and any Hydra override (`parallel.*`, `train.recompute`, `data.*`, `model.*`). Without `--rank`, one
rank per pipeline position is simulated (ranks at one position differ only in their data-parallel /
expert coordinates, which hold equal shares), each in its own process, `--jobs` at a time. Prints per
rank the step's peak of live tensor bytes and its parts at that peak; `--json` prints

    {"world": W, "ranks": [{"rank", "stages", "peak_bytes", "params_bytes", "grads_bytes",
     "optimizer_bytes", "activations_bytes", "temporaries_bytes", "buffers_bytes"}], "max_peak_bytes": ...}

`--tokens T` estimates the stage of the recipe (`train.recipe`, train/recipe.py) a run is in after T tokens:
`python launch/estimate.py +exp=flash_2048gpu --tokens 3.4e13` is the 1M-token stage's layout.

`--device cuda` (default) simulates the GPU step (bf16 autocast); `--device cpu` the CPU step (fp32).
`--phases` also follows the live bytes phase by phase -- each micro-batch's forward and backward in the
order the schedule runs them, then the optimizer -- with each phase's peak and its bytes at the end
(`"phases"` per rank in the JSON): what a micro-batch in flight holds and each pass's transient; each
forward phase also lists its blocks (`"blocks"`: live bytes at a block's start and end and its peak, so
end - start is what the block leaves for its backward plus its output carry, at the layout's real shapes);
under recomputation each backward phase lists them too, each from its rebuild to the next block's rebuild
(peak - start: what the block's rebuild and backward add at their highest).
The figure is live tensor bytes: leave headroom for the allocator and the communication buffers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flashtrain.config.cli import exit_on_user_error
from flashtrain.config.errors import EXIT_USER_ERROR, ConfigError
from flashtrain.config.typed import typed_config

ROOT = Path(__file__).resolve().parent.parent

GiB = 1 << 30


def configured_world(overrides: list[str]) -> int | None:
    """The config's parallel.world (the processes its layout is for), if it sets one."""
    from flashtrain.train.config import compose

    return compose(overrides).parallel.get("world")


def default_ranks(overrides: list[str], world: int) -> list[int]:
    """The first rank of every pipeline position (the mesh is pp-major: position p starts at p x world / pp)."""
    from omegaconf import OmegaConf

    from flashtrain.parallel.config import ParallelConfig
    from flashtrain.parallel.dims import ParallelDims
    from flashtrain.train.config import compose, model_config

    conf = compose(overrides)
    cfg = model_config(conf)
    parallel = typed_config(ParallelConfig, OmegaConf.to_container(conf.parallel, resolve=True), "parallel")
    shape = ParallelDims.plan(world, parallel.pp, parallel.ep, cfg.n_layers, cfg.n_routed_experts, parallel.cp)
    return [p * (world // shape.pp) for p in range(shape.pp)]


def run_one(overrides: list[str], world: int, rank: int, device: str, phases: bool = False) -> dict:
    """One rank's simulation, in this process."""
    from flashtrain.train.config import compose
    from flashtrain.train.plan.estimate import estimate_rank

    return estimate_rank(compose(overrides), world, rank, device, phases).as_dict()


def run_in_subprocess(overrides: list[str], world: int, rank: int, device: str, phases: bool = False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *overrides, "--world", str(world), "--rank", str(rank),
           "--device", device, "--json", *(["--phases"] if phases else [])]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode == EXIT_USER_ERROR:  # the rank's one-line error: the same for every rank
        raise ConfigError(out.stderr.strip().splitlines()[-1].removeprefix("error: "))
    if out.returncode != 0:
        raise SystemExit(f"error: rank {rank}'s simulation failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["ranks"][0]


def human(report: dict) -> str:
    lines = [f"simulated step, world {report['world']}: peak of live tensor bytes per rank (GiB)",
             f"{'rank':>6} {'stages':>8} {'peak':>8} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'temp':>8}"]
    for r in report["ranks"]:
        lines.append(f"{r['rank']:>6} {','.join(map(str, r['stages'])):>8} {r['peak_bytes'] / GiB:8.2f} "
                     f"{r['params_bytes'] / GiB:8.2f} {r['grads_bytes'] / GiB:8.2f} {r['optimizer_bytes'] / GiB:8.2f} "
                     f"{r['activations_bytes'] / GiB:8.2f} {r['temporaries_bytes'] / GiB:8.2f}")
    lines.append(f"max peak: {report['max_peak_bytes'] / GiB:.2f} GiB (parts are at the peak; live tensors only, "
                 f"leave headroom for the allocator and communication buffers)")
    for r in report["ranks"]:
        if r.get("phases"):
            lines += ["", f"rank {r['rank']}, phase by phase (GiB of live tensors: the phase's peak, at its end)",
                      *[f"  {q['phase']:<26} {q['peak_bytes'] / GiB:8.2f} {q['end_bytes'] / GiB:8.2f}"
                        for q in r["phases"]]]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from flashtrain.config.cli import overrides_help

    parser = argparse.ArgumentParser(
        prog="launch/estimate.py", usage="python launch/estimate.py +exp=NAME [HYDRA OVERRIDES...] [--world N] "
        "[--rank R] [--device cuda|cpu] [--jobs 2] [--tokens T] [--phases] [--json]", description=__doc__,
        epilog=overrides_help(), formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--world", type=int, default=None,
                        help="number of GPUs (processes) of the layout; default: the config's parallel.world (an "
                             "exp for a cluster sets it; null there: give --world)")
    parser.add_argument("--rank", type=int, default=None,
                        help="simulate this rank only; default: the first rank of every pipeline position")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): the GPU step, bf16 autocast; cpu: the CPU step in fp32")
    parser.add_argument("--jobs", type=int, default=2,
                        help="ranks simulated at once, one process each (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    parser.add_argument("--phases", action="store_true",
                        help="also follow the live bytes phase by phase (each micro-batch's forward and backward, "
                             "the optimizer): their peaks and where each ends")
    parser.add_argument("--tokens", type=float, default=None, metavar="T",
                        help="estimate the recipe's stage a run is in after T tokens (train.recipe, e.g. 3.4e13 for "
                             "exp=flash's 1M stage); default: the first stage, the config as composed")
    args, overrides = parser.parse_known_args(argv)
    if args.tokens is not None:  # the recipe's stage of that token count: its overrides after the given ones
        from flashtrain.train.recipe import overrides_at

        name, overrides = overrides_at(overrides, args.tokens)
        print(f"recipe stage {name!r} at {args.tokens:g} tokens: {' '.join(overrides)}", file=sys.stderr, flush=True)
    if args.world is None:
        args.world = configured_world(overrides)
        if args.world is None:
            raise ConfigError("give --world N (the number of GPUs), or an exp that sets parallel.world")
    if args.rank is not None and not 0 <= args.rank < args.world:
        raise ConfigError(f"--rank {args.rank} is not a rank of --world {args.world}")
    t0 = time.time()
    if args.rank is not None:
        ranks = [run_one(overrides, args.world, args.rank, args.device, args.phases)]
    else:
        todo = default_ranks(overrides, args.world)
        print(f"simulating ranks {todo} ({args.jobs} at a time)", file=sys.stderr, flush=True)

        def one(rank: int) -> dict:
            t = time.time()
            r = run_in_subprocess(overrides, args.world, rank, args.device, args.phases)
            print(f"rank {rank} (stages {r['stages']}): peak {r['peak_bytes'] / GiB:.2f} GiB, activations "
                  f"{r['activations_bytes'] / GiB:.2f} GiB ({time.time() - t:.0f} s)", file=sys.stderr, flush=True)
            return r

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            ranks = list(pool.map(one, todo))
    report = {"world": args.world, "ranks": ranks, "max_peak_bytes": max(r["peak_bytes"] for r in ranks)}
    print(json.dumps(report) if args.json else human(report) + f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
