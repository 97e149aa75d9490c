"""The model's Triton kernels against their plain-PyTorch references at an exp's real shapes, on the GPU
(a measurement script, not a test; the interpreter tests check the kernels in CI), and the offline
compile gate of every Triton kernel (`--compile-only`, no GPU needed; tests/test_compile_gate.py runs it).

    python launch/check_kernels.py [+exp=flash_small] [hydra overrides...] [--seq 4096]
                                   [--dtype float32|bfloat16] [--seed 0] [--rounds 3] [--tol 1e-4]
    python launch/check_kernels.py --compile-only [--json | --markdown] [+exp=flash ...] [--arch sm_90a,sm_100a]
                                   [--jobs N] [--kernel NAME[,NAME]]

`+exp=NAME` and overrides give the widths (default `+exp=flash_small`); `--seq` tokens of the one sequence
(default 4096); `--dtype` of the inputs (default float32); `--seed` of the random inputs (default 0);
`--rounds` timed rounds per side (default 3); `--tol` the largest float32 difference allowed (default 1e-4).

`--compile-only` (train/plan/compile_gate.py): traces one simulated training step of each exp (default: flash,
flash_node and flash_small; `+exp=NAME`, repeatable, picks some) with the CUDA path's launches recorded,
and compiles every kernel x autotune config the CUDA autotuner would try x architecture to cubin with the
Triton wheel's ptxas; prints one line per compilation (registers per thread, spill stores, shared memory,
resident blocks and occupancy on H100 for sm_90a, on B200 for sm_100a), or with `--json` one JSON
object: {"entries": [{"kernel", "config", "arch", "registers", "spill_bytes", "shared_bytes", ...}, ...],
"failures": [...], "timings": {...}, "devices": {...}}, or with `--markdown` the table of docs/kernels.md
(one row per kernel x launch x config, the architectures side by side). Exits 1 when a kernel does not compile, a config
cannot launch or a spill is not declared (train/plan/compile_gate.py `failures`). `--arch` the architectures,
comma-separated (default sm_90a,sm_100a); `--jobs` compiles in that many worker processes (default: the
CPU count); `--kernel` compiles only the named kernels' launches (comma-separated, e.g.
`_fp8_block_gemm_kernel`; default: every kernel).

For each kernel it builds random inputs of the exp's widths (one sequence of --seq tokens), runs the
kernel path and the reference path of the same function on the same inputs with the same upstream
gradient, and prints the largest difference of every output and input gradient relative to that
tensor's largest entry, plus each side's time (median of alternated rounds, launch/bench_util.py):

- sparse attention: `sparse_attention_lean(use_triton=True / False)` (window + top-k + sink);
- indexer selection: `index_topk_triton` against `index_select` (indices: the fraction of slots that
  differ -- exact in fp32 up to near-ties of one ulp; scores of the picks);
- mHC: `hc_mixes`, `hc_collapse`, `hc_expand` with `use_triton=True / False`;
- experts: the grouped-GEMM path against the per-expert loop (`RoutedExperts.grouped`); on CUDA grouped
  GEMM takes bf16 only, so in float32 both sides run the loop: check the experts with --dtype bfloat16;
- the optimizer's kernels: batched Newton-Schulz (symmetric SYRK kernel, its iterations in --dtype; its
  fp32 products are TF32, so it is left out of the float32 tolerance) and the fused Sinkhorn update
  (float32 only: master weights and gradients are fp32).

In float32 the differences should be ~1e-6 (the kernels use IEEE fp32 products); in bfloat16 the kernels
round as FlashAttention does and the references compute in fp32, so ~1e-2 is expected. Exits non-zero
when a float32 difference exceeds --tol (default 1e-4). Under TRITON_INTERPRET=1 on the CPU it runs too
(float32 only; use +exp=flash_tiny --seq 64), which is how the script itself is checked.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys

from flashtrain.config.cli import exit_with_help  # noqa: E402 - imports nothing heavy

if __name__ == "__main__":
    exit_with_help(__doc__, sys.argv[1:])  # --help: this docstring, before the slow imports

import torch  # noqa: E402
from bench_util import alternate  # noqa: E402

from flashtrain.config.cli import exit_on_user_error  # noqa: E402
from flashtrain.model.attention import index_select  # noqa: E402
from flashtrain.model.kernels.index_topk import index_topk_triton  # noqa: E402
from flashtrain.model.kernels.select import interpreting  # noqa: E402
from flashtrain.model.mhc import hc_collapse, hc_expand, hc_mixes  # noqa: E402
from flashtrain.model.moe import RoutedExperts  # noqa: E402
from flashtrain.model.sparse_attention import sparse_attention_lean  # noqa: E402
from flashtrain.train.config import compose, model_config  # noqa: E402


def _opt(argv: list[str], name: str, default: str) -> tuple[str, list[str]]:
    if name in argv:
        i = argv.index(name)
        return argv[i + 1], argv[:i] + argv[i + 2:]
    return default, argv


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are empty)."""
    if b.numel() == 0:
        return 0.0
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def compare(fn, inputs: list[torch.Tensor], rounds: int, warmup: int = 1) -> tuple[dict, dict]:
    """fn(use_triton, *leaves) -> outputs (a tuple); differences of outputs and input gradients (kernel vs
    reference, same upstream gradients) and the median time of forward+backward for each side."""
    gen = torch.Generator(device=inputs[0].device).manual_seed(1)
    results, grads_out = {}, None

    def run(flag: bool):
        nonlocal grads_out
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        outs = [o for o in fn(flag, *leaves) if o is not None and o.requires_grad]
        if grads_out is None:
            grads_out = [torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in outs]
        torch.autograd.backward(outs, grads_out)
        results[flag] = ([o.detach() for o in outs], [x.grad for x in leaves if x.requires_grad])

    times = alternate({"kernel": lambda: run(True), "reference": lambda: run(False)}, rounds, warmup=warmup)
    (ko, kg), (ro, rg) = results[True], results[False]
    diffs = {f"out{i}": rel(a, b) for i, (a, b) in enumerate(zip(ko, ro))}
    diffs |= {f"grad{i}": rel(a, b) for i, (a, b) in enumerate(zip(kg, rg)) if b is not None}
    return diffs, {k: statistics.median(v) for k, v in times.items()}


