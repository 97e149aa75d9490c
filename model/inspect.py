"""Parameter accounting of a built model (works on the meta device): totals by kind, activated
parameters per token, and per-layer counts. `launch/plan.py` prints it; the pipeline partitioner
reads the per-layer numbers.

Activated per token (our accounting; the report gives "about 16B" without a breakdown): every
parameter a token's forward pass multiplies with -- all non-expert weights (attention, compressor,
indexer, gate, shared expert, mHC, norms, Engram `wkv`, head) plus `n_activated_experts` routed
experts per layer -- plus the Engram table rows it looks up (n_cols x head_dim per Engram layer).
The token embedding is a lookup of one row and is not counted; the vision tower runs per image,
not per token, and is not counted either.

Totals: `params_backbone` is the report's "backbone" (text model + vision tower + projector), split
into `params_text` and `params_vision` (ViT, aligner, image START/NEWLINE/END vectors); the Engram
tables are `params_engram`.
"""

from __future__ import annotations

from torch import nn

from flashtrain.model.config import ModelConfig

VISION_ROOTS = ("vision", "aligner", "image_start", "image_newline", "image_end")


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def inspect_model(model: nn.Module, cfg: ModelConfig) -> dict:
    engram_tables = sum(b.engram.embed.weight.numel() for b in model.layers if b.engram is not None)
    total = _numel(model)
    vision = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[0] in VISION_ROOTS)
    moe = [b for b in model.layers if hasattr(b.ffn, "experts")]  # none with `ffn: dense` (the MoE ablation)
    routed = sum(_numel(b.ffn.experts) for b in moe)
    per_expert = routed // (cfg.n_routed_experts * len(moe)) if moe else 0
    n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    engram_rows_read = sum(n_cols * cfg.engram_head_dim for b in model.layers if b.engram is not None)
    activated = (total - engram_tables - vision - routed - model.embed.weight.numel()
                 + cfg.n_activated_experts * per_expert * len(moe) + engram_rows_read)
    layers = []
    for role, block in zip(model.plan, model.layers):
        engram = 0 if block.engram is None else _numel(block.engram)
        layers.append({
            **role.as_dict(),
            "params": _numel(block),
            "params_attn": _numel(block.attn),
            "params_ffn": _numel(block.ffn),
            "params_engram": engram,
        })
    return {
        "params_backbone": total - engram_tables,
        "params_text": total - engram_tables - vision,
        "params_vision": vision,
        "params_vit": _numel(model.vision) if vision else 0,
        "params_engram": engram_tables,
        "params_total": total,
        "params_activated_per_token": activated,
        "params_embedding": model.embed.weight.numel(),
        "params_head": model.head.weight.numel(),
        "layers": layers,
    }
