"""Dry-run planner: build the model on the meta device (no memory) and report its shape.

    python launch/plan.py +exp=flash            # human-readable
    python launch/plan.py +exp=flash --json     # one JSON object
    python launch/plan.py +exp=flash_small parallel.pp=2 --device cpu   # the partition a CPU run uses
    python launch/plan.py +exp=flash parallel.pp=16 parallel.ep=64 --world 1024  # state shares with dp=64:
                                                # ZeRO-1 optimizer state, row-sharded Engram tables
    python launch/plan.py +exp=flash_2048gpu     # --world defaults to parallel.world; with parallel.cp:
                                                # per-rank tokens, attention imbalance of the chunkings

Any Hydra override works (`model.dim=1024`). Reports parameter totals (text backbone, Engram tables,
with text and vision separately, total), activated parameters per token, parameters and tensors per optimizer
(the V4.1 routing), the
with `parallel.pp=K` the pipeline partition (layers, the partitioner's cost-model bytes and compute per
stage under `train.recompute`, imbalance -- a fast analytic view for choosing stage boundaries, for a CUDA
run (bf16 autocast) unless `--device cpu`; the measurement of per-GPU memory is launch/estimate.py, which
simulates the real training step),
the LR schedule (total steps, tokens per step, step and LR at warmup end, decay start, decay end and the
last step, the ViT unfreeze step), the per-layer role table and per-layer parameter counts.
"""

from __future__ import annotations

import json
import sys

import torch  # noqa: E402

from flashtrain.config.cli import exit_on_user_error  # noqa: E402
from flashtrain.config.errors import ConfigError  # noqa: E402
from flashtrain.config.typed import typed_config
from flashtrain.model import Transformer  # noqa: E402
from flashtrain.model.inspect import inspect_model  # noqa: E402
from flashtrain.parallel.config import ParallelConfig  # noqa: E402
from flashtrain.parallel.partition import in_flight_microbatches, partition_report  # noqa: E402
from flashtrain.parallel.pipeline import stage_ids  # noqa: E402
from flashtrain.train.config import compose, model_config, optim_config, schedule  # noqa: E402
from flashtrain.train.optim.routing import route_parameters, routing_summary  # noqa: E402
from flashtrain.train.stages import plan_stages, stage_units  # noqa: E402


def build_report(overrides: list[str], device: str = "cuda", world: int | None = None) -> dict:
    conf = compose(overrides)
    cfg, ocfg = model_config(conf), optim_config(conf)
    with torch.device("meta"):
        model = Transformer(cfg, init=False)
    report = inspect_model(model, cfg)
    groups = route_parameters(model, cfg, ocfg)
    report["optimizers"] = routing_summary(groups)
    from omegaconf import OmegaConf

    parallel = typed_config(ParallelConfig, OmegaConf.to_container(conf.parallel, resolve=True), "parallel")
    world = world or parallel.world
    report["world"] = world
    seq_len = int(conf.data.seq_len)
    if parallel.cp > 1:
        report["context_parallel"] = context_parallel_report(seq_len, parallel.cp, parallel.cp_balance,
                                                             cfg.window_size)
    if parallel.pp > 1:
        dp = max(1, world // (parallel.pp * parallel.cp)) if world else 1
        units = stage_units(model, cfg, ocfg, parallel, seq_len, int(conf.data.batch_size),
                            str(conf.train.recompute), device == "cuda", dp * parallel.cp, parallel.cp)
        flight = in_flight_microbatches(parallel.pp, parallel.pipeline_schedule)
        report["pipeline"] = partition_report(units, plan_stages(units, parallel), flight)
        report["pipeline"]["dp"] = dp
        report["pipeline"]["cp"] = parallel.cp
        report["pipeline"].update(pp=parallel.pp, schedule=parallel.pipeline_schedule, n_stages=parallel.n_stages,
                                  stages_of_rank=[stage_ids(parallel, r) for r in range(parallel.pp)])
        if parallel.stages_per_rank > 1:  # what a rank holds: the sum of its stages
            st = report["pipeline"]["stages"]
            ranks = [{k: sum(st[i][k] for i in ids) for k in ("bytes", "flops_per_token")}
                     for ids in report["pipeline"]["stages_of_rank"]]
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


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    device, world = "cuda", None
    overrides = [a for a in argv if a != "--json"]
    if "--world" in overrides:
        at = overrides.index("--world")
        try:
            world = int(overrides[at + 1])
        except (IndexError, ValueError):
            raise ConfigError("--world needs a number of processes") from None
        del overrides[at:at + 2]
    if "--device" in overrides:
        at = overrides.index("--device")
        device = overrides[at + 1] if at + 1 < len(overrides) else ""
        del overrides[at:at + 2]
    unknown = [a for a in overrides if a.startswith("--")]
    if unknown or device not in ("cuda", "cpu"):
        raise ConfigError(f"unknown option(s) {unknown or ['--device ' + device]}; usage: python launch/plan.py "
                          f"[+exp=NAME] [hydra overrides...] [--device cuda|cpu] [--world N] [--json]")
    report = build_report(overrides, device, world)
    print(json.dumps(report) if as_json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main, sys.argv[1:]))