def compile_only(argv: list[str]) -> int:
    """The offline compile gate (module docstring)."""
    import dataclasses as dc
    import os

    from flashtrain.train.plan import compile_gate

    as_json, as_markdown = "--json" in argv, "--markdown" in argv
    argv = [a for a in argv if a not in ("--compile-only", "--json", "--markdown")]
    archs, argv = _opt(argv, "--arch", ",".join(compile_gate.ARCHS))
    jobs, argv = _opt(argv, "--jobs", str(os.cpu_count() or 1))
    only, argv = _opt(argv, "--kernel", "")
    exps = [a.split("=", 1)[1] for a in argv if a.startswith("+exp=")] or ["flash", "flash_node", "flash_small"]
    rest = [a for a in argv if not a.startswith("+exp=")]
    if rest:
        print(f"error: --compile-only takes +exp=NAME, --arch, --jobs, --kernel, --json and --markdown, not "
              f"{' '.join(rest)}", file=sys.stderr)
        return 2
    kernels = tuple(k.strip() for k in only.split(",") if k.strip())
    unknown = sorted(set(kernels) - set(compile_gate.project_kernels()))
    if unknown:
        print(f"error: --kernel {','.join(unknown)}: the project's kernels are "
              f"{', '.join(sorted(compile_gate.project_kernels()))}", file=sys.stderr)
        return 2
    arch_list = [a.strip() for a in archs.split(",") if a.strip()]
    unknown = [a for a in arch_list if a not in compile_gate.ARCHS]
    if unknown:
        print(f"error: --arch {','.join(unknown)}: the gate compiles for {', '.join(compile_gate.ARCHS)}",
              file=sys.stderr)
        return 2
    log = (lambda m: print(m, file=sys.stderr)) if as_json or as_markdown else print
    entries, timings = compile_gate.gate(exps, tuple(arch_list), int(jobs), log=log, kernels=kernels)
    bad = compile_gate.failures(entries)
    if as_json:
        print(json.dumps({"exps": exps, "entries": entries, "failures": bad, "timings": timings,
                          "devices": {a: dc.asdict(compile_gate.DEVICES[a]) for a in arch_list}}))
    elif as_markdown:
        print(compile_gate.markdown_table(entries))
        print(f"\n{len(entries)} compilations in {timings['compile_s']} s with {timings['jobs']} worker(s) after a "
              f"{timings['trace_s']} s trace; {len(bad)} failure(s)" + "".join(f"\n- FAIL {b}" for b in bad))
    else:
        print(f"{'kernel':<26} {'config':<52} {'arch':<8} {'regs':>4} {'spill':>5} {'smem':>7} {'blk/SM':>6} "
              f"{'occ':>5}  variant")
        for e in entries:
            if "error" in e:
                print(f"{e['kernel']:<26} {e['config']:<52} {e['arch']:<8} ERROR {e['error']}")
                continue
            print(f"{e['kernel']:<26} {e['config']:<52} {e['arch']:<8} {e['registers']:>4} {e['spill_bytes']:>5} "
                  f"{e['shared_bytes']:>7} {e['blocks_per_sm']:>6} {e['occupancy']:>5.0%}  {e['variant']}")
        print(f"{len(entries)} compilations in {timings['compile_s']} s with {timings['jobs']} worker(s) after a "
              f"{timings['trace_s']} s trace; {len(bad)} failure(s)")
        for b in bad:
            print(f"FAIL {b}")
    return 1 if bad else 0


