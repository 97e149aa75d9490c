"""Optimizer benchmark on the flash_small parameter set (built for real): a benchmark, not a test.

    python launch/bench_optim.py [+exp=flash_small] [hydra overrides...] [--repeats 3] [--threads 1]
                                 [--device cpu] [--only muon,sinkhorn,memory] [--native-bf16]
    torchrun --nproc_per_node=2 launch/bench_optim.py --distributed-muon

`+exp=NAME` and overrides choose the parameter set (default `+exp=flash_small`); `--repeats N` timed rounds
per side (alias `--rounds`, default 3); `--threads N` torch's intra-op threads, the same for every side
(default 1, below); `--device cpu|cuda` where the parameters live (cuda: the Triton paths, our Muon's NS in
bf16 and torch's optimizers on the GPU; default cpu); `--only` the sections to run (default all three);
`--native-bf16` one more Muon line, our bf16 NS on torch's own bf16 GEMMs (slow on a CPU without bf16
hardware: minutes a step on flash_small); `--distributed-muon` the distributed comparison below (under
torchrun).

Sections, one table and one JSON line:
- muon: our step (hybrid NS, 10 steps, batched by shape) with NS in fp32, and with NS in bf16 (as torch's),
  vs `torch.optim.Muon` with the same number of Newton-Schulz steps (its default bf16 NS), on the same
  Muon-routed matrices (stacked experts given to torch as separate 2-D matrices); time ratios. Our bf16 NS
  runs bf16 GEMMs where the hardware has them (CUDA, AVX512-BF16, AMX) and elsewhere the same numerics from
  fp32 GEMMs (operands bf16 values, products rounded to bf16: train/optim/newton_schulz.py); the table says
  which.
- sinkhorn: SinkhornBalanced (its default: the gradient as workspace) and with `consume_grad=False` vs
  `torch.optim.AdamW` (its defaults as torch picks them: the for-loop step on CPU, foreach on CUDA) on the
  embedding, head and Engram tables: time ratios and the optimizer-state bytes ratio.
- memory: peak tensor memory one step allocates on a 16384 x 2048 fp32 table (train/optim/memory.py, state
  included): SinkhornBalanced (its momentum + chunk workspace) against AdamW and a literal transcription of
  Algorithm 1 that materialises U.
The compared steps alternate in one process (launch/bench_util.py): one warm-up round of each (state
allocation), then `--repeats` rounds of each section's steps, the order flipped every round. Each time is
the median of its rounds; each ratio is the median of the per-round ratios, printed with its min-max and
interquartile range (the JSON's `comparisons`), by wall-clock time and by the CPU time of this process
(`comparisons_cpu`; on a CPU device only).

Threads and load: the figures come with the thread count and the machine's load average (1 minute, at the
start and the end of each section) and CPU count. With more than one thread, every parallel operator ends
in a barrier that waits for its slowest thread, and on a loaded machine (more runnable tasks than CPUs) a
thread is descheduled for a scheduler slice (milliseconds) at a time: a step of many operators (Sinkhorn's
chunked passes: ~100 per table) then loses far more than one of few (AdamW's: 8 per parameter), and the
ratio measures the scheduler, not the code. One thread per side has no barriers: the load then slows both
sides alike, and the CPU-time ratio (time this process ran, not time it waited for a CPU) stays the quiet
machine's. `--threads 2` on an idle 2-core machine is the multi-threaded figure.

Distributed Muon (`torchrun --nproc_per_node=2 launch/bench_optim.py --distributed-muon`): on every rank
the flash_small Muon step with every rank orthogonalising every matrix (what one rank does, `optim.zero=false`)
against the ZeRO-1 step, whose owners split the Newton-Schulz work by whole matrices and broadcast their
pieces (train/optim/muon.py, parallel/zero.py), alternated round by round between barriers; a round's
time is the slowest rank's.
"""

from __future__ import annotations

import json
import statistics
import sys

