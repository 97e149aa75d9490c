"""The one prepared device check: everything that has to be seen on a GPU, in one command of at most ~8
minutes on one H200, writing a JSON report and a short text summary. A measurement script, not a test
(tests/test_check_gpu.py runs its reduced CPU form).

    python launch/check_gpu.py [--out DIR] [--budget-s 480] [--only SECTION,...]
    TRITON_INTERPRET=1 python launch/check_gpu.py --cpu [--out DIR] [--budget-s 1800]   # the reduced form

Options: `--out DIR` where the report goes (default runs/check_gpu); `--budget-s S` the time budget in
seconds for all sections together (default 480 on a GPU, 1800 for --cpu); `--only a,b` runs only those
sections (names below; default all: e.g. `--only train,estimator` to run the training check again);
`--cpu` the reduced form on the CPU (needs TRITON_INTERPRET=1). It takes no +exp= or Hydra overrides: the
exps (flash, flash_node, flash_small; flash_tiny for --cpu) and their overrides are fixed in `plan_for`
below, so that every run of the check measures the same thing. Run it on a GPU under a timeout of its
budget plus two minutes (`timeout 600 python launch/check_gpu.py`): every section rewrites the report as
it ends, so what finished survives a kill.

Sections, in this order, each guarded (an error is recorded with its traceback's last line and the next
section runs), each started only while the global time budget (`--budget-s`) lasts (a section left out is
recorded as skipped) and, on a GPU, each given at most its share of the budget (`SHARES_S`: kernels 150 s,
train 150 s, bench_small 120 s, bench_optim 60 s, bench_node 150 s, or what is left if less), so that one
slow section does not starve the rest; the kernels and every subprocess are killed at the end of their share:

1. `estimate` (started first, in the background, on 4 CPU threads: it needs no GPU): launch/estimate.py
   for the training run of section 3, one rank, device cuda.
2. `kernels`: every kernel against its reference (launch/check_kernels.py `check`: sparse attention,
   indexer top-k, the mHC mixes / collapse / expand, grouped experts, Newton-Schulz, Sinkhorn) at the widths
   of exp=flash, flash_node and flash_small (one sequence of 4096 tokens), in bf16 and fp32: relative
   differences of every output and input gradient, and each side's time. They run in a subprocess that
   writes each exp x dtype as it finishes (`kernels.jsonl`), in the order flash_small fp32 (the tight
   check), then bf16 at flash, flash_node, flash_small (the training path), then fp32 at flash_node and
   flash; one still running at the end of the share is reported as not finished, the rest as skipped.
3. `train`: 20 steps of flash_small on one GPU under torchrun (a process group of one: NCCL), bf16
   autocast, the Triton path (the CUDA default), a CUDA memory snapshot of steps 5-6
   (`train.profile.memory_snapshot`); its losses, tokens/s, MFU and per-step allocation peaks
   (`memory_peak_bytes` in metrics.jsonl). The default corpus is built small in DIR/corpus (the 20 steps
   read 41K tokens).
4. `bench_small`: launch/bench_model.py on flash_small (seq 512): reference, kernels and the kernels
   compiled per block (`--compile`), alternated; tokens/s, MFU, compile time.
5. `bench_optim`: launch/bench_optim.py on flash_small's parameters on the GPU (`--device cuda`: the Triton
   Newton-Schulz and Sinkhorn kernels, torch's Muon and AdamW on the GPU too), 3 alternated rounds: our Muon
   step against `torch.optim.Muon` (NS in bf16 on both sides) and the Sinkhorn-balanced step against AdamW,
   the ratios and each side's step time (docs/kernels.md "The optimizer split's cost").
6. `bench_node`: launch/bench_model.py at flash_node's widths (dim 1280, 16 heads x 256, 40 layers, top-512
   of 32 index heads x 64, 16K sequences, recompute full) with 32 of its 64 routed experts (4.95B
   parameters; the activated count, so the FLOPs per token, within 0.2% of flash_node's): the kernels eager
   and compiled, two models and their gradients, no optimizer state (`--no-optim`), which is what fits one
   H200 (141 GB); 16 experts if 32 fail.
7. `estimator`: the estimate of section 1 against the training run's real peak (the largest
   `memory_peak_bytes` of steps 3-20, when the optimizer state exists); it waits for the estimate at
   least 30 s past the budget.

The reduced form (`--cpu`, under TRITON_INTERPRET=1): flash_tiny on the 4-layer plan everywhere, the kernels
in fp32 only (the interpreter's; one call a side), 2 training steps on gloo and bench_model (reference and
the CPU default, without the compiled variant) with the references as any CPU run (TRITON_INTERPRET=0 for
them), the flash_node-width bench left out, and no device peak to compare the estimate with; no shares.
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
FOUR_LAYERS_TINY = ["+exp=flash_tiny", *FOUR_LAYERS]  # the reduced form's model
NODE_EXPERTS = (32, 16)  # bench_node: the flash_node-width configurations tried, largest first
# on a GPU, the most each section may take of the budget (seconds); the estimator only collects
SHARES_S = {"kernels": 150.0, "train": 150.0, "bench_small": 120.0, "bench_optim": 60.0, "bench_node": 150.0}
SECTIONS = ("kernels", "train", "bench_small", "bench_optim", "bench_node", "estimator")
ESTIMATOR_GRACE_S = 30.0  # how long past the budget the estimator still waits for the background estimate


class Budget:
    """The global time budget and, within it, the share of the running section."""

    def __init__(self, seconds: float, shares: dict | None = None):
        self.end = time.monotonic() + seconds
        self.shares = shares or {}
        self.section_end = self.end

    def left(self) -> float:
        return self.end - time.monotonic()

    def start(self, section: str) -> None:
        """The running section's deadline: its share from now, never past the budget's end."""
        share = self.shares.get(section)
        self.section_end = min(self.end, time.monotonic() + share) if share is not None else self.end

    def section_left(self) -> float:
        return self.section_end - time.monotonic()


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def _run(cmd: list[str], budget: Budget, env: dict | None = None) -> subprocess.CompletedProcess:
    """`cmd` to its end or the end of the section's share (then killed: subprocess.TimeoutExpired)."""
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, budget.section_left()),
                         env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {out.returncode}: {out.stderr.strip()[-800:]}")
    return out