def check(cfg, S: int, dtype: torch.dtype, rounds: int, dev: torch.device,
          warmup: int = 1) -> dict[str, tuple[dict, dict]]:
    """Every kernel against its reference at the widths of `cfg` (one sequence of S tokens) in `dtype`:
    {kernel: ({output / gradient: relative difference}, {"kernel": s, "reference": s})}; `warmup` untimed
    rounds first (launch/bench_util.py)."""
    report: dict[str, tuple[dict, dict]] = {}

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    # sparse attention: a compressed layer with ratio m, N = S / m entries, top-k with empty slots
    H, D, W, k = cfg.n_heads, cfg.head_dim, cfg.window_size, cfg.index_topk
    m = max(r for r in cfg.compress_ratios)
    N = S // m
    n_vis = (torch.arange(S, device=dev) + 1) // m
    scores = torch.rand(S, N, device=dev).masked_fill(torch.arange(N, device=dev) >= n_vis[:, None], -1.0)
    kk = min(k, N)
    top = scores.topk(kk, dim=-1)
    topk = torch.where(top.values >= 0, top.indices, -1).unsqueeze(0)
    q, win, comp = rand(1, S, H, D), rand(1, S, D), rand(1, N, D)
    sink = torch.randn(H, device=dev)

    def attn(flag, q, win, comp, sink):
        return sparse_attention_lean(q, win, comp, topk, sink, W, D ** -0.5, cfg.attn_chunk_size, 0, flag)[:1]

    report["sparse_attention"] = compare(attn, [q, win, comp, sink], rounds, warmup)

    # indexer selection (no gradient): indices and the picks' scores
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    qi, wi, ki = rand(1, S, Hi, di), torch.randn(1, S, Hi, device=dev), rand(1, N, di)
    args = (qi, wi, ki, n_vis, kk, cfg.attn_chunk_size, None, cfg.candidate_block_size, cfg.candidate_topk_blocks)
    with torch.no_grad():
        times = alternate({"kernel": lambda: index_topk_triton(*args), "reference": lambda: index_select(*args)},
                          rounds, warmup=warmup)
        idx_k, vals, cands_k = index_topk_triton(*args)
        idx_r, cands_r = index_select(*args)
    from flashtrain.model.attention import index_scores

    ref_vals = index_scores(qi, wi, ki).gather(-1, idx_r.clamp_min(0))
    report["index_topk"] = ({"indices_differing": (idx_k != idx_r).float().mean().item(),
                             "candidates_differing": (cands_k != cands_r).float().mean().item(),
                             "pick_scores": rel(vals.sort(-1).values,
                                                ref_vals.masked_fill(idx_r < 0, 0).sort(-1).values)},
                            {k2: statistics.median(v) for k2, v in times.items()})

    # mHC: one site's mixes, collapse, expand
    n, Dm = cfg.hc_mult, cfg.dim
    h = rand(1, S, n, Dm)
    fn = torch.randn((2 + n) * n, n * Dm, device=dev) * 0.1 / (n * Dm) ** 0.5
    scale, base = torch.ones(3, device=dev), torch.randn((2 + n) * n, device=dev) * 0.5
    eps = (cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    report["hc_mixes"] = compare(lambda f, h, fn, sc, b: hc_mixes(h, fn, sc, b, *eps, use_triton=f),
                                 [h, fn, scale, base], rounds, warmup)
    pre, post = torch.rand(1, S, n, device=dev), torch.rand(1, S, n, device=dev) * 2
    comb = torch.rand(1, S, n, n, device=dev)
    report["hc_collapse"] = compare(lambda f, h, p: (hc_collapse(h, p, f),), [h, pre], rounds, warmup)
    report["hc_expand"] = compare(lambda f, y, h, p, c: (hc_expand(y, h, p, c, f),), [rand(1, S, Dm), h, post, comb],
                                  rounds, warmup)

    # experts: grouped GEMM against the per-expert loop, the same weights
    ex = RoutedExperts(dataclasses.replace(cfg, use_triton=None)).to(dev)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=cfg.init_std)
    T = S
    x = rand(T, cfg.dim)
    gate = torch.rand(T, cfg.n_routed_experts, device=dev)
    picks = gate.topk(cfg.n_activated_experts, dim=-1)
    weights = picks.values / picks.values.sum(-1, keepdim=True)

    def experts(flag, x):
        ex.grouped = flag
        ex.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16 and dev.type == "cuda"):
            return (ex(x, weights, picks.indices),)

    report["experts"] = compare(experts, [x], rounds, warmup)

    report.update(check_optimizer(cfg, dtype, rounds, dev, warmup))
    return report


