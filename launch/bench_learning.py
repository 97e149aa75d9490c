"""Does flashtrain learn as it should? A small exp through its whole schedule, its held-out loss and bits
per byte next to two references on the same eval set and tokenizer (docs/training.md "Does it learn").

    python launch/bench_learning.py [--run-dir DIR] [--out docs/learning] [--baseline-lr 2e-3] [OVERRIDES ...]

OVERRIDES are the run's Hydra overrides (default `+exp=flash_tiny schedule.peak_lr=2e-3
schedule.final_lr=2e-4`: flash_tiny's published 2.6e-4 is the 552B model's peak, far too small a step
for a 3M-parameter model to get anywhere in 391 steps).

1. **flashtrain**: `launch/pretrain.py OVERRIDES` in DIR (default /tmp/bench_learning/<hash of the
   overrides>), one process, its `train.eval.interval` eval events. A finished run in DIR is reused; an
   interrupted one resumes from its last checkpoint (DIR keeps it).
2. **unigram**: the entropy of the eval targets' own token frequencies, `H = -sum p ln p` over the
   scored positions of the held-out set: the loss of the best predictor that ignores context (an
   oracle one: it knows the eval set's frequencies). Its bpb is `N H / (bytes ln 2)`.
3. **dense**: a plain decoder written here in plain PyTorch (pre-norm causal attention with RoPE and
   a SwiGLU MLP per layer, RMSNorm, untied head) with the run's width and depth and the MLP width
   chosen so that its parameters per token equal flashtrain's activated ones (model/inspect.py; the
   embedding table excluded on both sides). AdamW (betas 0.9 / 0.95, weight decay 0.1, clip 1.0) on the
   run's LR schedule scaled to `--baseline-lr`, fp32, trained on the same batches (the run's loader,
   one process: the same rows in the same order) for the same steps, scored on the same held-out
   micro-batches with the same accounting (train/evaluate.py) at the same steps. Image positions are
   inputs it cannot see into (the placeholder token); their labels are ignored, as for flashtrain.

Writes OUT/learning.png (eval loss and bpb against steps) and OUT/learning.json, and prints a markdown
table. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OVERRIDES = ["+exp=flash_tiny", "schedule.peak_lr=2e-3", "schedule.final_lr=2e-4"]


# --- the dense baseline -------------------------------------------------------------------------------
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of [B, heads, S, h] by the positions' angles."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class DenseBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, ffn: int):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wqkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(B, S, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, S, D))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class DenseDecoder(nn.Module):
    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, ffn: int, rope_theta: float = 10000.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(DenseBlock(dim, n_heads, ffn) for _ in range(n_layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        half = dim // n_heads // 2
        self.register_buffer("inv_freq", rope_theta ** (-torch.arange(half, dtype=torch.float32) / half),
                             persistent=False)
        for name, p in self.named_parameters():  # GPT-2 style: N(0, 0.02), residual outputs / sqrt(2 L)
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(tokens.shape[1], dtype=torch.float32)[:, None] * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def params_per_token(self) -> int:
        """Every parameter but the embedding table (a row is read, not multiplied): model/inspect.py's rule."""
        return sum(p.numel() for p in self.parameters()) - self.embed.weight.numel()


def matched_dense(vocab: int, dim: int, n_layers: int, n_heads: int, target: int) -> DenseDecoder:
    """The dense decoder of this width and depth whose parameters per token come closest to `target`."""
    fixed = DenseDecoder(vocab, dim, n_layers, n_heads, 1).params_per_token() - 3 * dim * n_layers
    ffn = max(1, round((target - fixed) / (3 * dim * n_layers)))
    return DenseDecoder(vocab, dim, n_layers, n_heads, ffn)