# ------------------------------------------------------------------------------------------------ sections
def kernels(plan: dict, budget: Budget, out_dir: Path) -> dict:
    """Every exp x dtype of the plan in a subprocess (`kernel_worker`), killed at the end of the section's
    share; what it wrote is kept."""
    spec, lines = out_dir / "kernels_plan.json", out_dir / "kernels.jsonl"
    spec.write_text(json.dumps({k: plan[k] for k in ("kernel_runs", "kernel_seq", "kernel_rounds", "kernel_warmup")}))
    lines.unlink(missing_ok=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import check_gpu; "
            "check_gpu.kernel_worker(sys.argv[2], sys.argv[3])")
    killed = None
    try:
        _run([sys.executable, "-c", code, str(ROOT / "launch"), str(spec), str(lines)], budget, plan["kernel_env"])
    except subprocess.TimeoutExpired:
        killed = f"not finished within the section's share of the time budget ({SHARES_S.get('kernels')} s)"
    out, running = {}, None
    for rec in (json.loads(x) for x in (lines.read_text().splitlines() if lines.exists() else []) if x.strip()):
        if rec.pop("started", False):
            running = rec["key"]
            continue
        out[rec.pop("key")] = rec
        running = None
    for exp, dtype in plan["kernel_runs"]:
        key = f"{exp}/{dtype}"
        if key not in out:
            out[key] = ({"status": "error", "error": killed or "the kernel worker ended without its result"}
                        if key == running else {"status": "skipped", "reason": killed or "the kernel worker ended"})
    return out


