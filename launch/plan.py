"""Plan a run before launching it: sizes and partition of any exp on the meta device, and the layouts that
fit a cluster.

    python launch/plan.py +exp=flash                          # sizes, optimizer split, schedule, layer roles
    python launch/plan.py +exp=flash --json                   # the same as one JSON object
    python launch/plan.py +exp=flash_small parallel.pp=2 --device cpu   # the partition a CPU run uses
    python launch/plan.py +exp=flash parallel.pp=16 parallel.ep=64 --world 1024  # state shares with dp=64:
                                                # ZeRO-1 optimizer state, row-sharded Engram tables
    python launch/plan.py +exp=flash_2048gpu     # --world defaults to parallel.world; with parallel.cp:
                                                # per-rank tokens, attention imbalance of the chunkings
    python launch/plan.py +exp=flash --gpus 2048 --gpu-memory 80 --seq 65536   # layouts that fit
    python launch/plan.py +exp=flash_node --gpus 8 --gpu-memory 80             # one node
    python launch/plan.py +exp=flash --gpus 2048 --gpu-memory 80 --verify      # ... each position simulated

Takes `+exp=NAME` and any Hydra override (`model.dim=1024`, `parallel.pp=8`); builds nothing.

Without --gpus: parameter totals (text backbone, Engram tables, with text and vision separately, total),
activated parameters per token, parameters and tensors per optimizer (the V4.1 routing), the LR schedule
(total steps, tokens per step, step and LR at warmup end, decay start, decay end and the last step, the ViT
unfreeze step), the per-layer role table and per-layer parameter counts; with `parallel.pp=K` the pipeline
partition (layers, the partitioner's cost-model bytes and compute per stage under `train.recompute`,
imbalance) for a CUDA run (bf16 autocast) unless `--device cpu`.

With --gpus N --gpu-memory GB: for each stage of the recipe (`train.recipe`, train/recipe.py: exp=flash's
64K stage, then its 1M stage from 34T), the layout search of train/plan/layouts.py over pp x cp x ep x dp x pipeline
schedule x recompute mode with the partitioner's cost model. It prints the fastest layouts that fit
(`plan.show`) as ready-to-paste overrides, each with its per-GPU memory (cost model), pipeline compute
imbalance, bubble fraction and step time relative to the fastest (parallel/step_time.py; assumptions in
conf/plan/default.yaml), the configuration's own layout evaluated the same way, and how many layouts
each constraint rules out (world-size / batch divisibility, state, the Engram stage, activations), with
the example closest to fitting. Nothing fits: it says so, names the smallest GPU count (a power-of-two
multiple of N) and the smallest GPU memory that would fit, and exits 2. `--seq S` searches for that
sequence length alone (no stages); `--json` prints the report, or {"stages": [one report per stage, with
its "stage"]} for a recipe. `--verify` then runs
launch/estimate.py on every pipeline position of the first layout (two simulations side by side; each
recipe stage's first layout) and prints, per position, the simulated peak next to the cost model's figure,
whether each is within the cost model's stated error (`plan.cost_model_error`), and whether the largest
simulated peak fits the GPU less `plan.headroom`; the estimator shortens 1F1B steps to the micro-batches
that set the peak and simulates other schedules whole (hours for hundreds of micro-batches).

The cost model is a fast analytic view; per-GPU memory of a real step is launch/estimate.py's measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from flashtrain.config.cli import exit_on_user_error
from flashtrain.config.errors import EXIT_USER_ERROR, ConfigError

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def build_report(overrides: list[str], device: str = "cuda", world: int | None = None) -> dict:
    import torch
    from omegaconf import OmegaConf

    from flashtrain.config.typed import typed_config
    from flashtrain.model import Transformer
    from flashtrain.model.inspect import inspect_model
    from flashtrain.parallel.config import ParallelConfig
    from flashtrain.parallel.partition import in_flight_microbatches, in_flight_states, partition_report, rank_costs
    from flashtrain.parallel.pipeline import stage_ids
    from flashtrain.train.config import compose, global_sequences, model_config, optim_config, schedule
    from flashtrain.train.optim.routing import route_parameters, routing_summary
    from flashtrain.train.plan.stages import plan_stages, stage_units

    conf = compose(overrides)
    cfg, ocfg = model_config(conf), optim_config(conf)
    with torch.device("meta"):
        model = Transformer(cfg, init=False)
    report = inspect_model(model, cfg)
    groups = route_parameters(model, cfg, ocfg)
    report["optimizers"] = routing_summary(groups)
    parallel = typed_config(ParallelConfig, OmegaConf.to_container(conf.parallel, resolve=True), "parallel")
    world = world or parallel.world
    report["world"] = world
    seq_len = int(conf.data.seq_len)
    if parallel.cp > 1:
        report["context_parallel"] = context_parallel_report(seq_len, parallel.cp, parallel.cp_balance,
                                                             cfg.window_size)
    if parallel.pp > 1:
        dp = max(1, world // (parallel.pp * parallel.cp)) if world else 1
        # micro-batches per round (one round unless parallel.microbatches says otherwise): interleaved 1F1B's
        # in-flight counts depend on it, and the device holds the round's inputs
        m = parallel.microbatches or max(1, global_sequences(float(conf.train.global_batch_tokens), seq_len)
                                         // (dp * int(conf.data.batch_size)))
        units = stage_units(model, cfg, ocfg, parallel, seq_len, int(conf.data.batch_size),
                            str(conf.train.recompute), device == "cuda", dp * parallel.cp, parallel.cp, m)
        flight = in_flight_microbatches(parallel.pp, parallel.pipeline_schedule, m)
        bounds = plan_stages(units, parallel, m)
        report["pipeline"] = partition_report(units, bounds, flight)
        report["pipeline"]["dp"] = dp
        report["pipeline"]["cp"] = parallel.cp
        report["pipeline"].update(pp=parallel.pp, schedule=parallel.pipeline_schedule, n_stages=parallel.n_stages,
                                  stages_of_rank=[stage_ids(parallel, r) for r in range(parallel.pp)])
        if parallel.stages_per_rank > 1:  # what a rank holds: the sum of its stages
            st, of_rank = report["pipeline"]["stages"], report["pipeline"]["stages_of_rank"]
            costs = rank_costs(units, bounds, of_rank, in_flight_states(parallel.pp, parallel.pipeline_schedule, m))
            ranks = [{"bytes": b, "flops_per_token": sum(st[i]["flops_per_token"] for i in ids)}
                     for b, ids in zip(costs, of_rank)]
            report["pipeline"]["ranks"] = ranks
            for k, name in (("bytes", "rank_imbalance_bytes"), ("flops_per_token", "rank_imbalance_compute")):
                report["pipeline"][name] = max(r[k] for r in ranks) / (sum(r[k] for r in ranks) / len(ranks))
    report["schedule"] = schedule(conf).summary()
    report["overrides"] = overrides
    return report


def context_parallel_report(seq_len: int, cp: int, balance: str, window: int) -> dict:
    """Per-rank attention / indexing cost of each chunk assignment (model/sequence_split.py): causal work
    grows with position, so contiguous slices leave the last rank the most; max / mean per rank."""
    from flashtrain.model.sequence_split import causal_cost, chunk_ranges

    def imbalance(mode: str) -> float:
        costs = [causal_cost(chunks, seq_len, window) for chunks in chunk_ranges(seq_len, cp, mode)]
        return max(costs) / (sum(costs) / len(costs))

    return {"cp": cp, "balance": balance, "local_tokens": -(-seq_len // cp),
            "imbalance_attention": {mode: imbalance(mode) for mode in ("contiguous", "zigzag")}}


def _b(n: int) -> str:
    return f"{n / 1e9:,.3f}B" if n >= 1e8 else f"{n / 1e6:,.3f}M"


def format_report(report: dict) -> str:
    lines = [
        f"plan for {' '.join(report['overrides']) or '(defaults)'}",
        f"  backbone               {_b(report['params_backbone']):>12}  ({report['params_backbone']:,})",
        f"    text                 {_b(report['params_text']):>12}  ({report['params_text']:,})",
        f"    vision               {_b(report['params_vision']):>12}  ({report['params_vision']:,}; "
        f"ViT {_b(report['params_vit'])})",
        f"  Engram tables          {_b(report['params_engram']):>12}  ({report['params_engram']:,})",
        f"  total                  {_b(report['params_total']):>12}  ({report['params_total']:,})",
        f"  activated per token    {_b(report['params_activated_per_token']):>12}",
        "",
        "  schedule               " + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in report["schedule"].items()),
        "",
        "  optimizers             params        tensors  by rule",
        *[f"  {name:<14} {_b(o['params']):>14} {o['tensors']:>14}  "
          + ", ".join(f"{r} {_b(n)}" for r, n in sorted(o["rules"].items()))
          for name, o in report["optimizers"].items()],
        *([""] + [f"  pipeline pp={report['pipeline']['pp']} ({report['pipeline']['schedule']}, "
                  f"{report['pipeline']['n_stages']} stages; stages of each rank "
                  f"{report['pipeline']['stages_of_rank']}): imbalance (max/mean) bytes "
                  f"{report['pipeline']['imbalance_bytes']:.3f}, compute {report['pipeline']['imbalance_compute']:.3f}"]
          + [f"    stage {st['stage']}: layers {st['layers'][0]:>2}-{st['layers'][1]:>2}  "
             f"{st['bytes'] / 2**30:10.1f} GiB (state {st['state_bytes'] / 2**30:.1f}, activations "
             f"{st['activation_bytes'] / 2**30:.1f})  {st['flops_per_token'] / 1e9:8.2f} GFLOP/token"
             for st in report["pipeline"]["stages"]]
          + ["    (partitioner cost model, not a measurement: per-GPU memory of a real step is "
             "launch/estimate.py's)"]
          + ([f"    per rank: imbalance bytes {report['pipeline']['rank_imbalance_bytes']:.3f}, compute "
              f"{report['pipeline']['rank_imbalance_compute']:.3f}"] if "ranks" in report["pipeline"] else [])
          if "pipeline" in report else []),
        *([f"  context parallel cp={report['context_parallel']['cp']} ({report['context_parallel']['balance']}): "
           f"{report['context_parallel']['local_tokens']} tokens of each sequence per rank; attention / indexing "
           f"imbalance (max/mean per rank) contiguous "
           f"{report['context_parallel']['imbalance_attention']['contiguous']:.3f}, zigzag "
           f"{report['context_parallel']['imbalance_attention']['zigzag']:.3f}"]
          if "context_parallel" in report else []),
        "",
        f"{'layer':>5} {'role':<8} {'ratio':>5} {'kv_src':>6} {'idx_src':>7} {'cand':<6} {'engram':<6}"
        f" {'params':>12} {'attn':>10} {'ffn':>10} {'engram':>10}",
    ]
    for l in report["layers"]:
        cand = "source" if l["candidate_source"] else ("uses" if l["uses_candidates"] else "")
        kv = "" if l["kv_source"] is None else l["kv_source"]
        ix = "" if l["index_source"] is None else l["index_source"]
        lines.append(
            f"{l['id']:>5} {l['role']:<8} {l['compress_ratio']:>5} {kv:>6} {ix:>7} {cand:<6} "
            f"{'yes' if l['engram'] else '':<6} {_b(l['params']):>12} {_b(l['params_attn']):>10} "
            f"{_b(l['params_ffn']):>10} {_b(l['params_engram']) if l['params_engram'] else '':>10}")
    return "\n".join(lines)


# --- the layout search ------------------------------------------------------------------------------
def _row(i: int, x: dict, best: float) -> str:
    worst = x["rank_bytes"].index(max(x["rank_bytes"]))
    return (f"{i:>3} {x['pp']:>3} {x['cp']:>4} {x['ep']:>4} {x['dp']:>5}  "
            f"{x['pipeline_schedule'] if x['pp'] > 1 else '-':<16} {x['recompute']:<9} {gb(x['peak_bytes']):>10} "
            f"{worst:>6} {x['imbalance_compute']:>9.3f} {100 * x['bubble_fraction']:>6.1f}% {x['step_s'] / best:>9.2f}")


def gb(n: float) -> str:
    from flashtrain.train.plan.layouts import gb as layouts_gb

    return layouts_gb(n)


def propose(overrides: list[str], gpus: int, gpu_memory_gb: float, seq: int | None) -> dict:
    """The layout search (train/plan/layouts.py) as a report: the layouts that fit, the config's own, what rules
    out the rest, and -- when nothing fits -- the smallest GPU count and memory that would."""
    from flashtrain.train.config import compose
    from flashtrain.train.plan.layouts import LayoutSearch

    if gpus < 1 or gpu_memory_gb <= 0:
        raise ConfigError(f"--gpus {gpus} --gpu-memory {gpu_memory_gb:g}: give a positive number of GPUs and GB")
    if seq is not None and seq < 1:
        raise ConfigError(f"--seq {seq}: a sequence length in tokens, >= 1")
    overrides = overrides + ([f"data.seq_len={seq}"] if seq is not None else [])
    search = LayoutSearch(compose(overrides), gpu_memory_gb)
    result = search.run(gpus)
    own = search.configured_layout(gpus)
    args = (gpus, search.seq_len, search.budget_gb)
    report = {"gpus": gpus, "gpu_memory_gb": gpu_memory_gb, "budget_gb": search.budget_gb,
              "usable_gb": search.usable / 1e9,
              "headroom": search.plan.headroom, "seq_len": search.seq_len,
              "global_sequences": search.global_sequences, "overrides": overrides, "considered": result.considered,
              "cost_model_error": search.plan.cost_model_error,
              "layouts": [x.as_dict(*args) for x in result.fitting],
              "own": None if own is None else own.as_dict(*args),
              "ruled_out": {reason: {"count": len(xs), "example": _closest(xs).as_dict(*args)}
                            for reason, xs in sorted(result.by_reason().items(), key=lambda kv: -len(kv[1]))}}
    if not result.fitting:
        report["smallest_gpu_memory_gb"] = result.smallest_memory_gb(search.plan)
        report["smallest_gpus"] = search.smallest_world(gpus)
    report["show"] = search.plan.show
    return report


def _closest(layouts):
    """The example of a reason: the layout nearest to fitting (the smallest peak), or the first."""
    measured = [x for x in layouts if x.rank_bytes]
    return min(measured, key=lambda x: x.peak_bytes) if measured else layouts[0]


def format_proposals(r: dict) -> str:
    from flashtrain.train.plan.layouts import REASONS

    low = r["cost_model_error"][0]
    lines = [f"layouts for {r['gpus']} GPUs of {r['gpu_memory_gb']:g} GB, data.seq_len={r['seq_len']}, global batch "
             f"{r['global_sequences']} sequences: a rank's peak may reach {gb(r['usable_gb'] * 1e9)} GB "
             f"({100 * r['headroom']:g}% left to the allocator and communication buffers, plan.headroom), so its "
             f"cost-model figure {r['budget_gb']:g} GB (the cost model may be {-100 * low:g}% below the estimator, "
             f"plan.cost_model_error)",
             f"{r['considered']} layouts considered, {len(r['layouts'])} fit (per pp, schedule and recompute mode: "
             f"the smallest cp, then ep, that fits)"]
    shown = r["layouts"][:r["show"]]
    if shown:
        best = shown[0]["step_s"]
        lines += ["", "  #  pp   cp   ep    dp  schedule         recompute  GB per GPU  worst  imbalance  bubble  "
                      "rel. step",
                  *[_row(i, x, best) for i, x in enumerate(shown, 1)],
                  "  (GB per GPU: the partitioner's cost model at the worst pipeline position; imbalance: slowest / "
                  "mean pipeline rank's compute; rel. step: step time relative to #1, parallel/step_time.py)",
                  "", "ready to paste (after your overrides):",
                  *[f"  {i}. {' '.join(x['overrides'])}" for i, x in enumerate(shown, 1)]]
    own = r["own"]
    if own is not None:
        lines += ["", f"your config's layout (pp={own['pp']} cp={own['cp']} ep={own['ep']} "
                      f"{own['pipeline_schedule']}, recompute={own['recompute']}): " + (
                          f"fits, {gb(own['peak_bytes'])} GB per GPU, imbalance {own['imbalance_compute']:.3f}, "
                          f"bubble {100 * own['bubble_fraction']:.1f}%, rel. step "
                          f"{own['step_s'] / shown[0]['step_s']:.2f}" if own["fits"] and shown else
                          f"ruled out by {REASONS[own['reason']]}: {own['detail']}")]
    if r["ruled_out"]:
        lines += ["", "ruled out (at the largest ep; the example is the one closest to fitting):"]
        for reason, v in r["ruled_out"].items():
            x = v["example"]
            lines.append(f"  {v['count']:>5} by {REASONS[reason]}, e.g. pp={x['pp']} cp={x['cp']} "
                         f"{x['pipeline_schedule'] + ' ' if x['pp'] > 1 else ''}recompute={x['recompute']}: "
                         f"{x['detail']}")
    return "\n".join(lines)


def nothing_fits(r: dict) -> ConfigError:
    gpus = (f"{r['smallest_gpus']} GPUs of {r['gpu_memory_gb']:g} GB" if r.get("smallest_gpus")
            else f"no power-of-two multiple of {r['gpus']} GPUs up to {1024 * r['gpus']}")
    memory = (f"{r['gpus']} GPUs of {r['smallest_gpu_memory_gb']} GB" if r.get("smallest_gpu_memory_gb")
              else "no memory size (no layout can be built)")
    return ConfigError(f"no layout fits {r['gpus']} GPUs of {r['gpu_memory_gb']:g} GB (budget {r['budget_gb']:g} GB "
                       f"per GPU, cost model); the smallest that would fit: {gpus}, or {memory}")


def verify(r: dict, overrides: list[str], device: str, jobs: int = 2) -> dict:
    """launch/estimate.py on every pipeline position of the first layout (its first rank: the ranks of one
    position hold equal shares), `jobs` simulations side by side: each position's simulated peak against
    its cost-model figure, and whether the simulated peaks fit the GPU less `plan.headroom`. The
    estimator's per-rank lines are passed on as they come (prefixed `verify:`)."""
    from flashtrain.train.plan.estimate import shortened_round

    x = r["layouts"][0]
    cmd = [sys.executable, str(ROOT / "launch" / "estimate.py"), *overrides, *x["overrides"], "--world",
           str(r["gpus"]), "--device", device, "--jobs", str(jobs), "--json"]
    whole = x["pp"] > 1 and shortened_round(x["pp"], x["pipeline_schedule"], x["microbatches"], 0) > 2 * x["pp"]
    print(f"verify: launch/estimate.py on every pipeline position of layout 1, {jobs} at a time ..." + (
        f" ({x['pipeline_schedule']} is simulated whole: {x['microbatches']} micro-batches, which may take hours)"
        if whole else ""), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    for line in proc.stderr:  # progress: one line per simulated rank
        err.append(line)
        print(f"verify: {line.rstrip()}", file=sys.stderr, flush=True)
    stdout = proc.stdout.read()
    proc.wait()
    if proc.returncode == EXIT_USER_ERROR:
        raise ConfigError("".join(err).strip().splitlines()[-1].removeprefix("error: "))
    if proc.returncode != 0:
        raise SystemExit(f"error: the estimator failed on layout 1:\n{''.join(err)[-4000:]}")
    low, high = r["cost_model_error"]
    positions = []
    for position, est in enumerate(json.loads(stdout.strip().splitlines()[-1])["ranks"]):
        model, simulated = x["rank_bytes"][position], est["peak_bytes"]
        positions.append({"position": position, "rank": est["rank"], "stages": est["stages"],
                          "cost_model_bytes": model, "simulated_peak_bytes": simulated,
                          "cost_model_error": model / simulated - 1,
                          "within_stated_error": low <= model / simulated - 1 <= high})
    usable = r["usable_gb"] * 1e9
    worst = max(positions, key=lambda q: q["simulated_peak_bytes"])
    return {"positions": positions, "rank": worst["rank"], "simulated_peak_bytes": worst["simulated_peak_bytes"],
            "cost_model_bytes": worst["cost_model_bytes"], "cost_model_error": worst["cost_model_error"],
            "largest_error": max((q["cost_model_error"] for q in positions), key=abs),
            "within_stated_error": all(q["within_stated_error"] for q in positions),
            "usable_bytes": usable, "fits": worst["simulated_peak_bytes"] <= usable,
            "seconds": round(time.monotonic() - t0, 1), "command": " ".join(cmd[1:])}


def format_verify(v: dict, r: dict) -> str:
    low, high = r["cost_model_error"]
    lines = [f"verify (layout 1, every pipeline position simulated by launch/estimate.py in {v['seconds']:.0f} s):",
             "  position    rank  stages  cost model GB  simulated GB  cost model / simulated - 1",
             *[f"  {q['position']:>8} {q['rank']:>7}  {','.join(map(str, q['stages'])):>6}  "
               f"{gb(q['cost_model_bytes']):>12}  {gb(q['simulated_peak_bytes']):>12}  "
               f"{100 * q['cost_model_error']:+.1f}%" + ("" if q["within_stated_error"] else "  OUTSIDE")
               for q in v["positions"]],
             f"  the cost model is within {100 * abs(v['largest_error']):.1f}% of the simulation at every position: "
             + ("within" if v["within_stated_error"] else "OUTSIDE")
             + f" its stated error ({100 * low:+.0f}% to {100 * high:+.0f}%, plan.cost_model_error)",
             f"  the largest simulated peak, {gb(v['simulated_peak_bytes'])} GB (rank {v['rank']}), "
             + (f"fits the {gb(v['usable_bytes'])} GB a rank may use" if v["fits"] else
                f"is OVER the {gb(v['usable_bytes'])} GB a rank may use: layout 1 does not fit; verify the next "
                f"one (paste its overrides, or --gpu-memory a little lower)")]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from flashtrain.config.cli import overrides_help

    ap = argparse.ArgumentParser(epilog=overrides_help("Default: the defaults of conf/config.yaml (flash_small)."),
        prog="launch/plan.py", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        usage="python launch/plan.py [+exp=NAME] [HYDRA OVERRIDES...] [--json] [--device cuda|cpu] [--world N]\n"
              "       python launch/plan.py +exp=NAME --gpus N --gpu-memory GB [--seq S] [--verify] [--json]",
        description=__doc__.split("\n\n", 1)[0] + "\n\n" + __doc__.split("\n\n", 1)[1].split("\n\nThe cost")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="the run the cost model prices: cuda = bf16 autocast (default), cpu = fp32 throughout")
    ap.add_argument("--world", type=int, default=None,
                    help="processes of the layout shown without --gpus (gives dp for the ZeRO-1 and Engram shares); "
                         "default: the config's parallel.world, and null there means one pipeline (dp=1)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="propose layouts for this many GPUs (needs --gpu-memory); default: no search")
    ap.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                    help="memory of one GPU in GB (1e9 bytes), e.g. 80; a layout fits when its cost-model peak is "
                         "within GB x (1 - plan.headroom) x (1 + plan.cost_model_error[0]): 80 -> 64.8")
    ap.add_argument("--seq", type=int, default=None, metavar="S",
                    help="sequence length of the search (data.seq_len=S); default: the config's data.seq_len")
    ap.add_argument("--verify", action="store_true",
                    help="simulate every pipeline position of the first proposal (launch/estimate.py) and "
                         "compare (minutes at scale)")
    return ap


def main(argv: list[str]) -> int:
    args, overrides = parser().parse_known_args(argv)
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; see python launch/plan.py --help")
    if (args.gpus is None) != (args.gpu_memory is None):
        raise ConfigError("--gpus N and --gpu-memory GB go together: the GPUs to plan for and the memory of each")
    if args.gpus is None:
        if args.seq is not None or args.verify:
            raise ConfigError("--seq and --verify belong to the layout search: add --gpus N --gpu-memory GB")
        report = build_report(overrides, args.device, args.world)
        print(json.dumps(report) if args.json else format_report(report))
        return 0
    stages = recipe_stages(overrides) if args.seq is None else [("", 0.0, [])]
    reports = []
    for name, from_tokens, extra in stages:  # the recipe's stages (train.recipe): a layout search for each
        report = propose(overrides + extra, args.gpus, args.gpu_memory, args.seq)
        if report["layouts"] and args.verify:
            report["verify"] = verify(report, report["overrides"], args.device)
        if name:
            report["stage"] = {"name": name, "from_tokens": from_tokens, "overrides": extra}
        reports.append(report)
        if not args.json:
            if name:
                print(f"{'' if len(reports) == 1 else chr(10)}== recipe stage {name!r} (from {from_tokens:g} tokens"
                      f"{': ' + ' '.join(extra) if extra else ''}) ==")
            print(format_proposals(report))
            if "verify" in report:
                print("\n" + format_verify(report["verify"], report))
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else {"stages": reports}))
    if empty := [r for r in reports if not r["layouts"]]:
        raise nothing_fits(empty[0])
    return 0


def recipe_stages(overrides: list[str]) -> list[tuple[str, float, list[str]]]:
    """(name, from tokens, the overrides that make it) of each stage of the recipe (train/recipe.py); one
    unnamed entry for a config without stages."""
    from flashtrain.train.config import compose
    from flashtrain.train.recipe import stage_list, stage_name, stage_overrides

    conf = compose(overrides)
    stages = stage_list(conf)
    if not stages:
        return [("", 0.0, [])]
    return [(stage_name(conf, k), stages[k - 1].from_tokens if k else 0.0, stage_overrides(conf, k))
            for k in range(len(stages) + 1)]


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main, sys.argv[1:]))
