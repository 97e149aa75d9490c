"""Does flashtrain learn as it should, and what does each V4.1 component buy? A small exp through its whole
schedule, best LR against best LR with a textbook dense decoder, and one ablation per component, scored on
the same held-out set (docs/training.md "Does it learn?" and "What each component buys").

    python launch/bench_learning.py [--ablations] [--parallel N] [--lrs 1e-3,3e-3,...] [--dense-lrs ...]
                                    [--root DIR] [--out docs/learning] [OVERRIDES ...]

OVERRIDES are the runs' Hydra overrides (default `+exp=flash_tiny`: 391 steps of 512 tokens). The peak LR is
the sweep's: each run gets `schedule.peak_lr=LR schedule.final_lr=LR/10`.

1. **flashtrain**, its peak LR swept over `--lrs` (default 1e-3, 3e-3, 1e-2, 3e-2: x3 apart): one
   `launch/pretrain.py` run per LR, one process, its `train.eval.interval` eval events.
2. **dense**, a plain decoder written here in plain PyTorch (pre-norm causal attention with RoPE, a SwiGLU
   MLP, RMSNorm, untied head; GPT-2 init), its peak LR swept over `--dense-lrs` (default the same), AdamW
   (betas 0.9 / 0.95, weight decay 0.1 on matrices, clip 1.0) on the runs' schedule shape, fp32, trained on
   the same batches (the run's loader, one process: the same rows in the same order) for the same steps,
   scored on the same held-out micro-batches with train/evaluation/heldout.py's accounting at the same steps. Image
   positions are inputs it cannot see into (the placeholder token); their labels are ignored, as for
   flashtrain. Its shape, by rule of thumb (`dense_shape`): the width and head size of Pythia-14M (Biderman
   et al. 2023; d_model 128, heads of 32), the smallest standard GPT shape; the Llama SwiGLU width 8/3 d; as
   many layers as flashtrain's activated parameters per token then pay for (12 d^2 each), the SwiGLU width
   then set so that the two counts match (model/inspect.py's count: the embedding table excluded on both
   sides).
3. The best LR of each sweep is the one with the lowest final held-out loss. When it is the sweep's smallest
   or largest LR, the sweep goes on one x3 step beyond it (at most `--max-extend` times), so the best one is
   bracketed; a diverged run (non-zero exit or non-finite loss) counts as infinitely bad.
4. `--ablations`: at flashtrain's best LR, one run per component replaced by its plain counterpart (one config
   switch each, `ABLATIONS`), and the same run with `train.seed=1` (the spread between two seeds: the noise
   floor a component's delta is read against). The Muon ablation (`OWN_SWEEP`) also gets its own LR sweep
   over `--lrs`, as in 3, reported as a row of its own: AdamW's best peak LR is not Muon's.
5. **unigram**: the entropy of the eval targets' own token frequencies, `H = -sum p ln p` over the scored
   positions of the held-out set: the loss of the best predictor that ignores context (an oracle one: it
   knows the eval set's frequencies). Its bpb is `N H / (bytes ln 2)`.

Every run has its directory `ROOT/<hash of its overrides>` (default ROOT /tmp/bench_learning); a finished one
is reused (flashtrain: its last step's eval in metrics.jsonl; dense: dense.json), an interrupted flashtrain run
resumes from its last checkpoint. `--parallel N` runs N at a time, each with cores / N threads.

Writes OUT/learning.png (eval loss against steps per variant; final loss against peak LR per sweep),
OUT/learning.json and OUT/learning.md (the tables). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OVERRIDES = ["+exp=flash_tiny"]
DEFAULT_LRS = (1e-3, 3e-3, 1e-2, 3e-2)
LR_STEP = 3.0  # the sweep's spacing, and how far an extension goes past its edge
FINAL_LR_RATIO = 0.1  # schedule.final_lr = peak / 10 on every run
# the ablations: one V4.1 component each, replaced by its plain counterpart through one config switch
ABLATIONS = {
    "no Engram": ["model.engram_layer_ids=[]"],
    "no mHC (plain residual)": ["model.residual=plain"],
    "no Muon (AdamW matrices)": ["optim.matrices=adamw"],
    "no CSA2 (dense attention)": ["model.attention=dense"],
    "no MoE (dense FFN)": ["model.ffn=dense"],
}
NOISE = ("flashtrain, seed 1", ["train.seed=1"])
# ablations that change the optimizer of the matrices also get their own LR sweep (over --lrs): AdamW's best peak
# LR is not Muon's, so the run at flashtrain's best LR alone would mostly measure a misplaced LR
OWN_SWEEP = ("no Muon (AdamW matrices)",)
# the dense baseline's shape rule (module docstring)
DENSE_WIDTH, DENSE_HEAD_DIM, SWIGLU_RATIO = 128, 32, 8 / 3


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


def dense_shape(vocab: int, target: int) -> dict:
    """The dense baseline's shape for `target` parameters per token (the module docstring's rule): width
    DENSE_WIDTH, heads of DENSE_HEAD_DIM, as many layers of 4 d^2 attention + a SwiGLU of SWIGLU_RATIO d as
    the budget left by the head and final norm pays for (at least 1), then the SwiGLU width that brings the
    count closest to `target`."""
    d = DENSE_WIDTH
    n_heads = d // DENSE_HEAD_DIM

    def count(n_layers: int, ffn: int) -> int:  # what DenseDecoder(...).params_per_token() gives
        return n_layers * (4 * d * d + 3 * d * ffn + 2 * d) + d * vocab + d

    per_layer = count(1, round(SWIGLU_RATIO * d)) - count(0, 0)
    n_layers = max(1, round((target - count(0, 0)) / per_layer))
    ffn = max(1, round((target - count(n_layers, 0)) / (3 * d * n_layers)))
    return {"dim": d, "n_layers": n_layers, "n_heads": n_heads, "ffn": ffn, "params_per_token": count(n_layers, ffn),
            "rule": f"width {d} and heads of {DENSE_HEAD_DIM} (Pythia-14M), SwiGLU 8/3 d, layers to match "
                    f"{target:,} activated parameters per token, then the SwiGLU width"}


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
    """The held-out loss and bpb with train/evaluation/heldout.py's accounting (CE sums over scored positions; bpb
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