def kernel_worker(spec_path: str, lines_path: str) -> None:
    """The kernels section's subprocess: for each (exp, dtype) of the plan, a `started` line, then its
    result line (status ok with the report, or error) appended to `lines_path`."""
    import torch
    from check_kernels import check

    from flashtrain.train.config import compose, model_config

    spec = json.loads(Path(spec_path).read_text())
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with open(lines_path, "a") as f:
        for exp, dtype in spec["kernel_runs"]:
            key = f"{exp}/{dtype}"
            f.write(json.dumps({"key": key, "started": True}) + "\n")
            f.flush()
            t0 = time.perf_counter()
            try:
                torch.manual_seed(0)
                overrides = FOUR_LAYERS_TINY if exp == "flash_tiny" else [f"+exp={exp}"]
                rep = check(model_config(compose(overrides)), spec["kernel_seq"], getattr(torch, dtype),
                            spec["kernel_rounds"], dev, warmup=spec["kernel_warmup"])
                rec = {"status": "ok", "seconds": round(time.perf_counter() - t0, 1),
                       "report": {k: {"differences": d, "seconds": t} for k, (d, t) in rep.items()}}
            except Exception as e:  # noqa: BLE001 - one exp / dtype failing keeps the others
                rec = {"status": "error", "seconds": round(time.perf_counter() - t0, 1), "error": _error(e)}
            f.write(json.dumps({"key": key, **rec}) + "\n")
            f.flush()
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def train(plan: dict, budget: Budget, out_dir: Path) -> dict:
    run = out_dir / "train"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "launch" / "pretrain.py"), *plan["train"], f"hydra.run.dir={run}"]
    _run(cmd, budget, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4"), **plan["env"]})
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    log = (run / "pretrain.log").read_text() if (run / "pretrain.log").exists() else ""
    snapshots = sorted(str(p.relative_to(out_dir)) for p in (run / "profile").glob("memory_snapshot*.pickle")) \
        if (run / "profile").exists() else []
    return train_result(records, log, snapshots, plan["train"])


def train_result(records: list[dict], log: str, snapshots: list[str], overrides: list[str]) -> dict:
    """Section 3's record from the run's metrics.jsonl records and pretrain.log: the step records (not the events)
    and their losses; tokens/s and MFU as medians over the steps after the first two (compilation and warm-up;
    over all steps when there are no more); the largest allocation peak of step 3 on (by then the optimizer
    state exists); the process group the log names."""
    steps = [r for r in records if "loss" in r and "step" in r and r.get("event") is None]
    backend = next((line.split("process group ")[-1].strip() for line in log.splitlines() if "process group " in line),
                   None)
    peaks = [r["memory_peak_bytes"] for r in steps[2:] if r.get("memory_peak_bytes") is not None]
    later = steps[2:] or steps
    return {"steps": len(steps), "loss": [r["loss"] for r in steps], "process_group": backend,
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in later),
            "mfu_median": statistics.median(r["mfu"] for r in later) if all(r.get("mfu") for r in later) else None,
            "memory_peak_bytes": max(peaks) if peaks else None, "memory_snapshots": snapshots,
            "overrides": overrides}


def bench(args: list[str], budget: Budget, env: dict) -> dict:
    out = _run([sys.executable, str(ROOT / "launch" / "bench_model.py"), *args], budget, env)
    res = _last_json(out.stdout)
    keep = ("exp", "seq", "params", "device", "peak_flops", "flops_per_token", "variants", "compile_s",
            "compiled_vs_eager_speedup", "kernels_vs_reference_speedup", "compiled_eager_variant")
    return {k: res.get(k) for k in keep}


OPTIM_KEYS = ("device", "threads", "rounds", "muon_time_ratio", "muon_bf16_time_ratio", "muon_step_s",
              "muon_bf16_step_s", "torch_muon_step_s", "muon_bf16_gemm", "sinkhorn_time_ratio",
              "sinkhorn_keep_grad_time_ratio", "sinkhorn_step_s", "adamw_step_s", "state_bytes_ratio", "comparisons")