def check_optimizer(cfg, dtype: torch.dtype, rounds: int, dev: torch.device,
                    warmup: int = 1) -> dict[str, tuple[dict, dict]]:
    """The optimizer's kernels against their references: batched Newton-Schulz on a stack of 4 routed-expert
    matrices [moe_inter_dim, dim] (its iterations in `dtype`), and the Sinkhorn update of an embedding-wide
    table [min(vocab, 32768), dim] (fp32: the master weights and their gradients are fp32)."""
    from flashtrain.train.optim.newton_schulz import newton_schulz_reference, newton_schulz_triton
    from flashtrain.train.optim.sinkhorn import sinkhorn_update_reference, sinkhorn_update_triton

    out: dict[str, tuple[dict, dict]] = {}
    G = torch.randn(4, cfg.moe_inter_dim, cfg.dim, device=dev)
    res = {}
    times = alternate({"kernel": lambda: res.__setitem__("k", newton_schulz_triton(G, dtype=dtype)),
                       "reference": lambda: res.__setitem__("r", newton_schulz_reference(G, dtype=dtype))},
                      rounds, warmup=warmup)
    out["newton_schulz"] = ({"out0": rel(res["k"], res["r"])}, {k: statistics.median(v) for k, v in times.items()})
    if dtype == torch.float32:
        rows = min(cfg.vocab_size, 32768)
        Gs, M0 = (torch.randn(rows, cfg.dim, device=dev) for _ in range(2))
        W0 = torch.zeros(rows, cfg.dim, device=dev)  # W - W0 is then the update itself, with no cancellation
        state = {}

        def run(fn, key):
            W, M = W0.clone(), M0.clone()
            fn(W, Gs, M, 1e-3, 0.95, 11, 1e-3, 1e-20, 0.18)
            state[key] = (W - W0, M)

        times = alternate({"kernel": lambda: run(sinkhorn_update_triton, "k"),
                           "reference": lambda: run(sinkhorn_update_reference, "r")}, rounds, warmup=warmup)
        (dw_k, m_k), (dw_r, m_r) = state["k"], state["r"]
        out["sinkhorn"] = ({"update": rel(dw_k, dw_r), "momentum": rel(m_k, m_r)},
                           {k: statistics.median(v) for k, v in times.items()})
    return out


def main(argv: list[str]) -> int:
    if "--compile-only" in argv:
        return compile_only(argv)
    seq, argv = _opt(argv, "--seq", "4096")
    dtype_name, argv = _opt(argv, "--dtype", "float32")
    tol, argv = _opt(argv, "--tol", "1e-4")
    seed, argv = _opt(argv, "--seed", "0")
    rounds, argv = _opt(argv, "--rounds", "3")
    S, tol, rounds = int(seq), float(tol), int(rounds)
    cfg = model_config(compose(argv or ["+exp=flash_small"]))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not interpreting():
        print("no CUDA device: run on a GPU, or with TRITON_INTERPRET=1 on small shapes (+exp=flash_tiny --seq 64)")
        return 2
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(int(seed))
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU, Triton interpreter"
    print(f"{name}; {dtype_name}; exp widths {argv or ['+exp=flash_small']}; one sequence of {S} tokens")
    report = check(cfg, S, dtype, rounds, dev)
    worst = 0.0
    for kernel, (diffs, t) in report.items():
        body = ", ".join(f"{k2} {v:.2e}" for k2, v in diffs.items())
        speed = t["reference"] / t["kernel"] if t.get("kernel") else float("nan")
        print(f"{kernel:<17} {body}; kernel {t['kernel'] * 1e3:.2f} ms, reference {t['reference'] * 1e3:.2f} ms "
              f"({speed:.2f}x)")
        if kernel not in ("index_topk", "newton_schulz"):  # Newton-Schulz's Triton GEMMs take TF32 in fp32
            worst = max(worst, *diffs.values())
    print(json.dumps({"device": name, "dtype": dtype_name, "seq": S, "report": report}))
    if dtype == torch.float32 and worst > tol:
        print(f"FAIL: a float32 difference {worst:.2e} exceeds --tol {tol}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main, sys.argv[1:]))
