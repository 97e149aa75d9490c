"""Forward+backward of a model exp on this machine: the model's Triton kernels against the plain-PyTorch
references in one process, tokens/s and MFU. A benchmark, not a test.

    python launch/bench_model.py [+exp=flash_small] [--batch 1] [--seq 256] [--rounds 3] [--peak-tflops T]
                                 [--no-optim] [--compile] [--variants V,...] [--flops-only] [hydra overrides...]

Options: `+exp=NAME` and Hydra overrides (default `+exp=flash_small`); `--batch` sequences per micro-batch
(default 1); `--seq` tokens per sequence (default: the exp's data.seq_len, 256 for flash_small... see below);
`--rounds` timed rounds per variant (default 3); `--peak-tflops` the MFU peak in TFLOP/s (default: the GPU
table, or on CPU a measured matmul); `--no-optim` times forward+backward only (default: the optimizer step
too); `--flops-only` prints the FLOP accounting without building weights.

Variants (two models built from the same config and seed, so the same weights): `reference`
(`model.use_triton=false`) and `kernels` (`model.use_triton=true`), and on the CPU `default`
(`model.use_triton=null`: the references, but the routed experts through grouped GEMM). They alternate in one process
(launch/bench_util.py): one warm-up round of each, then `--rounds` rounds (`--steps` is an alias), the
order flipped every round; each variant's time is the median of its rounds and the speed-up is the
median of the per-round ratios reference time / kernels time, printed with its min-max and
interquartile range. The kernels need CUDA (or `TRITON_INTERPRET=1` on CPU, where the interpreter's
time says nothing about the kernels); without either only the reference runs, and a line says so.

A round of a variant is what the trainer does per micro-batch (train/trainer.py): embedding, every block,
final norm, the tiled head + cross-entropy (train/loss.py, `train.loss_tile_tokens`) and backward, with
the exp's `train.recompute`. On CUDA: fp32 parameters under bf16 autocast, as the trainer; on CPU fp32.
Tokens are random text ids (no images). Unless `--no-optim`, the optimizer step (train/optim,
`build_optimizers`) is timed too, as a third run of each round, on the reference model's gradients at
learning rate 0 (the same work, the weights stay equal to the kernels model's); its median is
`optim_s`. The JSON keeps the old keys: `fwd_bwd_s` / `optim_s` / `tokens_per_s = batch * seq /
(fwd_bwd_s + optim_s)` describe the variant the trainer runs by default here (kernels on CUDA,
`default` on CPU).

`--variants reference,kernels,default` times only those (one model each: at flash_node widths two fit a GPU
where three do not); the optimizer step then runs on the first one's gradients.

`--compile` adds the trainer's default variant with torch.compile per block and per loss tile
(train/compile.py, what `train.compile=true` does), alternated with the others: `compiled` in the JSON
(built from the same seed: the same weights), its compile time (`compile_s`: its first forward+backward,
which compiles, minus its median round) and the speed-up over the eager default variant
(`compiled_vs_eager_speedup`, per round: eager time / compiled time).

Model FLOPs per token (the MFU numerator): `train/flops.py` (the trainer's `flops_per_token` / `mfu`
metrics use the same function), averaged over positions 0..S-1 of one sequence of S = --seq:

    flops/token = 6 * P_mm + F_attn + F_index

P_mm: the activated matmul parameters per text token (attention, compressor and indexer projections,
mHC mixing matrices, MoE gate, shared expert, the `n_activated_experts` routed experts, Engram wkv, LM
head); 6 = 2 (multiply-add) x 3 (forward, input gradient, weight gradient). F_attn: QK^T and PV over the
window band and the selected compressed entries of every layer, x 3. F_index: the indexers' scoring of
every visible compressed entry (forward) and the KL logits' backward on the selected ones. The exact
rules and what is not counted are in train/flops.py's docstring.

MFU = tokens/s * flops/token / peak. Peak: bf16 dense tensor-core FLOP/s of known GPUs, looked up by a
substring of `torch.cuda.get_device_name()` (PEAK_TFLOPS in train/flops.py); on CPU a large fp32 matmul timed in this
process ("measured CPU matmul peak"); `--peak-tflops` overrides both. `--flops-only` prints the
accounting (parameters, flops per token and their parts) without building real weights: it works for
any exp (`+exp=flash_node`, `+exp=flash`), at `--seq` or else the exp's `data.seq_len`.
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
from bench_util import alternate, format_ratio, ratio_summary, take_int  # noqa: E402

from flashtrain.model.config import ModelConfig  # noqa: E402
from flashtrain.model.kernels.select import HAS_TRITON, interpreting  # noqa: E402
from flashtrain.parallel.construct import model_template  # noqa: E402
from flashtrain.train.config import compose, model_config, optim_config  # noqa: E402
from flashtrain.train.flops import flop_accounting, gpu_peak, measured_cpu_peak  # noqa: E402


# ---------------------------------------------------------------------------------------------- main
def _take_float(argv: list[str], name: str) -> tuple[float | None, list[str]]:
    if name in argv:
        i = argv.index(name)
        return float(argv[i + 1]), argv[:i] + argv[i + 2:]
    return None, argv


def _token_map(cfg: ModelConfig) -> torch.Tensor | None:
    """A stand-in compressed-tokenizer map when the config fixes a compressed Engram vocabulary (the
    trainer builds the real one from the tokenizer): id mod that size, so it has exactly that many ids.
    The cost of a step does not depend on which ids share a row."""
    n = cfg.engram_compressed_vocab_size
    if not cfg.engram_layer_ids or n is None or n == cfg.vocab_size:
        return None
    return torch.arange(cfg.vocab_size) % n


def main(argv: list[str]) -> int:
    only = None
    if "--variants" in argv:
        i = argv.index("--variants")
        only, argv = argv[i + 1].split(","), argv[:i] + argv[i + 2:]
    batch, argv = take_int(argv, "--batch", 1)
    seq, argv = take_int(argv, "--seq", None)
    rounds, argv = take_int(argv, ("--rounds", "--steps"), 3)
    peak_tflops, argv = _take_float(argv, "--peak-tflops")
    flops_only, with_optim, with_compile = "--flops-only" in argv, "--no-optim" not in argv, "--compile" in argv
    argv = [a for a in argv if a not in ("--flops-only", "--no-optim", "--compile")]
    overrides = argv or ["+exp=flash_small"]
    conf = compose(overrides)
    mcfg = model_config(conf)
    if seq is None:
        seq = int(conf.data.seq_len) if flops_only else 256
    acc = flop_accounting(mcfg, seq)
    fb = acc["flops_breakdown"]
    print(f"{overrides}: {acc['params_total'] / 1e6:,.1f}M params, {acc['matmul_params_per_token'] / 1e6:,.1f}M "
          f"activated matmul params per token (model/inspect.py's activated count: "
          f"{acc['params_activated_per_token_inspect'] / 1e6:,.1f}M)")
    print(f"model flops per token at seq {seq}: {acc['flops_per_token'] / 1e9:,.3f} GFLOP = 6 x matmul params "
          f"{fb['matmul_params_x6'] / 1e9:,.3f} + attention core {fb['attention_core'] / 1e9:,.3f} + indexer "
          f"{fb['indexer_scoring'] / 1e9:,.3f} (forward + backward; formula in train/flops.py)")
    if flops_only:
        print(json.dumps({"exp": overrides, **acc}))
        return 0

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    device_name = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    if peak_tflops is not None:
        peak, peak_source = peak_tflops * 1e12, "--peak-tflops"
    elif cuda:
        peak, peak_source = gpu_peak(device_name), "bf16 dense peak (table PEAK_TFLOPS, train/flops.py)"
    else:
        peak, peak_source = measured_cpu_peak(), "measured CPU matmul peak (fp32, 2048^3, best of 5)"
    print(f"device: {device_name}; {'fp32 params under bf16 autocast (as the trainer)' if cuda else 'fp32'}; "
          + (f"peak {peak / 1e12:,.1f} TFLOP/s, {peak_source}" if peak else
             "peak unknown for this GPU: pass --peak-tflops for MFU"))

    kernels_skipped = None
    if not (cuda or interpreting()):
        kernels_skipped = "no CUDA device and TRITON_INTERPRET is not set"
    elif not HAS_TRITON:
        kernels_skipped = "triton is not installed"
    if kernels_skipped:
        print(f"kernels variant not run: {kernels_skipped}; timing the reference (model.use_triton=false) only")
    elif not cuda:
        print("kernels variant under TRITON_INTERPRET=1: its time is the interpreter's, not the kernels'")
    variants = {"reference": False} if kernels_skipped else {"reference": False, "kernels": True}
    if not (cuda or interpreting()):  # the CPU default (model.use_triton=null): references + grouped-GEMM experts
        variants["default"] = None

    seed = int(conf.train.seed)
    recompute = str(conf.train.recompute)
    tile = int(conf.train.loss_tile_tokens)
    token_map = _token_map(mcfg)
    if token_map is not None:
        print(f"engram: a stand-in token map (id mod {mcfg.engram_compressed_vocab_size}) instead of the tokenizer's")
    if only is not None:
        variants = {k: v for k, v in variants.items() if k in only}
        if not variants:
            raise SystemExit(f"error: --variants {','.join(only)}: none of them runs here")
    eager_default = "default" if "default" in variants else "kernels" if "kernels" in variants else "reference"
    if with_compile:
        variants["compiled"] = variants[eager_default]
    models = {}
    for name, flag in variants.items():
        m = model_template(dataclasses.replace(mcfg, use_triton=flag), token_map).materialize(device, seed)
        m.set_recompute(recompute)
        if name == "compiled":
            from flashtrain.train.compile import apply_compile

            apply_compile(m)
        models[name] = m
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, mcfg.image_token_id, (batch, seq + 1), generator=gen).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    from flashtrain.train.loss import tiled_lm_loss  # imports deepspeed: after the accounting path

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    from flashtrain.train.loss import compile_tile

    def fwd_bwd(model):
        compiled = model is models.get("compiled")

        def run():
            compile_tile(compiled)  # the loss tile compiled for the compiled variant only
            model.zero_grad(set_to_none=True)
            with autocast():
                hidden = model.final_hidden(model.run(inputs))
                loss = tiled_lm_loss(hidden, model.head, labels, tile)
            loss.backward()
        return run

    runs = {name: fwd_bwd(m) for name, m in models.items()}
    if with_optim:
        from flashtrain.train.optim import build_optimizers

        ocfg = optim_config(conf)
        if not cuda and ocfg.use_triton is not False:
            ocfg = dataclasses.replace(ocfg, use_triton=False)  # never the interpreter for the optimizer
        first = next(iter(models))
        opt = build_optimizers(models[first], mcfg, ocfg, lr=0.0)
        opt.set_lr(0.0)  # the full step's work; the weights stay as the kernels model's
        runs["optimizer"] = opt.step  # on the first variant's gradients of its last round
    print(f"{batch} x {seq} tokens, recompute={recompute}; {', '.join(runs)} alternate: 1 warm-up round, "
          f"then {rounds} round{'s' if rounds != 1 else ''}")
    first_compiled_s = None
    if with_compile:  # its first forward+backward compiles every block and the loss tile
        import time

        t0 = time.perf_counter()
        runs["compiled"]()
        first_compiled_s = time.perf_counter() - t0
    times = alternate(runs, rounds, warmup=1)

    lines, timing = figures(times, list(variants), batch * seq, acc["flops_per_token"], peak, eager_default,
                            first_compiled_s)
    print("\n".join(lines))
    res = {
        "exp": overrides, "params": acc["params_total"], "batch": batch, "seq": seq, **timing,
        "device": device_name, "dtype": "bf16 autocast" if cuda else "fp32", "recompute": recompute,
        "rounds": rounds, "warmup_rounds": 1,
        "peak_flops": peak, "peak_source": peak_source if peak else None,
        "flops_per_token": acc["flops_per_token"], "flops_breakdown": acc["flops_breakdown"],
        "matmul_params_per_token": acc["matmul_params_per_token"], "kernels_skipped": kernels_skipped,
        "compiled_eager_variant": eager_default if with_compile else None,
    }
    print(json.dumps(res))
    return 0


def figures(times: dict[str, list[float]], variants: list[str], n_tokens: int, flops_per_token: float,
            peak: float | None, eager_default: str, first_compiled_s: float | None = None):
    """The printed lines and the JSON's timing fields from each run's round times (`alternate`'s): per variant
    its median forward+backward time, tokens/s = n_tokens / that time and MFU = tokens/s x flops_per_token /
    peak (None without a peak); the speed-ups as per-round ratios (reference / kernels, reference / default,
    eager / compiled); the compile time (the first compiled forward+backward minus its median round); the
    optimizer step's median (when `times` has an "optimizer" run); and for the trainer's default variant here
    (`eager_default`) `fwd_bwd_s`, `optim_s` and `tokens_per_s` = n_tokens / (fwd_bwd_s + optim_s), the optimizer
    included."""
    lines, out_variants = [], {}
    for name in variants:
        t = statistics.median(times[name])
        tps = n_tokens / t
        mfu = tps * flops_per_token / peak if peak else None
        out_variants[name] = {"fwd_bwd_s": t, "fwd_bwd_times_s": times[name], "fwd_bwd_tokens_per_s": tps,
                              "mfu": mfu}
        lines.append(f"{name:<10} forward+backward {t:8.3f} s (median; rounds "
                     f"{', '.join(f'{x:.3f}' for x in times[name])})  {tps:>12,.1f} tokens/s  MFU "
                     + (f"{100 * mfu:.2f}%" if mfu is not None else "n/a"))
    speedup = default_speedup = compiled_speedup = compile_s = None
    if "kernels" in variants and "reference" in variants:
        speedup = ratio_summary(times["reference"], times["kernels"])
        lines.append(f"kernels vs reference speed-up (per round: reference time / kernels time): "
                     f"{format_ratio(speedup)}")
    if "default" in variants and "reference" in variants:
        default_speedup = ratio_summary(times["reference"], times["default"])
        lines.append(f"CPU default (grouped experts) vs reference speed-up (reference time / default time): "
                     f"{format_ratio(default_speedup)}")
    if "compiled" in variants:
        compiled_speedup = ratio_summary(times[eager_default], times["compiled"])
        compile_s = first_compiled_s - statistics.median(times["compiled"])
        lines.append(f"compiled vs eager ({eager_default}) speed-up (per round: eager time / compiled time): "
                     f"{format_ratio(compiled_speedup)}; compile time {compile_s:.1f} s (first compiled "
                     f"forward+backward {first_compiled_s:.1f} s minus its median round)")
    optim_s = statistics.median(times["optimizer"]) if "optimizer" in times else None
    if optim_s is not None:
        lines.append(f"optimizer step {optim_s:.3f} s (median; lr 0 on the reference model's gradients)")
    fwd_bwd_s = out_variants[eager_default]["fwd_bwd_s"]
    return lines, {
        # the trainer's default variant here (see the module docstring); tokens_per_s includes the optimizer
        "fwd_bwd_s": fwd_bwd_s, "optim_s": optim_s, "tokens_per_s": n_tokens / (fwd_bwd_s + (optim_s or 0.0)),
        "default_variant": eager_default, "variants": out_variants,
        "kernels_vs_reference_speedup": speedup, "default_vs_reference_speedup": default_speedup,
        "compiled_vs_eager_speedup": compiled_speedup, "compile_s": compile_s}


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    sys.exit(exit_on_user_error(main, sys.argv[1:]))
