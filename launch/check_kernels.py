"""The model's Triton kernels against their plain-PyTorch references at an exp's real shapes, on the GPU:
the one prepared device check (a measurement script, not a test; the interpreter tests are the CI gate).

    python launch/check_kernels.py [+exp=flash_small] [hydra overrides...] [--seq 4096]
                                   [--dtype float32|bfloat16] [--seed 0] [--rounds 3] [--tol 1e-4]

`+exp=NAME` and overrides give the widths (default `+exp=flash_small`); `--seq` tokens of the one sequence
(default 4096); `--dtype` of the inputs (default float32); `--seed` of the random inputs (default 0);
`--rounds` timed rounds per side (default 3); `--tol` the largest float32 difference allowed (default 1e-4).

For each kernel it builds random inputs of the exp's widths (one sequence of --seq tokens), runs the
kernel path and the reference path of the same function on the same inputs with the same upstream
gradient, and prints the largest difference of every output and input gradient relative to that
tensor's largest entry, plus each side's time (median of alternated rounds, launch/bench_util.py):

- sparse attention: `sparse_attention_lean(use_triton=True / False)` (window + top-k + sink);
- indexer selection: `index_topk_triton` against `index_select` (indices: the fraction of slots that
  differ -- exact in fp32 up to near-ties of one ulp; scores of the picks);
- mHC: `hc_mixes`, `hc_collapse`, `hc_expand` with `use_triton=True / False`;
- experts: the grouped-GEMM path against the per-expert loop (`RoutedExperts.grouped`); on CUDA grouped
  GEMM takes bf16 only, so in float32 both sides run the loop: check the experts with --dtype bfloat16.

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


def compare(fn, inputs: list[torch.Tensor], rounds: int) -> tuple[dict[str, float], dict[str, float]]:
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

    times = alternate({"kernel": lambda: run(True), "reference": lambda: run(False)}, rounds, warmup=1)
    (ko, kg), (ro, rg) = results[True], results[False]
    diffs = {f"out{i}": rel(a, b) for i, (a, b) in enumerate(zip(ko, ro))}
    diffs |= {f"grad{i}": rel(a, b) for i, (a, b) in enumerate(zip(kg, rg)) if b is not None}
    return diffs, {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str]) -> int:
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
    report: dict[str, dict] = {}

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

    report["sparse_attention"] = compare(attn, [q, win, comp, sink], rounds)

    # indexer selection (no gradient): indices and the picks' scores
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    qi, wi, ki = rand(1, S, Hi, di), torch.randn(1, S, Hi, device=dev), rand(1, N, di)
    args = (qi, wi, ki, n_vis, kk, cfg.attn_chunk_size, None, cfg.candidate_block_size, cfg.candidate_topk_blocks)
    with torch.no_grad():
        times = alternate({"kernel": lambda: index_topk_triton(*args), "reference": lambda: index_select(*args)},
                          rounds, warmup=1)
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
                                 [h, fn, scale, base], rounds)
    pre, post = torch.rand(1, S, n, device=dev), torch.rand(1, S, n, device=dev) * 2
    comb = torch.rand(1, S, n, n, device=dev)
    report["hc_collapse"] = compare(lambda f, h, p: (hc_collapse(h, p, f),), [h, pre], rounds)
    report["hc_expand"] = compare(lambda f, y, h, p, c: (hc_expand(y, h, p, c, f),), [rand(1, S, Dm), h, post, comb],
                                  rounds)

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

    report["experts"] = compare(experts, [x], rounds)

    worst = 0.0
    for kernel, (diffs, t) in report.items():
        body = ", ".join(f"{k2} {v:.2e}" for k2, v in diffs.items())
        speed = t["reference"] / t["kernel"] if t.get("kernel") else float("nan")
        print(f"{kernel:<17} {body}; kernel {t['kernel'] * 1e3:.2f} ms, reference {t['reference'] * 1e3:.2f} ms "
              f"({speed:.2f}x)")
        if kernel != "index_topk":
            worst = max(worst, *diffs.values())
    print(json.dumps({"device": name, "dtype": dtype_name, "seq": S, "report": report}))
    if dtype == torch.float32 and worst > tol:
        print(f"FAIL: a float32 difference {worst:.2e} exceeds --tol {tol}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main, sys.argv[1:]))