def bench_optim(plan: dict, budget: Budget) -> dict:
    out = _run([sys.executable, str(ROOT / "launch" / "bench_optim.py"), *plan["optim"]], budget, plan["env"])
    res = _last_json(out.stdout)
    return {k: res.get(k) for k in OPTIM_KEYS}


def bench_node(plan: dict, budget: Budget) -> dict:
    errors = []
    for experts in plan["node_experts"]:
        try:
            return {"n_routed_experts": experts, **bench([*plan["node"], f"model.n_routed_experts={experts}"],
                                                         budget, plan["env"])}
        except Exception as e:  # noqa: BLE001 - out of memory: the next, smaller configuration
            errors.append(f"{experts} experts: {_error(e)}")
            if budget.section_left() <= 0:
                break
    raise RuntimeError("; ".join(errors))


def estimator(started: dict, train_result: dict | None, budget: Budget) -> dict:
    proc = started["proc"]
    try:
        stdout, stderr = proc.communicate(timeout=max(ESTIMATOR_GRACE_S, budget.left()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"launch/estimate.py did not finish within the budget "
                           f"(+{ESTIMATOR_GRACE_S:.0f} s)") from None
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
    # a small default corpus of its own (built once in DIR/corpus): the runs read a few hundred sequences
    corpus = [f"data.corpus_dir={out_dir / 'corpus'}", "data.corpus_text_bytes=400000", "data.corpus_mm_docs=50",
              "data.corpus_shards=4"]
    common = ["logging.wandb.mode=disabled", "logging.progress=false", "train.eval.interval=0",
              "train.checkpoint.interval=1000", *corpus]
    if cpu:
        tiny = FOUR_LAYERS_TINY
        return {"kernel_runs": [("flash_tiny", "float32")], "kernel_seq": 64,
                "kernel_rounds": 1, "kernel_warmup": 0,  # the interpreter's times say nothing: one call a side
                "kernel_env": {},
                "train": [*tiny, "train.max_steps=2", "train.profile.memory_snapshot=true",
                          "train.profile.memory_steps=1", *common],
                "estimate": [*tiny, "--device", "cpu"],
                "small": [*tiny, "--seq", "64", "--rounds", "1", "--no-optim"], "node": None, "node_experts": (),
                "optim": [*tiny, "--repeats", "1", "--only", "muon,sinkhorn"],
                # the training run and the benchmark as on a CPU: the references (the interpreter only for the kernels)
                "env": {"TRITON_INTERPRET": "0"}, "shares": None}
    return {"kernel_runs": [("flash_small", "float32"), ("flash", "bfloat16"), ("flash_node", "bfloat16"),
                            ("flash_small", "bfloat16"), ("flash_node", "float32"), ("flash", "float32")],
            "kernel_seq": 4096, "kernel_rounds": 3, "kernel_warmup": 1, "kernel_env": {},
            "train": ["+exp=flash_small", "train.max_steps=20", "train.profile.memory_snapshot=true",
                      "train.profile.memory_steps=[5,6]", *common],
            "estimate": ["+exp=flash_small", "--device", "cuda"],
            "small": ["+exp=flash_small", "--seq", "512", "--rounds", "3", "--compile"],
            "optim": ["+exp=flash_small", "--device", "cuda", "--repeats", "3", "--only", "muon,sinkhorn"],
            "node": ["+exp=flash_node", "--seq", "16384", "--rounds", "2", "--no-optim", "--compile",
                     "--variants", "kernels"],
            "node_experts": NODE_EXPERTS, "env": {}, "shares": SHARES_S}


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
        elif name == "bench_optim":
            lines.append(f"{head}  Muon {res['muon_bf16_time_ratio']:.2f}x torch.optim.Muon (NS in bf16), "
                         f"Sinkhorn-balanced {res['sinkhorn_time_ratio']:.2f}x AdamW ({res['device']})")
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


def parse(argv: list[str]) -> tuple[bool, Path, float, tuple[str, ...]]:
    """(--cpu, --out, --budget-s, --only); anything else is an error naming it."""
    cpu, out, budget, only, rest = False, ROOT / "runs" / "check_gpu", None, SECTIONS, list(argv)
    while rest:
        a = rest.pop(0)
        if a == "--cpu":
            cpu = True
        elif a in ("--out", "--budget-s", "--only") and rest:
            v = rest.pop(0)
            if a == "--only":
                only = tuple(x.strip() for x in v.split(",") if x.strip())
                bad = [x for x in only if x not in SECTIONS]
                if bad or not only:
                    raise FlashtrainError(f"--only {v}: sections are {', '.join(SECTIONS)}")
            elif a == "--out":
                out = Path(v)
            else:
                try:
                    budget = float(v)
                except ValueError:
                    raise FlashtrainError(f"--budget-s takes seconds, not {v!r}") from None
        else:
            raise FlashtrainError(f"unknown argument {a!r} (options: --cpu, --out DIR, --budget-s S, --only a,b; "
                                  f"see --help)")
    # the GPU form's ~8 minutes; the reduced form runs the kernels in the interpreter on a (shared) CPU
    return cpu, out, budget if budget is not None else 1800.0 if cpu else 480.0, only


def main(argv: list[str]) -> int:
    cpu, out_dir, budget_s, only = parse(argv)
    import torch

    if not cpu and not torch.cuda.is_available():
        raise FlashtrainError("no CUDA device (run with --cpu under TRITON_INTERPRET=1 for the reduced form)")
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise FlashtrainError("--cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    plan = plan_for(cpu, out_dir)
    budget = Budget(budget_s, plan["shares"])
    report = {"device": torch.cuda.get_device_name() if not cpu else "CPU (reduced form, Triton interpreter)",
              "budget_s": budget_s, "sections": {}}
    started = {"proc": subprocess.Popen(  # on the CPU cores while the GPU sections run
        [sys.executable, str(ROOT / "launch" / "estimate.py"), *plan["estimate"], "--world", "1", "--rank", "0",
         "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "4"})} \
        if "estimator" in only else {"proc": None}
    sections = {"kernels": lambda: kernels(plan, budget, out_dir), "train": lambda: train(plan, budget, out_dir),
                "bench_small": lambda: bench(plan["small"], budget, plan["env"]),
                "bench_optim": lambda: bench_optim(plan, budget),
                "bench_node": (lambda: bench_node(plan, budget)) if plan["node"] else None,
                "estimator": lambda: estimator(started, report["sections"].get("train", {}).get("result"), budget)}
    for name, fn in sections.items():
        if name not in only:
            report["sections"][name] = {"status": "skipped", "reason": "not in --only"}
            continue
        if fn is None:
            report["sections"][name] = {"status": "skipped", "reason": "not in the reduced (CPU) form"}
            continue
        if budget.left() <= 0 and name != "estimator":
            report["sections"][name] = {"status": "skipped", "reason": "time budget"}
            continue
        t0 = time.monotonic()
        budget.start(name)
        try:
            report["sections"][name] = {"status": "ok", "result": fn()}
        except subprocess.TimeoutExpired as e:
            report["sections"][name] = {"status": "error", "error": f"killed at the end of its share of the time "
                                        f"budget ({e.timeout:.0f} s): {' '.join(map(str, e.cmd[:4]))} ..."}
        except Exception as e:  # noqa: BLE001 - a failing section is reported; the others still run
            report["sections"][name] = {"status": "error", "error": _error(e)}
        report["sections"][name]["seconds"] = round(time.monotonic() - t0, 1)
        (out_dir / "check_gpu.json").write_text(json.dumps(report, indent=1))  # what is done so far survives
    if started["proc"] is not None and started["proc"].poll() is None:
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
