"""Weight initialisation (not published by DeepSeek; our choice, V41_SPEC §3 asks us to document it).

- Matrices (linear weights, stacked experts, gate, embedding, head, Engram tables, ViT and aligner)
  and the image START / NEWLINE / END vectors: N(0, init_std), init_std = 0.006 as in DeepSeek-V3's
  public training config; linear biases 0. (The report's ViT arrives pre-trained; loading it is a
  checkpoint import, not an init.)
- RMSNorm weights and Engram q/k weights: 1. Attention sinks: 0. MoE selection biases: 0.
- mHC sites start as a plain residual. The embedding is copied to all 4 streams, so the streams are
  identical at step 0, and then for any doubly stochastic B: sum_i B_ij X_i = X. With
  pre base = logit(1/n) (A_i = 1/n, the collapse returns X), post base = 0 (C_j = 2 sigmoid(0) = 1)
  and scale = 1, every sublayer computes X'_j = X + F(X): an ordinary pre-norm residual block.
  comb base puts `hc_comb_init_logit` = 1 on the diagonal (B leans to the identity, 0.48 on the
  diagonal, so streams keep some of their own history once they differ; a much larger logit makes B
  nearly decomposable and 20 Sinkhorn rounds then leave its row sums ~1e-3 off) and
  `fn` ~ N(0, (hc_fn_init_scale)^2 / (n D)), which gives the mix
  logits a spread of about hc_fn_init_scale: small enough to stay near the plain residual, non-zero so
  the streams' symmetry breaks and they can specialise.

Layout independence (DESIGN.md "Construction at scale"): no value comes from the global RNG. A
parameter is filled in blocks of rows along dim 0 (one routed expert of a stacked [E, ...] tensor, or
`INIT_BLOCK_ELEMS` elements' worth of rows of any other tensor); block b of parameter NAME draws from a
generator seeded by sha256(f"{seed}/{NAME}/{b}"), on the CPU, and is copied to the parameter's device.
A rank that holds only some stages, or only experts [offset, offset + E/ep), fills exactly the blocks it
owns and gets the same values as one process building the whole model. Buffers (RoPE tables, Engram
primes / multipliers / token map, MoE selection biases) are recomputed by `reset_buffers`, so a model
built on the meta device and materialised with `to_empty` is complete.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch
from torch import nn

from flashtrain.model.config import ModelConfig
from flashtrain.model.norm import RMSNorm
from flashtrain.model.simulation import simulated

INIT_BLOCK_ELEMS = 1 << 22  # elements per seeded block (a 16 MiB fp32 temporary at most)
STACKED_EXPERT_WEIGHTS = ("w1", "w2", "w3")


def _generator(seed: int, name: str, block: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def block_rows(row_shape: tuple[int, ...], stacked: bool) -> int:
    """Rows (along dim 0) per seeded block: one expert of a stacked tensor, else a fixed element budget."""
    return 1 if stacked else max(1, INIT_BLOCK_ELEMS // max(1, math.prod(row_shape)))


@torch.no_grad()
def seeded_normal_(p: torch.Tensor, std: float, seed: int, name: str, row_offset: int = 0,
                   stacked: bool = False, global_rows: int | None = None) -> None:
    """Fill p, which holds global rows [row_offset, row_offset + p.shape[0]) of a `global_rows`-row
    tensor (default: p is the whole tensor), with N(0, std^2): block b (rows [b per, (b+1) per) of the
    global tensor, the last one cut at global_rows) from its own generator, so the values depend on the
    global name, shape and row only. A fake tensor (train/plan/estimate.py) has no values to fill."""
    if simulated(p):
        return
    if p.dim() == 0:
        p.copy_(torch.empty(()).normal_(0.0, std, generator=_generator(seed, name, 0)))
        return
    rows, row_shape = p.shape[0], tuple(p.shape[1:])
    total = row_offset + rows if global_rows is None else global_rows
    per = min(block_rows(row_shape, stacked), total)
    for b in range(row_offset // per, (row_offset + rows - 1) // per + 1):
        start = b * per
        block = torch.empty((min(per, total - start),) + row_shape).normal_(
            0.0, std, generator=_generator(seed, name, b))
        lo, hi = max(start, row_offset), min(start + per, row_offset + rows)
        p[lo - row_offset:hi - row_offset].copy_(block[lo - start:hi - start])


@torch.no_grad()
def init_mhc_site(fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig,
                  fill_normal: Callable[[torch.Tensor, float], None]) -> None:
    """One mHC site; `fill_normal(t, std)` draws fn."""
    n = cfg.hc_mult
    fill_normal(fn, cfg.hc_fn_init_scale / math.sqrt(fn.shape[1]))
    base.zero_()
    base[:n] = -math.log(n - 1)  # sigmoid(-log(n-1)) = 1/n
    base[2 * n:].view(n, n).fill_diagonal_(cfg.hc_comb_init_logit)
    scale.fill_(1.0)


def _rule(module: nn.Module, leaf: str, p: torch.Tensor) -> str:
    """How a parameter starts (normal / expert / zero / one / an mHC site), by its module type and name;
    unknown ones are an error."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return "normal" if leaf == "weight" else "zero"
    if isinstance(module, RMSNorm):
        return "one"
    if leaf in STACKED_EXPERT_WEIGHTS and p.dim() == 3:  # stacked routed experts
        return "expert"
    if leaf == "weight" and type(module).__name__ == "Gate":
        return "normal"
    if leaf == "attn_sink":
        return "zero"
    if leaf in ("q_weight", "k_weight"):
        return "one"
    if leaf in ("image_start", "image_newline", "image_end"):
        return "normal"
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return "mhc"  # the whole site: fn, base and scale
    if leaf.startswith("hc_") and leaf.endswith(("_base", "_scale")):
        return "with_mhc_fn"
    raise ValueError(f"model/init.py: no initialisation rule for parameter {leaf!r} of {type(module).__name__}; "
                     f"add one to _rule")


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int = 0) -> None:
    """Initialise every parameter the model holds (after pruning / sharding: only those), by global name."""
    for mname, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            name = f"{mname}.{leaf}" if mname else leaf
            rule = _rule(module, leaf, p)
            if rule == "normal":  # a row block of a row-sharded table draws the global rows it holds
                seeded_normal_(p, cfg.init_std, seed, name, row_offset=getattr(module, "row_offset", 0),
                               global_rows=getattr(module, "global_rows", None))
            elif rule == "expert":
                seeded_normal_(p, cfg.init_std, seed, name, row_offset=getattr(module, "offset", 0), stacked=True,
                               global_rows=getattr(module, "n_global", p.shape[0]))
            elif rule == "zero":
                p.zero_()
            elif rule == "one":
                p.fill_(1.0)
            elif rule == "mhc":
                site = leaf[:-len("_fn")]
                init_mhc_site(p, getattr(module, f"{site}_base"), getattr(module, f"{site}_scale"), cfg,
                              lambda t, std, name=name: seeded_normal_(t, std, seed, name))


def reset_buffers(model: nn.Module) -> None:
    """Recompute every buffer from the config (after `to_empty`, buffers hold garbage)."""
    for module in model.modules():
        if module is not model and hasattr(module, "reset_buffers"):
            module.reset_buffers()