# --- references on the held-out set ---------------------------------------------------------------------
def unigram(heldout, token_bytes: np.ndarray, vocab: int) -> dict:
    """Entropy (nats) of the eval targets' token frequencies and its bits per byte."""
    from flashtrain.data.heldout import collate_labels
    from flashtrain.data.loader import IGNORE

    counts = np.zeros(vocab, np.int64)
    for _, rows in heldout.batches:
        labels = collate_labels(rows, heldout.spec, heldout.seq_len)
        counts += np.bincount(labels[labels != IGNORE], minlength=vocab)
    n = counts.sum()
    p = counts[counts > 0] / n
    h = float(-(p * np.log(p)).sum())
    n_bytes = float((counts * token_bytes).sum())
    return {"loss": h, "bpb": n * h / (n_bytes * math.log(2)), "tokens": int(n)}


def dense_eval(model: DenseDecoder, heldout, token_bytes: np.ndarray) -> dict:
    """The held-out loss and bpb with train/evaluate.py's accounting (CE sums over scored positions; bpb
    over those whose target stands for bytes)."""
    from flashtrain.data.loader import IGNORE

    tb = torch.as_tensor(token_bytes, dtype=torch.float64)
    ce = ce_bytes = n = n_bytes = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(len(heldout.batches)):
            b = heldout.batch(i)
            labels = b["labels"].reshape(-1)
            loss = F.cross_entropy(model(b["tokens"]).reshape(-1, model.head.out_features).float(), labels,
                                   ignore_index=IGNORE, reduction="none").double()
            keep = labels != IGNORE
            has = tb[labels.clamp(min=0)] > 0
            ce += float(loss[keep].sum())
            ce_bytes += float(loss[keep & has].sum())
            n += int(keep.sum())
            n_bytes += float(tb[labels[keep]].sum())
    model.train()
    return {"loss": ce / n, "bpb": ce_bytes / (n_bytes * math.log(2)), "tokens": int(n)}


