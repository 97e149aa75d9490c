"""The one prepared device check: everything that has to be seen on a GPU, in one command of at most ~8
minutes on one H200, writing a JSON report and a short text summary. A measurement script, not a test
(tests/test_check_gpu.py runs its reduced CPU form).

    python launch/check_gpu.py [--out DIR] [--budget-s 480]
    TRITON_INTERPRET=1 python launch/check_gpu.py --cpu [--out DIR] [--budget-s 1800]   # the reduced form

Options: `--out DIR` where the report goes (default runs/check_gpu); `--budget-s S` the time budget in
seconds for all sections together (default 480 on a GPU, 1800 for --cpu); `--cpu` the reduced form on the
CPU (needs TRITON_INTERPRET=1). It takes no +exp= or Hydra overrides: the exps (flash, flash_node,
flash_small; flash_tiny for --cpu) and their overrides are fixed in `plan_for` below, so that every run
of the check measures the same thing. Run it on a GPU under a timeout of its budget plus a few minutes
(`timeout 660 python launch/check_gpu.py`): every section writes the report as it ends.

Sections, in this order, each guarded (an error is recorded with its traceback's last line and the next
section runs) and each started only while the global time budget (`--budget-s`) lasts (a section left
out is recorded as skipped); subprocesses get the time that is left:

1. `estimate` (started first, in the background, on the CPU cores: it needs no GPU): launch/estimate.py
   for the training run of section 3, one rank, device cuda.
2. `kernels`: every kernel against its reference (launch/check_kernels.py `check`: sparse attention,
   indexer top-k, the mHC mixes / collapse / expand, grouped experts, Newton-Schulz, Sinkhorn) at the widths
   of exp=flash, flash_node and flash_small (one sequence of 4096 tokens), in bf16 and fp32: relative
   differences of every output and input gradient, and each side's time.
3. `train`: 20 steps of flash_small on one GPU under torchrun (a process group of one: NCCL), bf16
   autocast, the Triton path (the CUDA default), a CUDA memory snapshot of steps 5-6
   (`train.profile.memory_snapshot`); its losses, tokens/s, MFU and per-step allocation peaks
   (`memory_peak_bytes` in metrics.jsonl).
4. `bench_small`: launch/bench_model.py on flash_small (seq 512): reference, kernels and the kernels
   compiled per block (`--compile`), alternated; tokens/s, MFU, compile time.
5. `bench_node`: launch/bench_model.py at flash_node's widths (dim 1280, 16 heads x 256, 40 layers, top-512
   of 32 index heads x 64, 16K sequences, recompute full) with 32 of its 64 routed experts (4.95B
   parameters; the activated count, so the FLOPs per token, within 0.2% of flash_node's): the kernels eager
   and compiled, two models and their gradients, no optimizer state (`--no-optim`), which is what fits one
   H200 (141 GB); 16 experts if 32 fail.
6. `estimator`: the estimate of section 1 against the training run's real peak (the largest
   `memory_peak_bytes` of steps 3-20, when the optimizer state exists).

The reduced form (`--cpu`, under TRITON_INTERPRET=1): flash_tiny on the 4-layer plan everywhere, the kernels
in fp32 only (the interpreter's; one call a side), 2 training steps on gloo and bench_model (reference and
the CPU default, without the compiled variant) with the references as any CPU run (TRITON_INTERPRET=0 for
them), the flash_node-width bench left out, and no device peak to compare the estimate with.
It runs every section's code, so the script is known to work when a GPU comes.

Output: DIR/check_gpu.json ({"device", "sections": {name: {"status": ok | error | skipped, "seconds",
"result" | "error"}}}), DIR/summary.txt (also printed). Exit status 1 when a section failed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))

from flashtrain.config.cli import exit_on_user_error, exit_with_help  # noqa: E402 - imports nothing heavy
from flashtrain.config.errors import FlashtrainError  # noqa: E402

if __name__ == "__main__":
    exit_with_help(__doc__, sys.argv[1:], overrides=False)  # --help: this docstring, before the slow imports

FOUR_LAYERS = ["model.n_layers=4", "model.compress_ratios=[0,0,2,2]", "model.kv_source_layers=[2]",
               "model.index_source_layers=[2]", "model.candidate_source_layer=2", "model.engram_layer_ids=[1]"]
NODE_EXPERTS = (32, 16)  # bench_node: the flash_node-width configurations tried, largest first


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def _run(cmd: list[str], budget: Budget, env: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, budget.left()),
                         env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {out.returncode}: {out.stderr.strip()[-800:]}")
    return out


# ------------------------------------------------------------------------------------------------ sections
def kernels(plan: dict, budget: Budget) -> dict:
    import torch
    from check_kernels import check

    from flashtrain.train.config import compose, model_config

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    for exp, overrides in plan["kernel_exps"].items():
        for dtype in plan["kernel_dtypes"]:
            key = f"{exp}/{dtype}"
            if budget.left() <= 0:
                out[key] = {"status": "skipped", "reason": "time budget"}
                continue
            t0 = time.perf_counter()
            try:
                torch.manual_seed(0)
                rep = check(model_config(compose(overrides)), plan["kernel_seq"], getattr(torch, dtype),
                            plan["kernel_rounds"], dev, warmup=plan["kernel_warmup"])
                out[key] = {"status": "ok", "seconds": round(time.perf_counter() - t0, 1),
                            "report": {k: {"differences": d, "seconds": t} for k, (d, t) in rep.items()}}
            except Exception as e:  # noqa: BLE001 - one exp / dtype failing keeps the others
                out[key] = {"status": "error", "error": _error(e)}
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return out


def train(plan: dict, budget: Budget, out_dir: Path) -> dict:
    run = out_dir / "train"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "launch" / "pretrain.py"), *plan["train"], f"hydra.run.dir={run}"]
    _run(cmd, budget, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4"), **plan["env"]})
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r and "step" in r and r.get("event") is None]
    log = (run / "pretrain.log").read_text() if (run / "pretrain.log").exists() else ""
    backend = next((line.split("process group ")[-1].strip() for line in log.splitlines() if "process group " in line),
                   None)
    snapshots = sorted(str(p.relative_to(out_dir)) for p in (run / "profile").glob("memory_snapshot*.pickle")) \
        if (run / "profile").exists() else []
    peaks = [r["memory_peak_bytes"] for r in steps[2:] if r.get("memory_peak_bytes") is not None]
    later = steps[2:] or steps
    return {"steps": len(steps), "loss": [r["loss"] for r in steps], "process_group": backend,
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in later),
            "mfu_median": statistics.median(r["mfu"] for r in later) if all(r.get("mfu") for r in later) else None,
            "memory_peak_bytes": max(peaks) if peaks else None, "memory_snapshots": snapshots,
            "overrides": plan["train"]}


def bench(args: list[str], budget: Budget, env: dict) -> dict:
    out = _run([sys.executable, str(ROOT / "launch" / "bench_model.py"), *args], budget, env)
    res = _last_json(out.stdout)
    keep = ("exp", "seq", "params", "device", "peak_flops", "flops_per_token", "variants", "compile_s",
            "compiled_vs_eager_speedup", "kernels_vs_reference_speedup", "compiled_eager_variant")
    return {k: res.get(k) for k in keep}


def bench_node(plan: dict, budget: Budget) -> dict:
    errors = []
    for experts in plan["node_experts"]:
        try:
            return {"n_routed_experts": experts, **bench([*plan["node"], f"model.n_routed_experts={experts}"],
                                                         budget, plan["env"])}
        except Exception as e:  # noqa: BLE001 - out of memory: the next, smaller configuration
            errors.append(f"{experts} experts: {_error(e)}")
            if budget.left() <= 0:
                break
    raise RuntimeError("; ".join(errors))


def estimator(started: dict, train_result: dict | None, budget: Budget) -> dict:
    proc = started["proc"]
    stdout, stderr = proc.communicate(timeout=max(1.0, budget.left()))
    if proc.returncode != 0:
        raise RuntimeError(f"launch/estimate.py exited {proc.returncode}: {stderr.strip()[-800:]}")
    est = _last_json(stdout)["ranks"][0]
    real = (train_result or {}).get("memory_peak_bytes")
    return {"estimate_peak_bytes": est["peak_bytes"], "estimate": est, "real_peak_bytes": real,
            "estimate_over_real": est["peak_bytes"] / real if real else None,
            "note": None if real else "no device peak (the CPU form, or the training run did not finish)"}


def _error(e: Exception) -> str:
    tb = traceback.format_exception_only(type(e), e)
    return " ".join("".join(tb).split())[:1000]


# ------------------------------------------------------------------------------------------------ plans
def plan_for(cpu: bool, out_dir: Path) -> dict:
    corpus = f"data.corpus_dir={out_dir / 'corpus'}"
    common = ["logging.wandb.mode=disabled", "logging.progress=false", "train.eval.interval=0",
              "train.checkpoint.interval=1000", corpus]
    if cpu:
        tiny = ["+exp=flash_tiny", *FOUR_LAYERS]
        return {"kernel_exps": {"flash_tiny": tiny}, "kernel_dtypes": ["float32"], "kernel_seq": 64,
                "kernel_rounds": 1, "kernel_warmup": 0,  # the interpreter's times say nothing: one call a side
                "train": [*tiny, "train.max_steps=2", "data.corpus_text_bytes=400000", "data.corpus_mm_docs=50",
                          "data.corpus_shards=4", "train.profile.memory_snapshot=true", "train.profile.memory_steps=1",
                          *common],
                "estimate": [*tiny, "--device", "cpu"],
                "small": [*tiny, "--seq", "64", "--rounds", "1", "--no-optim"], "node": None, "node_experts": (),
                # the training run and the benchmark as on a CPU: the references (the interpreter only for the kernels)
                "env": {"TRITON_INTERPRET": "0"}}
    return {"kernel_exps": {e: [f"+exp={e}"] for e in ("flash", "flash_node", "flash_small")},
            "kernel_dtypes": ["bfloat16", "float32"], "kernel_seq": 4096, "kernel_rounds": 3, "kernel_warmup": 1,
            "train": ["+exp=flash_small", "train.max_steps=20", "train.profile.memory_snapshot=true",
                      "train.profile.memory_steps=[5,6]", *common],
            "estimate": ["+exp=flash_small", "--device", "cuda"],
            "small": ["+exp=flash_small", "--seq", "512", "--rounds", "3", "--compile"],
            "node": ["+exp=flash_node", "--seq", "16384", "--rounds", "2", "--no-optim", "--compile",
                     "--variants", "kernels"],
            "node_experts": NODE_EXPERTS, "env": {}}


def summary(report: dict) -> str:
    lines = [f"check_gpu on {report['device']} ({report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget)"]
    for name, sec in report["sections"].items():
        head = f"{name:<12} {sec['status']:<8} {sec.get('seconds', 0):6.1f} s"
        res = sec.get("result") or {}
        if sec["status"] != "ok":
            lines.append(f"{head}  {sec.get('error') or sec.get('reason', '')}"[:300])
        elif name == "kernels":
            for key, part in res.items():
                if part["status"] != "ok":
                    lines.append(f"{head}  {key}: {part['status']} {part.get('error', part.get('reason', ''))}"[:300])
                    continue
                worst = max((v for k in part["report"].values() for n, v in k["differences"].items()
                             if "differing" not in n), default=0.0)
                lines.append(f"{head}  {key}: largest relative difference {worst:.2e}")
        elif name == "train":
            peak = res.get("memory_peak_bytes")
            lines.append(f"{head}  {res['steps']} steps, loss {res['loss'][0]:.3f} -> {res['loss'][-1]:.3f}, "
                         f"{res['tokens_per_s_median']:,.0f} tokens/s, process group {res['process_group']}, peak "
                         + (f"{peak / 2**30:.2f} GiB" if peak else "n/a")
                         + f", {len(res['memory_snapshots'])} snapshot(s)")
        elif name.startswith("bench"):
            parts = [f"{v}: {d['fwd_bwd_tokens_per_s']:,.0f} tokens/s"
                     + (f" (MFU {100 * d['mfu']:.1f}%)" if d.get("mfu") else "") for v, d in res["variants"].items()]
            extra = f"; compile {res['compile_s']:.0f} s" if res.get("compile_s") is not None else ""
            lines.append(f"{head}  {'; '.join(parts)}{extra}")
        elif name == "estimator":
            ratio = res.get("estimate_over_real")
            lines.append(f"{head}  estimate {res['estimate_peak_bytes'] / 2**30:.2f} GiB"
                         + (f" vs real {res['real_peak_bytes'] / 2**30:.2f} GiB ({ratio:.3f}x)" if ratio else
                            f" ({res['note']})"))
        else:
            lines.append(head)
    return "\n".join(lines)


def parse(argv: list[str]) -> tuple[bool, Path, float]:
    """(--cpu, --out, --budget-s); anything else is an error naming it."""
    cpu, out, budget, rest = False, ROOT / "runs" / "check_gpu", None, list(argv)
    while rest:
        a = rest.pop(0)
        if a == "--cpu":
            cpu = True
        elif a in ("--out", "--budget-s") and rest:
            v = rest.pop(0)
            if a == "--out":
                out = Path(v)
            else:
                try:
                    budget = float(v)
                except ValueError:
                    raise FlashtrainError(f"--budget-s takes seconds, not {v!r}") from None
        else:
            raise FlashtrainError(f"unknown argument {a!r} (options: --cpu, --out DIR, --budget-s S; see --help)")
    # the GPU form's ~8 minutes; the reduced form runs the kernels in the interpreter on a (shared) CPU
    return cpu, out, budget if budget is not None else 1800.0 if cpu else 480.0


def main(argv: list[str]) -> int:
    cpu, out_dir, budget_s = parse(argv)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    if not cpu and not torch.cuda.is_available():
        raise FlashtrainError("no CUDA device (run with --cpu under TRITON_INTERPRET=1 for the reduced form)")
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise FlashtrainError("--cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    t_start, budget = time.monotonic(), Budget(budget_s)
    plan = plan_for(cpu, out_dir)
    report = {"device": torch.cuda.get_device_name() if not cpu else "CPU (reduced form, Triton interpreter)",
              "budget_s": budget_s, "sections": {}}
    started = {"proc": subprocess.Popen(  # on the CPU cores while the GPU sections run
        [sys.executable, str(ROOT / "launch" / "estimate.py"), *plan["estimate"], "--world", "1", "--rank", "0",
         "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"})}
    sections = [("kernels", lambda: kernels(plan, budget)), ("train", lambda: train(plan, budget, out_dir)),
                ("bench_small", lambda: bench(plan["small"], budget, plan["env"])),
                ("bench_node", (lambda: bench_node(plan, budget)) if plan["node"] else None),
                ("estimator", lambda: estimator(started, report["sections"].get("train", {}).get("result"), budget))]
    for name, fn in sections:
        if fn is None:
            report["sections"][name] = {"status": "skipped", "reason": "not in the reduced (CPU) form"}
            continue
        if budget.left() <= 0 and name != "estimator":
            report["sections"][name] = {"status": "skipped", "reason": "time budget"}
            continue
        t0 = time.monotonic()
        try:
            report["sections"][name] = {"status": "ok", "result": fn()}
        except Exception as e:  # noqa: BLE001 - a failing section is reported; the others still run
            report["sections"][name] = {"status": "error", "error": _error(e)}
        report["sections"][name]["seconds"] = round(time.monotonic() - t0, 1)
        (out_dir / "check_gpu.json").write_text(json.dumps(report, indent=1))  # what is done so far survives
    if started["proc"].poll() is None:
        started["proc"].kill()
    report["seconds"] = time.monotonic() - t_start
    text = summary(report)
    (out_dir / "check_gpu.json").write_text(json.dumps(report, indent=1))
    (out_dir / "summary.txt").write_text(text + "\n")
    print(text)
    failed = [n for n, s in report["sections"].items() if s["status"] == "error"]
    failed += [f"kernels {k}" for k, p in (report["sections"].get("kernels", {}).get("result") or {}).items()
               if p["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main, sys.argv[1:]))