class Setting:
    """What every run of the benchmark shares, from the base overrides: configs, steps, eval steps, held-out
    set, tokenizer byte counts, flashtrain's activated parameters per token."""

    def __init__(self, overrides: list[str]):
        from flashtrain.data.heldout import heldout_set
        from flashtrain.data.loader import data_sources, heldout_shards
        from flashtrain.data.tokenizer import load_tokenizer, token_byte_counts
        from flashtrain.train.build import read_configs, run_plan
        from flashtrain.train.config import compose

        self.overrides = overrides
        self.c = c = read_configs(compose(overrides))
        self.plan = run_plan(c, 1)
        self.steps = c.train.max_steps or c.schedule.total_steps
        interval = c.train.eval.interval
        if not interval:
            raise SystemExit("bench_learning.py: train.eval.interval=0 turns evaluation off; the benchmark needs it")
        self.eval_steps = sorted({s for s in range(interval, self.steps + 1, interval)} | {self.steps})
        _, tok = data_sources(c.data, c.spec)
        self.token_bytes = token_byte_counts(load_tokenizer(tok), c.spec.vocab_size)
        self.heldout = heldout_set(c.data, c.spec, heldout_shards(c.data, c.spec), c.train.eval.tokens,
                                   self.token_bytes)

    def activated(self, extra: list[str] = ()) -> int:
        from flashtrain.train.build import read_configs
        from flashtrain.train.config import compose
        from flashtrain.train.flops import flop_accounting

        c = read_configs(compose([*self.overrides, *extra])) if extra else self.c
        return int(flop_accounting(c.model, c.data.seq_len)["params_activated_per_token_inspect"])


