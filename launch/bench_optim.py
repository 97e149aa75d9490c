"""Optimizer benchmark on the flash_small parameter set (built for real, CPU): a benchmark, not a test.

    python launch/bench_optim.py [+exp=flash_small] [hydra overrides...] [--repeats 3] [--distributed-muon]

`+exp=NAME` and overrides choose the parameter set (default `+exp=flash_small`); `--repeats N` timed rounds
per side (default 3); `--distributed-muon` the distributed comparison below (under torchrun).

Prints a table and one JSON line:
- Muon: our step (hybrid NS, 10 steps, batched by shape) vs `torch.optim.Muon` with the same number of
  Newton-Schulz steps, on the same Muon-routed matrices (stacked experts given to torch as separate
  2-D matrices); time ratio.
- SinkhornBalanced vs `torch.optim.AdamW` on the embedding, head and Engram tables: time ratio and
  optimizer-state bytes ratio.
- Peak tensor memory one step allocates on a 16384 x 2048 fp32 table (train/optim/memory.py, state
  included): SinkhornBalanced (its momentum + chunk workspace) against AdamW and a literal
  transcription of Algorithm 1 that materialises U.
The compared steps alternate in one process (launch/bench_util.py): one warm-up round of each (state
allocation), then `--repeats` rounds (alias `--rounds`, default 3) of ours / bf16 ours / torch.optim.Muon,
then as many of SinkhornBalanced / AdamW, the order flipped every round. Each time is the median of its
rounds; each ratio is the median of the per-round ratios, printed with its min-max and interquartile
range (the JSON's `comparisons`), since one block per side let the ratio drift with the machine.

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
from bench_util import alternate, format_ratio, ratio_summary, take_int  # noqa: E402

from flashtrain.model import Transformer  # noqa: E402
from flashtrain.parallel.zero import Ownership, balance_muon  # noqa: E402
from flashtrain.train.config import compose, model_config, optim_config  # noqa: E402
from flashtrain.train.optim import Muon, SinkhornBalanced, route_parameters  # noqa: E402
from flashtrain.train.optim.memory import PeakTensorBytes  # noqa: E402
from flashtrain.train.optim.muon import _as_matrices  # noqa: E402


def _fresh(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = torch.randn_like(q) * 1e-3
        out.append(q)
    return out


def peak_step_bytes(which: str, m: int, n: int) -> int:
    """Peak bytes of tensors allocated by one step on an m x n table (momentum/state included)."""
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(m, n))
    W.grad = torch.randn(m, n)
    with PeakTensorBytes() as meter:
        if which == "sinkhorn":
            SinkhornBalanced([W], lr=1e-3).step()
        elif which == "adamw":
            torch.optim.AdamW([W], lr=1e-3, betas=(0.9, 0.95), eps=1e-20).step()
        else:  # literal Algorithm 1 with U materialised
            with torch.no_grad():
                M = torch.zeros(m, n).lerp_(W.grad, 0.05)
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
    pieces = balance_muon([(i, *_as_matrices(p, heads).shape) for i, (p, heads) in enumerate(params)], world)
    own = {id(p): Ownership(pieces[i], rank, dist.group.WORLD) for i, (p, _) in enumerate(params)}
    coefficients = ocfg.muon.coefficients()
    opts = {"one_rank": Muon([{"params": _fresh(g.params), **g.options} for g in groups], lr=1e-3,
                             ns_coefficients=coefficients),
            "split": Muon(zero_groups, lr=1e-3, ns_coefficients=coefficients, zero_of=lambda p: own[id(p)])}
    # warm-up round (allocations, first collective), then alternated rounds between barriers
    times = alternate({name: opt.step for name, opt in opts.items()}, rounds, warmup=1, sync=dist.barrier)
    t = torch.tensor([times["one_rank"], times["split"]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a round ends when the slowest rank is done
    one, split = t[0].tolist(), t[1].tolist()
    speedup = ratio_summary(one, split)  # per round: one-rank time / split time
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        t_one, t_split = statistics.median(one), statistics.median(split)
        print(f"Muon step on {world} ranks, flash_small: every rank does all NS {t_one:.3f} s, NS split over "
              f"{world} ranks {t_split:.3f} s (medians of {rounds} alternated rounds), "
              f"speed-up {format_ratio(speedup)}")
        print(json.dumps({"exp": overrides, "ranks": world, "muon_step_one_rank_s": t_one,
                          "muon_step_distributed_s": t_split, "speedup": speedup["median"],
                          "rounds": rounds, "warmup_rounds": 1, "speedup_spread": speedup}))
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    rounds, argv = take_int(argv, ("--repeats", "--rounds"), 3)
    if "--distributed-muon" in argv:
        return distributed_muon([a for a in argv if a != "--distributed-muon"] or ["+exp=flash_small"], rounds)
    overrides = argv or ["+exp=flash_small"]
    conf = compose(overrides)
    mcfg, ocfg = model_config(conf), optim_config(conf)
    torch.manual_seed(0)
    model = Transformer(mcfg)
    groups = route_parameters(model, mcfg, ocfg)
    muon_groups = [g for g in groups if g.optimizer == "muon"]
    sink = [p for g in groups if g.optimizer == "sinkhorn" for p in g.params]
    ns_steps = len(ocfg.muon.coefficients())

    ours = [{"params": _fresh(g.params), **g.options} for g in muon_groups]
    our_muon = Muon(ours, lr=1e-3, ns_coefficients=ocfg.muon.coefficients())
    ours_bf16 = [{"params": _fresh(g.params), **g.options} for g in muon_groups]
    our_muon_bf16 = Muon(ours_bf16, lr=1e-3, ns_coefficients=ocfg.muon.coefficients(), ns_dtype=torch.bfloat16)
    flat = [t for g in muon_groups for p in g.params for t in (p.detach().unbind(0) if p.dim() == 3 else [p.detach()])]
    theirs = torch.optim.Muon(_fresh(flat), lr=1e-3, ns_steps=ns_steps)
    muon_times = alternate({"ours": our_muon.step, "ours_bf16": our_muon_bf16.step, "torch": theirs.step}, rounds)
    muon_cmp = ratio_summary(muon_times["ours"], muon_times["torch"])
    muon_bf16_cmp = ratio_summary(muon_times["ours_bf16"], muon_times["torch"])
    t_ours, t_ours_bf16, t_torch = (statistics.median(muon_times[k]) for k in ("ours", "ours_bf16", "torch"))

    sk_params, aw_params = _fresh(sink), _fresh(sink)
    sk = SinkhornBalanced(sk_params, lr=1e-3)
    aw = torch.optim.AdamW(aw_params, lr=1e-3, betas=(0.9, 0.95), eps=1e-20)
    table_times = alternate({"sinkhorn": sk.step, "adamw": aw.step}, rounds)
    sk_cmp = ratio_summary(table_times["sinkhorn"], table_times["adamw"])
    t_sk, t_aw = statistics.median(table_times["sinkhorn"]), statistics.median(table_times["adamw"])

    def state_bytes(opt):
        return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0)

    m, n = 16384, 2048
    mem = {k: peak_step_bytes(k, m, n) for k in ("sinkhorn", "adamw", "literal")}
    table_bytes = m * n * 4
    result = {
        "exp": overrides,
        "muon_params": sum(p.numel() for g in muon_groups for p in g.params),
        "muon_matrices": len(flat),
        "ns_steps": ns_steps,
        "muon_step_s": t_ours,
        "torch_muon_step_s": t_torch,
        "muon_time_ratio": muon_cmp["median"],
        "muon_bf16_step_s": t_ours_bf16,
        "muon_bf16_time_ratio": muon_bf16_cmp["median"],
        "sinkhorn_params": sum(p.numel() for p in sink),
        "sinkhorn_step_s": t_sk,
        "adamw_step_s": t_aw,
        "sinkhorn_time_ratio": sk_cmp["median"],
        "sinkhorn_state_bytes": state_bytes(sk),
        "adamw_state_bytes": state_bytes(aw),
        "state_bytes_ratio": state_bytes(sk) / state_bytes(aw),
        "peak_step_tensor_bytes_16384x2048": mem,
        "sinkhorn_workspace_beyond_momentum_bytes": mem["sinkhorn"] - table_bytes,
        # times: medians over `rounds` alternated rounds after one warm-up round; *_time_ratio: the median
        # of the per-round ratios, with its spread here (median, min, max, q1, q3, iqr, per-round ratios)
        "rounds": rounds,
        "warmup_rounds": 1,
        "comparisons": {"muon_vs_torch_muon": muon_cmp, "muon_bf16_vs_torch_muon": muon_bf16_cmp,
                        "sinkhorn_vs_adamw": sk_cmp},
    }
    print(f"times: medians of {rounds} alternated rounds after 1 warm-up round; ratio: median of the per-round "
          f"ratios (min, max, interquartile range)")
    print(f"{'measurement':<46} {'ours':>12} {'baseline':>12} {'ratio':>8}  spread")
    print(f"{'Muon step (s), ' + str(ns_steps) + ' NS steps vs torch.optim.Muon':<46} {t_ours:>12.3f} {t_torch:>12.3f} "
          f"{muon_cmp['median']:>8.2f}  {_spread(muon_cmp)}")
    print(f"{'  the same with NS in bf16 (as torch.optim.Muon)':<46} {t_ours_bf16:>12.3f} {t_torch:>12.3f} "
          f"{muon_bf16_cmp['median']:>8.2f}  {_spread(muon_bf16_cmp)}")
    print(f"{'SinkhornBalanced vs AdamW step (s)':<46} {t_sk:>12.3f} {t_aw:>12.3f} {sk_cmp['median']:>8.2f}  "
          f"{_spread(sk_cmp)}")
    print(f"{'optimizer state (MB)':<46} {state_bytes(sk) / 2**20:>12.1f} {state_bytes(aw) / 2**20:>12.1f} "
          f"{state_bytes(sk) / state_bytes(aw):>8.2f}")
    print(f"{'peak step tensor memory, 16384x2048 (MB)':<46} {mem['sinkhorn'] / 2**20:>12.1f} "
          f"{mem['adamw'] / 2**20:>12.1f} {mem['sinkhorn'] / max(mem['adamw'], 1):>8.2f}")
    print(f"{'  of which beyond the momentum buffer (MB)':<46} {(mem['sinkhorn'] - table_bytes) / 2**20:>12.1f}"
          f"   literal Algorithm 1 (U materialised): {mem['literal'] / 2**20:.1f} MB")
    print(json.dumps(result))
    return 0


def _spread(s: dict) -> str:
    return f"min {s['min']:.2f}, max {s['max']:.2f}, IQR {s['q1']:.2f}-{s['q3']:.2f}"


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    sys.exit(exit_on_user_error(main, sys.argv[1:]))