from flashtrain.config.cli import exit_with_help  # noqa: E402 - imports nothing heavy

if __name__ == "__main__":
    exit_with_help(__doc__, sys.argv[1:])  # --help: this docstring, before the slow imports

import torch  # noqa: E402
from bench_util import MachineLoad, alternate, format_load, format_ratio, ratio_summary, take_int, take_str  # noqa: E402

from flashtrain.model import Transformer  # noqa: E402
from flashtrain.parallel.zero import Ownership, balance_matrices  # noqa: E402
from flashtrain.train.config import compose, model_config, optim_config  # noqa: E402
from flashtrain.train.optim import Muon, SinkhornBalanced, route_parameters  # noqa: E402
from flashtrain.train.optim.memory import PeakTensorBytes  # noqa: E402
from flashtrain.train.optim.muon import _as_matrices  # noqa: E402
from flashtrain.train.optim.newton_schulz import native_bf16_matmul  # noqa: E402

SECTIONS = ("muon", "sinkhorn", "memory")


def _fresh(params: list[torch.Tensor], device: str | torch.device = "cpu") -> list[torch.nn.Parameter]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().to(device, copy=True))
        q.grad = torch.randn_like(q) * 1e-3
        out.append(q)
    return out


def peak_step_bytes(which: str, m: int, n: int, device: str | torch.device = "cpu") -> int:
    """Peak bytes of tensors allocated by one step on an m x n table (momentum/state included)."""
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(m, n, device=device))
    W.grad = torch.randn(m, n, device=device)
    with PeakTensorBytes() as meter:
        if which == "sinkhorn":
            SinkhornBalanced([W], lr=1e-3).step()
        elif which == "adamw":
            torch.optim.AdamW([W], lr=1e-3, betas=(0.9, 0.95), eps=1e-20).step()
        else:  # literal Algorithm 1 with U materialised
            with torch.no_grad():
                M = torch.zeros_like(W).lerp_(W.grad, 0.05)
                U = W.grad.lerp(M, 0.95)
                for k in range(11):
                    U = U / (U.norm(dim=1 - k % 2, keepdim=True) + 1e-20)
                W -= 1e-3 * 0.18 * n ** 0.5 * U
    return meter.peak


