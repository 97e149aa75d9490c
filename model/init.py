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
  nearly decomposable and 20 Sinkhorn rounds then leave its row sums ~1e-3 off) and `fn` ~ N(0, (hc_fn_init_scale)^2 / (n D)), which gives the mix
  logits a spread of about hc_fn_init_scale: small enough to stay near the plain residual, non-zero so
  the streams' symmetry breaks and they can specialise.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.config import ModelConfig
from model.norm import RMSNorm


@torch.no_grad()
def init_mhc_site(fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig) -> None:
    n = cfg.hc_mult
    fn.normal_(0.0, cfg.hc_fn_init_scale / math.sqrt(fn.shape[1]))
    base.zero_()
    base[:n] = -math.log(n - 1)  # sigmoid(-log(n-1)) = 1/n
    base[2 * n:].view(n, n).fill_diagonal_(cfg.hc_comb_init_logit)
    scale.fill_(1.0)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, cfg.init_std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("w1", "w2", "w3") and p.dim() == 3:  # stacked routed experts
            p.normal_(0.0, cfg.init_std)
        elif name.endswith("gate.weight"):
            p.normal_(0.0, cfg.init_std)
        elif leaf == "attn_sink":
            p.zero_()
        elif leaf in ("q_weight", "k_weight"):
            p.fill_(1.0)
        elif leaf in ("image_start", "image_newline", "image_end"):
            p.normal_(0.0, cfg.init_std)
    for block in getattr(model, "layers", []):
        for site in ("attn", "ffn"):
            init_mhc_site(getattr(block, f"hc_{site}_fn"), getattr(block, f"hc_{site}_base"),
                          getattr(block, f"hc_{site}_scale"), cfg)