def train_dense(s: Setting, shape: dict, lr: float) -> dict:
    """The dense baseline of `shape` at peak `lr` through the runs' schedule: its train losses and evals."""
    from flashtrain.data.loader import IGNORE, PackedLoader, data_sources

    c, m = s.c, s.c.model
    torch.manual_seed(c.train.seed)
    model = DenseDecoder(m.vocab_size, shape["dim"], shape["n_layers"], shape["n_heads"], shape["ffn"])
    decay = [p for p in model.parameters() if p.dim() == 2 and p is not model.embed.weight]
    rest = [p for p in model.parameters() if p.dim() != 2 or p is model.embed.weight]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    sources, _ = data_sources(c.data, c.spec)
    loader = PackedLoader(c.data, c.spec, sources)
    scale = lr / c.schedule.cfg.peak_lr
    train, evals = [], []
    t0 = time.perf_counter()
    for step in range(s.steps):
        for g in opt.param_groups:
            g["lr"] = c.schedule.lr(step) * scale
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(s.plan.accumulation):
            b = next(loader)
            logits = model(b["tokens"])
            loss = F.cross_entropy(logits.reshape(-1, m.vocab_size), b["labels"].reshape(-1), ignore_index=IGNORE)
            (loss / s.plan.accumulation).backward()
            total += float(loss.detach()) / s.plan.accumulation
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train.append({"step": step + 1, "loss": total})
        if not math.isfinite(total):
            break
        if step + 1 in s.eval_steps:
            evals.append({"step": step + 1, **dense_eval(model, s.heldout, s.token_bytes)})
            print(f"dense lr {lr:g} step {step + 1}: train {total:.4f}, eval {evals[-1]['loss']:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"train": train, "evals": evals, "params_per_token": model.params_per_token()}


# --- the runs -------------------------------------------------------------------------------------------
def lr_overrides(lr: float) -> list[str]:
    return [f"schedule.peak_lr={lr:g}", f"schedule.final_lr={lr * FINAL_LR_RATIO:g}"]


@dataclass
class Run:
    """One run of the benchmark: a flashtrain run (`launch/pretrain.py overrides`) or a dense baseline run
    (this script's `--dense-job`), in its own directory."""
    kind: str  # "flashtrain" | "dense"
    name: str
    overrides: list[str]
    root: Path
    lr: float = 0.0
    target: int = 0  # dense: the activated parameters per token its shape matches (dense_shape)
    seconds: float = 0.0
    evals: list[dict] = field(default_factory=list)
    failed: str = ""

    @property
    def dir(self) -> Path:
        key = hashlib.sha256(json.dumps([self.kind, self.target, *self.overrides]).encode()).hexdigest()[:10]
        return self.root / key

    def finished(self, steps: int) -> bool:
        """The run's results are on disk (read into `evals`, `seconds`)."""
        if self.kind == "dense":
            out = self.dir / "dense.json"
            if not out.exists():
                return False
            self.evals = json.loads(out.read_text())["evals"]
        else:
            metrics = self.dir / "metrics.jsonl"
            lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
            evals = [e for e in lines if e.get("event") == "eval"]
            if not evals or evals[-1]["step"] != steps:
                return False
            self.evals = evals
        timing = self.dir / "bench_seconds.json"  # written by run_all once the run is finished
        if timing.exists():
            self.seconds = json.loads(timing.read_text())["seconds"]
        return True

    def command(self) -> list[str]:
        if self.kind == "dense":
            return [sys.executable, str(Path(__file__).resolve()), "--dense-job", str(self.dir),
                    "--dense-target", str(self.target), *self.overrides]
        return [sys.executable, str(ROOT / "launch" / "pretrain.py"), *self.overrides, f"hydra.run.dir={self.dir}",
                "logging.wandb.mode=disabled", "logging.heatmap_interval=0", "logging.progress=false"]

    @property
    def final(self) -> float:
        """The last eval's loss; inf for a run that failed or diverged."""
        if self.failed or not self.evals or not math.isfinite(self.evals[-1]["loss"]):
            return math.inf
        return self.evals[-1]["loss"]


def run_all(runs: list[Run], steps: int, parallel: int) -> None:
    """Run what is not finished, `parallel` at a time with cores / parallel threads each; output to <dir>/log.txt."""
    todo = [r for r in runs if not r.finished(steps)]
    for r in runs:
        if r not in todo:
            print(f"reused {r.name} ({r.dir}): final eval loss {r.final:.4f}", flush=True)
    threads = max(1, (os.cpu_count() or 1) // parallel)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    live: list[tuple[Run, subprocess.Popen, float]] = []
    while todo or live:
        while todo and len(live) < parallel:
            r = todo.pop(0)
            r.dir.mkdir(parents=True, exist_ok=True)
            log = open(r.dir / "log.txt", "a")
            print(f"started {r.name} in {r.dir} ({threads} thread(s))", flush=True)
            live.append((r, subprocess.Popen(r.command(), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
                         time.perf_counter()))
        time.sleep(1.0)
        for item in list(live):
            r, proc, t0 = item
            if proc.poll() is None:
                continue
            live.remove(item)
            r.seconds = time.perf_counter() - t0
            if proc.returncode or not r.finished(steps):
                r.failed = f"exit {proc.returncode}; see {r.dir / 'log.txt'}"
                print(f"FAILED {r.name}: {r.failed}", flush=True)
                continue
            (r.dir / "bench_seconds.json").write_text(json.dumps({"seconds": r.seconds}))
            print(f"finished {r.name} in {r.seconds:.0f} s: final eval loss {r.final:.4f}", flush=True)


def sweep(kind: str, base: list[str], lrs: list[float], root: Path, steps: int, parallel: int,
          max_extend: int, target: int = 0, switch: tuple[str, ...] = (), label: str = "") -> list[Run]:
    """The runs of one LR sweep, extended past an edge that holds the best LR (module docstring, 3); `switch`
    (an ablation's overrides) after the LR's, as in the ablation runs, so a run both make is made once."""
    label = label or kind

    def make(lr: float) -> Run:
        return Run(kind, f"{label} lr {lr:g}", [*base, *lr_overrides(lr), *switch], root, lr, target)

    runs = [make(lr) for lr in sorted(lrs)]
    run_all(runs, steps, parallel)
    for _ in range(max_extend):
        nxt = extension(runs)
        if nxt is None:
            break
        print(f"{label}: the best LR is at the sweep's edge; extending to {nxt:g}", flush=True)
        runs.append(make(nxt))
        run_all(runs[-1:], steps, parallel)
        runs.sort(key=lambda r: r.lr)
    return runs


def best(runs: list[Run]) -> Run:
    """The run with the lowest final eval loss (the lower LR on a tie)."""
    return min(sorted(runs, key=lambda r: r.lr), key=lambda r: r.final)


def extension(runs: list[Run]) -> float | None:
    """The next LR to try when the best is the smallest or largest of the sweep (LR_STEP beyond it); None
    when it is bracketed (or nothing finished)."""
    lrs = sorted(r.lr for r in runs)
    b = best(runs)
    if not math.isfinite(b.final):
        return None
    if b.lr == lrs[0]:
        return lrs[0] / LR_STEP
    if b.lr == lrs[-1]:
        return lrs[-1] * LR_STEP
    return None


def at_steps(evals: list[dict], steps: list[int]) -> dict[int, dict]:
    by_step = {e["step"]: e for e in evals}
    return {s: by_step[s] for s in steps if s in by_step}


# --- the report -----------------------------------------------------------------------------------------
def tables(result: dict) -> str:
    """The markdown tables of docs/training.md from `result` (learning.json): the two LR sweeps, the variants'
    final loss / bpb with their deltas against full flashtrain, and the loss along the run."""
    lrs = sorted({r["lr"] for runs in result["sweep"].values() for r in runs})
    sweep_md = ["| final eval loss at peak LR | " + " | ".join(f"{lr:g}" for lr in lrs) + " |",
                "|---|" + "---|" * len(lrs)]
    for kind, runs in result["sweep"].items():
        by_lr = {r["lr"]: r["final_loss"] for r in runs}
        cells = ["" if lr not in by_lr else "diverged" if not math.isfinite(by_lr[lr]) else
                 f"**{by_lr[lr]:.3f}**" if lr == result["best_lr"][kind] else f"{by_lr[lr]:.3f}" for lr in lrs]
        sweep_md.append(f"| {kind} | " + " | ".join(cells) + " |")
    ref, uni = result["variants"][0], result["unigram"]
    final = ["| variant | activated params / token | final eval loss | final bpb | delta loss | delta bpb |",
             "|---|---|---|---|---|---|"]
    for v in result["variants"]:
        f, d = v["final"], v["delta"]
        final.append(f"| {v['name']} | {v['params_activated_per_token']:,} | {f['loss']:.3f} | {f['bpb']:.3f} | "
                     f"{d['loss']:+.3f} | {d['bpb']:+.3f} |")
    final.append(f"| unigram entropy of the eval tokens | | {uni['loss']:.3f} | {uni['bpb']:.3f} | "
                 f"{uni['loss'] - ref['final']['loss']:+.3f} | {uni['bpb'] - ref['final']['bpb']:+.3f} |")
    steps = result["eval_steps"]
    along = ["| eval loss (delta) at step | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for v in result["variants"]:
        cells = []
        for s in steps:
            e = v["along"].get(str(s))
            delta = "" if v is ref or e is None or e["delta_loss"] is None else f" ({e['delta_loss']:+.3f})"
            cells.append("" if e is None else f"{e['loss']:.3f}{delta}")
        along.append(f"| {v['name']} | " + " | ".join(cells) + " |")
    return "\n\n".join("\n".join(t) for t in (sweep_md, final, along)) + "\n"


def variant(name: str, run: Run, ref: Run | None, params: int, steps: list[int]) -> dict:
    """One row of the comparison: final loss / bpb, their deltas against `ref` (full flashtrain), and the
    loss along the run (with its delta at each eval step both have)."""
    mine = at_steps(run.evals, steps)
    theirs = at_steps(ref.evals, steps) if ref is not None else mine
    last = run.evals[-1]
    ref_last = (ref or run).evals[-1]
    return {"name": name, "overrides": run.overrides, "run_dir": str(run.dir), "seconds": round(run.seconds, 1),
            "params_activated_per_token": params,
            "final": {"step": last["step"], "loss": last["loss"], "bpb": last["bpb"]},
            "delta": {"loss": last["loss"] - ref_last["loss"], "bpb": last["bpb"] - ref_last["bpb"]},
            "along": {str(s): {"loss": e["loss"], "bpb": e["bpb"],
                               "delta_loss": e["loss"] - theirs[s]["loss"] if s in theirs else None}
                      for s, e in mine.items()}}


def plot(out: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.6, 1]})
    ax = axes[0]
    for i, v in enumerate(result["variants"]):
        steps = sorted(int(s) for s in v["along"])
        style = "o-" if i == 0 else ("s--" if v["name"].startswith("dense") else ".-")
        ax.plot(steps, [v["along"][str(s)]["loss"] for s in steps], style, label=v["name"], linewidth=1.2,
                markersize=4)
    ax.axhline(result["unigram"]["loss"], color="grey", linestyle=":", label="unigram entropy of the eval tokens")
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]
    for kind, runs in result["sweep"].items():
        style = {"flashtrain": "o-", "dense": "s--"}.get(kind, "^:")
        pts = [(r["lr"], r["final_loss"]) for r in runs if math.isfinite(r["final_loss"])]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{kind} (best {result['best_lr'][kind]:g})")
    ax.set_xscale("log")
    ax.set_xlabel("peak LR")
    ax.set_ylabel("final eval loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def dense_job(job_dir: Path, target: int, overrides: list[str]) -> int:
    """One dense baseline run (a child of `run_all`), shaped for `target` parameters per token."""
    s = Setting(overrides)
    lr = s.c.schedule.cfg.peak_lr
    shape = dense_shape(s.c.model.vocab_size, target)
    out = train_dense(s, shape, lr)
    tmp = job_dir / "dense.json.tmp"
    tmp.write_text(json.dumps({"lr": lr, "shape": shape, **out}))
    tmp.replace(job_dir / "dense.json")
    return 0


def main(argv: list[str]) -> int:
    from flashtrain.config.cli import overrides_help

    ap = argparse.ArgumentParser(prog="launch/bench_learning.py", description=__doc__, epilog=overrides_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--ablations", action="store_true",
                    help="also one run per ablated component and a second seed, at flashtrain's best LR")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time, cores / N threads each (default 1)")
    ap.add_argument("--lrs", default=",".join(f"{x:g}" for x in DEFAULT_LRS),
                    help="flashtrain's peak LRs (default %(default)s)")
    ap.add_argument("--dense-lrs", default=",".join(f"{x:g}" for x in DEFAULT_LRS),
                    help="the dense baseline's peak LRs (default %(default)s)")
    ap.add_argument("--max-extend", type=int, default=2,
                    help="how often a sweep may go past an edge holding its best LR (default 2)")
    ap.add_argument("--root", type=Path, default=Path("/tmp/bench_learning"),
                    help="where the runs' directories go (default /tmp/bench_learning)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "learning",
                    help="where learning.png, learning.json and learning.md go (default docs/learning)")
    ap.add_argument("--dense-job", type=Path, help=argparse.SUPPRESS)  # one dense run, started by run_all
    ap.add_argument("--dense-target", type=int, help=argparse.SUPPRESS)
    args, overrides = ap.parse_known_args(argv)
    if args.dense_job:
        return dense_job(args.dense_job, args.dense_target, overrides)
    if args.parallel < 1:
        ap.error(f"--parallel {args.parallel}: needs at least 1")
    overrides = overrides or DEFAULT_OVERRIDES
    if any(o.startswith(("schedule.peak_lr=", "schedule.final_lr=")) for o in overrides):
        ap.error("the peak LR is the sweep's: give it with --lrs / --dense-lrs, not schedule.peak_lr / final_lr")
    lrs = [float(x) for x in args.lrs.split(",")]
    dense_lrs = [float(x) for x in args.dense_lrs.split(",")]

    t_start = time.perf_counter()
    s = Setting(overrides)
    uni = unigram(s.heldout, s.token_bytes, s.c.spec.vocab_size)
    activated = s.activated()
    shape = dense_shape(s.c.model.vocab_size, activated)
    print(f"flashtrain: {activated:,} activated parameters per token; dense baseline {shape}", flush=True)
    args.root.mkdir(parents=True, exist_ok=True)
    flash_runs = sweep("flashtrain", overrides, lrs, args.root, s.steps, args.parallel, args.max_extend)
    dense_runs = sweep("dense", overrides, dense_lrs, args.root, s.steps, args.parallel, args.max_extend, activated)
    best_flash, best_dense = best(flash_runs), best(dense_runs)
    if not math.isfinite(best_flash.final) or not math.isfinite(best_dense.final):
        print("bench_learning.py: every run of a sweep failed or diverged; see the FAILED lines", file=sys.stderr)
        return 1

    variants = [variant(f"flashtrain (lr {best_flash.lr:g})", best_flash, None, activated, s.eval_steps),
                variant(f"dense baseline (lr {best_dense.lr:g})", best_dense, best_flash, shape["params_per_token"],
                        s.eval_steps)]
    sweeps = {"flashtrain": flash_runs, "dense": dense_runs}
    every = {r.dir: r for r in [*flash_runs, *dense_runs]}  # every run this result reads, by directory
    if args.ablations:
        base = best_flash.overrides
        extra = [Run("flashtrain", name, [*base, *switch], args.root, best_flash.lr)
                 for name, switch in [*ABLATIONS.items(), NOISE]]
        run_all(extra, s.steps, args.parallel)
        every.update({r.dir: r for r in extra})
        for r in extra:
            if not r.evals:
                print(f"bench_learning.py: {r.name} has no result ({r.failed})", file=sys.stderr)
                continue
            switch = r.overrides[len(base):]
            variants.append(variant(r.name, r, best_flash, s.activated(switch), s.eval_steps))
        for name in OWN_SWEEP:
            runs = sweep("flashtrain", overrides, lrs, args.root, s.steps, args.parallel, args.max_extend,
                         switch=tuple(ABLATIONS[name]), label=name)
            sweeps[name] = runs
            every.update({r.dir: r for r in runs})
            own = best(runs)
            if math.isfinite(own.final):
                variants.append(variant(f"{name}, its own best lr {own.lr:g}", own, best_flash,
                                        s.activated(ABLATIONS[name]), s.eval_steps))

    result = {
        "overrides": overrides, "steps": s.steps, "tokens_per_step": s.c.schedule.tokens_per_step,
        "eval_steps": s.eval_steps, "unigram": uni, "dense_shape": shape,
        "sweep": {kind: [{"lr": r.lr, "final_loss": r.final, "run_dir": str(r.dir), "seconds": round(r.seconds, 1),
                          "failed": r.failed} for r in runs]
                  for kind, runs in sweeps.items()},
        "best_lr": {kind: best(runs).lr for kind, runs in sweeps.items()},
        "variants": variants,
        "seconds": {"this_invocation": round(time.perf_counter() - t_start, 1),
                    "runs_total": round(sum(r.seconds for r in every.values()), 1),  # each run once
                    "parallel": args.parallel, "cpus": os.cpu_count()},
        "title": f"{' '.join(overrides)}: {s.steps} steps of {s.c.schedule.tokens_per_step} tokens; eval "
                 f"{uni['tokens']} held-out tokens",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learning.json").write_text(json.dumps(result, indent=1))
    md = tables(result)
    (args.out / "learning.md").write_text(md)
    plot(args.out / "learning.png", result)
    print("\n" + md)
    print(f"wrote {args.out / 'learning.png'}, {args.out / 'learning.json'} and {args.out / 'learning.md'} "
          f"({result['seconds']['this_invocation']:.0f} s this invocation)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