# --- the runs -------------------------------------------------------------------------------------------
def flashtrain_run(overrides: list[str], run_dir: Path) -> list[dict]:
    """launch/pretrain.py in `run_dir` (resumed if it holds a checkpoint); its metrics lines."""
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, str(ROOT / "launch" / "pretrain.py"), *overrides, f"hydra.run.dir={run_dir}",
           "logging.wandb.mode=disabled", "logging.heatmap_interval=0"]
    print("flashtrain:", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"flashtrain finished in {time.perf_counter() - t0:.0f} s", flush=True)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def train_dense(c, plan, heldout, token_bytes: np.ndarray, target_params: int, lr: float, steps: int,
                eval_steps: set[int]) -> tuple[DenseDecoder, list[dict], list[dict]]:
    from flashtrain.data.loader import IGNORE, PackedLoader, data_sources

    torch.manual_seed(c.train.seed)
    m = c.model
    model = matched_dense(m.vocab_size, m.dim, m.n_layers, m.n_heads, target_params)
    decay = [p for p in model.parameters() if p.dim() == 2 and p is not model.embed.weight]
    rest = [p for p in model.parameters() if p.dim() != 2 or p is model.embed.weight]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    sources, _ = data_sources(c.data, c.spec)
    loader = PackedLoader(c.data, c.spec, sources)
    scale = lr / c.schedule.cfg.peak_lr
    train, evals = [], []
    t0 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = c.schedule.lr(step) * scale
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(plan.accumulation):
            b = next(loader)
            logits = model(b["tokens"])
            loss = F.cross_entropy(logits.reshape(-1, m.vocab_size), b["labels"].reshape(-1), ignore_index=IGNORE)
            (loss / plan.accumulation).backward()
            total += float(loss.detach()) / plan.accumulation
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train.append({"step": step + 1, "loss": total})
        if step + 1 in eval_steps:
            evals.append({"step": step + 1, **dense_eval(model, heldout, token_bytes)})
            print(f"dense step {step + 1}: train {total:.4f}, eval {evals[-1]['loss']:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return model, train, evals


def plot(out: Path, flash: list[dict], dense: list[dict], uni: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, unit in ((axes[0], "loss", "eval loss (nats / token)"), (axes[1], "bpb", "eval bits per byte")):
        ax.plot([e["step"] for e in flash], [e[key] for e in flash], "o-", label="flashtrain")
        ax.plot([e["step"] for e in dense], [e[key] for e in dense], "s--", label="dense AdamW baseline")
        ax.axhline(uni[key], color="grey", linestyle=":", label="unigram entropy of the eval tokens")
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    from flashtrain.config.cli import overrides_help

    ap = argparse.ArgumentParser(prog="launch/bench_learning.py", description=__doc__, epilog=overrides_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--run-dir", type=Path,
                    help="the flashtrain run's directory (default /tmp/bench_learning/<hash of the overrides>)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "learning",
                    help="where learning.png and learning.json go (default docs/learning)")
    ap.add_argument("--baseline-lr", type=float, default=2e-3,
                    help="the dense baseline's peak LR, on the run's schedule shape (default 2e-3)")
    args, overrides = ap.parse_known_args(argv)
    overrides = overrides or DEFAULT_OVERRIDES
    key = hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:10]
    run_dir = args.run_dir or Path("/tmp/bench_learning") / key

    from flashtrain.data.heldout import heldout_set
    from flashtrain.data.loader import data_sources, heldout_shards
    from flashtrain.data.tokenizer import load_tokenizer, token_byte_counts
    from flashtrain.train.build import read_configs, run_plan
    from flashtrain.train.config import compose
    from flashtrain.train.flops import flop_accounting

    c = read_configs(compose(overrides))
    plan = run_plan(c, 1)
    steps = c.train.max_steps or c.schedule.total_steps
    _, tok = data_sources(c.data, c.spec)
    token_bytes = token_byte_counts(load_tokenizer(tok), c.spec.vocab_size)
    heldout = heldout_set(c.data, c.spec, heldout_shards(c.data, c.spec), c.train.eval.tokens, token_bytes)
    uni = unigram(heldout, token_bytes, c.spec.vocab_size)
    activated = int(flop_accounting(c.model, c.data.seq_len)["params_activated_per_token_inspect"])

    lines = flashtrain_run(overrides, run_dir)
    flash = [e for e in lines if e.get("event") == "eval"]
    flash_train = [r for r in lines if "event" not in r]
    if not flash:
        print("bench_learning.py: the run wrote no eval events (train.eval.interval=0?)", file=sys.stderr)
        return 2
    model, dense_train, dense = train_dense(c, plan, heldout, token_bytes, activated, args.baseline_lr, steps,
                                            {e["step"] for e in flash})
    args.out.mkdir(parents=True, exist_ok=True)
    title = (f"{' '.join(overrides)}: {steps} steps of {c.schedule.tokens_per_step} tokens; eval {uni['tokens']} "
             f"held-out tokens")
    plot(args.out / "learning.png", flash, dense, uni, title)
    result = {"overrides": overrides, "steps": steps, "tokens_per_step": c.schedule.tokens_per_step,
              "params_activated_per_token": {"flashtrain": activated, "dense": model.params_per_token()},
              "dense_shape": {"dim": c.model.dim, "n_layers": c.model.n_layers, "n_heads": c.model.n_heads,
                              "ffn": model.blocks[0].w1.out_features, "lr": args.baseline_lr},
              "unigram": uni, "flashtrain": flash, "dense": dense,
              "train_loss_final": {"flashtrain": flash_train[-1]["loss"], "dense": dense_train[-1]["loss"]}}
    (args.out / "learning.json").write_text(json.dumps(result, indent=1))
    print("\n| step | flashtrain loss | flashtrain bpb | dense loss | dense bpb |\n|---|---|---|---|---|")
    for f, d in zip(flash, dense):
        print(f"| {f['step']} | {f['loss']:.3f} | {f['bpb']:.3f} | {d['loss']:.3f} | {d['bpb']:.3f} |")
    print(f"| unigram entropy | {uni['loss']:.3f} | {uni['bpb']:.3f} | | |")
    print(f"\nactivated parameters per token: flashtrain {activated:,}, dense {model.params_per_token():,}; "
          f"wrote {args.out / 'learning.png'} and {args.out / 'learning.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