def distributed_muon(overrides: list[str], rounds: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    conf = compose(overrides)
    mcfg, ocfg = model_config(conf), optim_config(conf)
    torch.manual_seed(0)
    groups = [g for g in route_parameters(Transformer(mcfg), mcfg, ocfg) if g.optimizer == "muon"]
    world, rank = dist.get_world_size(), dist.get_rank()
    zero_groups = [{"params": _fresh(g.params), **g.options} for g in groups]
    params = [(p, g.get("num_heads")) for g in zero_groups for p in g["params"]]
    # the ZeRO-1 ownership ParallelDims.zero_plan gives these matrices: whole matrices, balanced by NS cost
    pieces = balance_matrices([(i, *_as_matrices(p, heads).shape) for i, (p, heads) in enumerate(params)], world)
    own = {id(p): Ownership(pieces[i], rank, dist.group.WORLD) for i, (p, _) in enumerate(params)}
    coefficients = ocfg.muon.coefficients()
    opts = {"one_rank": Muon([{"params": _fresh(g.params), **g.options} for g in groups], lr=1e-3,
                             ns_coefficients=coefficients),
            "split": Muon(zero_groups, lr=1e-3, ns_coefficients=coefficients, zero_of=lambda p: own[id(p)])}
    # warm-up round (allocations, first collective), then alternated rounds between barriers
    times = alternate({name: opt.step for name, opt in opts.items()}, rounds, warmup=1, sync=dist.barrier)
    t = torch.tensor([times["one_rank"], times["split"]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a round ends when the slowest rank is done
    if dist.get_rank() == 0:
        line, record = distributed_report(overrides, world, rounds, t[0].tolist(), t[1].tolist())
        print(line)
        print(json.dumps(record))
    dist.destroy_process_group()
    return 0


def distributed_report(overrides: list[str], world: int, rounds: int, one: list[float], split: list[float]):
    """The distributed comparison's line and JSON record from each round's slowest-rank times: every rank doing
    all the Newton-Schulz work (`one`) and the ZeRO-1 split (`split`); the speed-up is one-rank time / split
    time per round (above 1: the split is faster)."""
    speedup = ratio_summary(one, split)
    t_one, t_split = statistics.median(one), statistics.median(split)
    line = (f"Muon step on {world} ranks, {' '.join(overrides)}: every rank does all NS {t_one:.3f} s, NS split over "
            f"{world} ranks {t_split:.3f} s (medians of {rounds} alternated rounds), speed-up {format_ratio(speedup)}")
    return line, {"exp": overrides, "ranks": world, "muon_step_one_rank_s": t_one, "muon_step_distributed_s": t_split,
                  "speedup": speedup["median"], "rounds": rounds, "warmup_rounds": 1, "speedup_spread": speedup}


def main(argv: list[str]) -> int:
    rounds, argv = take_int(argv, ("--repeats", "--rounds"), 3)
    threads, argv = take_int(argv, "--threads", 1)
    device, argv = take_str(argv, "--device", "cpu")
    only, argv = take_str(argv, "--only", ",".join(SECTIONS))
    native = "--native-bf16" in argv
    argv = [a for a in argv if a != "--native-bf16"]
    sections = tuple(x.strip() for x in only.split(",") if x.strip())
    if threads < 1 or not sections or set(sections) - set(SECTIONS) or device not in ("cpu", "cuda"):
        raise SystemExit(f"error: --threads N >= 1, --only from {','.join(SECTIONS)}, --device cpu or cuda "
                         f"(got --threads {threads} --only {only} --device {device})")
    if "--distributed-muon" in argv:
        torch.set_num_threads(threads)
        return distributed_muon([a for a in argv if a != "--distributed-muon"] or ["+exp=flash_small"], rounds)
    result = run(argv or ["+exp=flash_small"], rounds, threads, device, sections, native)
    print(table(result))
    print(json.dumps(result))
    return 0


def run(overrides: list[str], rounds: int, threads: int = 1, device: str = "cpu",
        sections: tuple[str, ...] = SECTIONS, native_bf16: bool = False) -> dict:
    """The benchmark's figures as a dict (the JSON line): `sections` of SECTIONS, `rounds` alternated rounds,
    `threads` intra-op threads, on `device` -- what `main` prints, and what launch/check_gpu.py can call."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA device here")
    conf = compose(overrides)
    mcfg, ocfg = model_config(conf), optim_config(conf)
    torch.manual_seed(0)
    model = Transformer(mcfg)
    groups = route_parameters(model, mcfg, ocfg)
    muon_groups = [g for g in groups if g.optimizer == "muon"]
    sink = [p for g in groups if g.optimizer == "sinkhorn" for p in g.params]
    on_cpu = dev.type == "cpu"
    result = {"exp": overrides, "device": str(dev), "threads": torch.get_num_threads(), "rounds": rounds,
              "warmup_rounds": 1, "load": {}, "comparisons": {}, "comparisons_cpu": {}}

    def timed(name: str, runs: dict) -> dict[str, list[float]]:
        cpu: dict[str, list[float]] = {}
        with MachineLoad() as load:
            times = alternate(runs, rounds, cpu_times=cpu)
        result["load"][name] = load.summary()
        result.setdefault("cpu_times_s", {}).update({k: statistics.median(v) for k, v in cpu.items()})
        return times, cpu

    def compare(key: str, times, cpu, a: str, b: str) -> dict:
        result["comparisons"][key] = ratio_summary(times[a], times[b])
        if on_cpu:
            result["comparisons_cpu"][key] = ratio_summary(cpu[a], cpu[b])
        return result["comparisons"][key]

    if "muon" in sections:
        coefficients = ocfg.muon.coefficients()
        ns_steps = len(coefficients)

        def ours(ns_dtype, ns_native=None):
            return Muon([{"params": _fresh(g.params, dev), **g.options} for g in muon_groups], lr=1e-3,
                        ns_coefficients=coefficients, ns_dtype=ns_dtype, ns_native=ns_native)

        flat = [t for g in muon_groups for p in g.params
                for t in (p.detach().unbind(0) if p.dim() == 3 else [p.detach()])]
        runs = {"ours": ours(torch.float32).step, "ours_bf16": ours(torch.bfloat16).step,
                "torch": torch.optim.Muon(_fresh(flat, dev), lr=1e-3, ns_steps=ns_steps).step}
        if native_bf16:
            runs["ours_bf16_native"] = ours(torch.bfloat16, ns_native=True).step
        times, cpu = timed("muon", runs)
        for k in runs:
            result[{"ours": "muon_step_s", "torch": "torch_muon_step_s"}.get(k, f"muon_{k[5:]}_step_s")] = \
                statistics.median(times[k])
        result["muon_time_ratio"] = compare("muon_vs_torch_muon", times, cpu, "ours", "torch")["median"]
        result["muon_bf16_time_ratio"] = compare("muon_bf16_vs_torch_muon", times, cpu, "ours_bf16", "torch")["median"]
        if native_bf16:
            compare("muon_bf16_native_vs_torch_muon", times, cpu, "ours_bf16_native", "torch")
        result.update({"muon_params": sum(p.numel() for g in muon_groups for p in g.params),
                       "muon_matrices": len(flat), "ns_steps": ns_steps,
                       "muon_bf16_gemm": "bf16" if native_bf16_matmul(dev) else "fp32 GEMMs on bf16 values"})

    if "sinkhorn" in sections:
        chunk = ocfg.sinkhorn.chunk_elems  # the trainer's (optim.sinkhorn.chunk_elems)
        sk = SinkhornBalanced(_fresh(sink, dev), lr=1e-3, chunk_elems=chunk)
        keep = SinkhornBalanced(_fresh(sink, dev), lr=1e-3, chunk_elems=chunk, consume_grad=False)
        aw = torch.optim.AdamW(_fresh(sink, dev), lr=1e-3, betas=(0.9, 0.95), eps=1e-20)
        times, cpu = timed("sinkhorn", {"sinkhorn": sk.step, "sinkhorn_keep_grad": keep.step, "adamw": aw.step})
        result["sinkhorn_time_ratio"] = compare("sinkhorn_vs_adamw", times, cpu, "sinkhorn", "adamw")["median"]
        result["sinkhorn_keep_grad_time_ratio"] = compare("sinkhorn_keep_grad_vs_adamw", times, cpu,
                                                          "sinkhorn_keep_grad", "adamw")["median"]
        result.update({"sinkhorn_params": sum(p.numel() for p in sink), "sinkhorn_chunk_elems": chunk,
                       "sinkhorn_step_s": statistics.median(times["sinkhorn"]),
                       "sinkhorn_keep_grad_step_s": statistics.median(times["sinkhorn_keep_grad"]),
                       "adamw_step_s": statistics.median(times["adamw"]),
                       "sinkhorn_state_bytes": _state_bytes(sk), "adamw_state_bytes": _state_bytes(aw),
                       "state_bytes_ratio": _state_bytes(sk) / _state_bytes(aw)})

    if "memory" in sections:
        m, n = 16384, 2048
        mem = {k: peak_step_bytes(k, m, n, dev) for k in ("sinkhorn", "adamw", "literal")}
        result["peak_step_tensor_bytes_16384x2048"] = mem
        result["sinkhorn_workspace_beyond_momentum_bytes"] = mem["sinkhorn"] - m * n * 4
    # times: medians over `rounds` alternated rounds after one warm-up round; comparisons[_cpu]: the per-round
    # ratios by wall-clock [CPU] time (median, min, max, q1, q3, iqr, the ratios)
    return result


def _state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def table(result: dict) -> str:
    cpu = result["comparisons_cpu"]
    lines = [f"times: medians of {result['rounds']} alternated rounds after 1 warm-up round; ratio: median of the "
             f"per-round ratios (min, max, interquartile range){', by wall-clock and by CPU time' if cpu else ''}",
             f"device {result['device']}, {result['threads']} torch thread(s) per side (--threads)",
             f"{'measurement':<50} {'ours':>9} {'baseline':>9} {'ratio':>6}  {'spread':<34}"
             + ("  CPU-time ratio" if cpu else "")]

    def row(label, ours, base, key):
        w = result["comparisons"][key]
        line = f"{label:<50} {ours:>9.3f} {base:>9.3f} {w['median']:>6.2f}  {_spread(w):<34}"
        if key in cpu:
            line += f"  {cpu[key]['median']:.2f} ({_spread(cpu[key])})"
        lines.append(line)

    if "muon_step_s" in result:
        lines.append(f"Muon ({result['muon_matrices']} matrices), {format_load(result['load']['muon'])}")
        row(f"  ours, {result['ns_steps']} NS steps in fp32 vs torch.optim.Muon (s)", result["muon_step_s"],
            result["torch_muon_step_s"], "muon_vs_torch_muon")
        row(f"  ours, NS in bf16 ({result['muon_bf16_gemm']})", result["muon_bf16_step_s"],
            result["torch_muon_step_s"], "muon_bf16_vs_torch_muon")
        if "muon_bf16_native_step_s" in result:
            row("  ours, NS in bf16 on torch's bf16 GEMMs", result["muon_bf16_native_step_s"],
                result["torch_muon_step_s"], "muon_bf16_native_vs_torch_muon")
    if "sinkhorn_step_s" in result:
        lines.append(f"Sinkhorn-balanced tables ({result['sinkhorn_params']:,} parameters, chunks of "
                     f"{result['sinkhorn_chunk_elems']:,} values), "
                     f"{format_load(result['load']['sinkhorn'])}")
        row("  SinkhornBalanced vs AdamW step (s)", result["sinkhorn_step_s"], result["adamw_step_s"],
            "sinkhorn_vs_adamw")
        row("  the same, gradient kept (consume_grad=False)", result["sinkhorn_keep_grad_step_s"],
            result["adamw_step_s"], "sinkhorn_keep_grad_vs_adamw")
        lines.append(f"{'  optimizer state (MB)':<50} {result['sinkhorn_state_bytes'] / 2**20:>9.1f} "
                     f"{result['adamw_state_bytes'] / 2**20:>9.1f} {result['state_bytes_ratio']:>6.2f}")
    if "peak_step_tensor_bytes_16384x2048" in result:
        mem = result["peak_step_tensor_bytes_16384x2048"]
        lines.append(f"{'peak step tensor memory, 16384x2048 (MB)':<50} {mem['sinkhorn'] / 2**20:>9.1f} "
                     f"{mem['adamw'] / 2**20:>9.1f} {mem['sinkhorn'] / max(mem['adamw'], 1):>6.2f}")
        lines.append(f"{'  of which beyond the momentum buffer (MB)':<50} "
                     f"{result['sinkhorn_workspace_beyond_momentum_bytes'] / 2**20:>9.1f}   literal Algorithm 1 "
                     f"(U materialised): {mem['literal'] / 2**20:.1f} MB")
    return "\n".join(lines)


def _spread(s: dict) -> str:
    return f"min {s['min']:.2f}, max {s['max']:.2f}, IQR {s['q1']:.2f}-{s['q3']:.2f}"


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    sys.exit(exit_on_user_error(main, sys.argv[1:]))
