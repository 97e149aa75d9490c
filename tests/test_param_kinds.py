"""The parameter-kind table (model/param_kinds.py) against a hand count for flash_tiny."""

from flashtrain.model.param_kinds import ParamKind, parameter_kinds
from flashtrain.parallel.construct import model_template
from flashtrain.parallel.pipeline import prune_to_stages, stage_ranges


def test_flash_tiny_kinds_by_hand(tiny_cfg):
    kinds = parameter_kinds(model_template(tiny_cfg))
    counts = {k: sum(1 for v in kinds.values() if v is k) for k in ParamKind}
    # 40 layers; Full 2, 8, 14 (ratio 2: compressor wkv + wgate), Full 20 (ratio 1: wkv only);
    # indexers on the 4 Full + 4 Reindex layers (wq_b, weights_proj; wk on the Full ones); Engram at 1, 14;
    # a 2-block ViT (flash_tiny: vision_n_layers 2) and the aligner
    per_layer_matrices = 2 + 5 + 1 + 3  # hc_{attn,ffn}_fn; wq_a wq_b wkv wo_a wo_b; gate; shared w1-w3
    matrices = (40 * per_layer_matrices + (3 * 2 + 1) + (8 * 2 + 4) + 2  # ... compressors, indexers, Engram wkv
                + 1 + 2 * 4 + 2)  # patch embedding; per ViT block wqkv wo mlp.w1 mlp.w2; aligner w1 w2
    per_layer_vectors = 4 + 2 + 1 + 2  # hc_{attn,ffn}_{base,scale}; attn_norm ffn_norm; attn_sink; q_norm kv_norm
    vectors = (3 + 40 * per_layer_vectors + 4 + 4 + 2 * 2 + 1  # image vectors, compressor / k norms, Engram q/k, norm
               + 1 + 2 * 4 + 1 + 2)  # patch bias; ViT blocks: norm1 norm2 wqkv.bias wo.bias; vision.norm; aligner
    assert counts == {ParamKind.ROUTED_EXPERT: 40 * 3, ParamKind.ENGRAM_TABLE: 2, ParamKind.EMBEDDING: 1,
                      ParamKind.HEAD: 1, ParamKind.MATRIX: matrices, ParamKind.VECTOR: vectors}
    assert matrices == 480 and vectors == 388 and len(kinds) == 992
    assert kinds["embed.weight"] is ParamKind.EMBEDDING and kinds["head.weight"] is ParamKind.HEAD
    assert kinds["layers.1.engram.embed.weight"] is kinds["layers.14.engram.embed.weight"] is ParamKind.ENGRAM_TABLE
    assert kinds["layers.7.ffn.experts.w3"] is ParamKind.ROUTED_EXPERT
    for n in ("layers.7.ffn.shared_experts.w3.weight", "layers.1.engram.wkv.weight", "layers.0.hc_attn_fn",
              "vision.patch_embed.proj.weight", "layers.24.attn.indexer.wq_b.weight"):
        assert kinds[n] is ParamKind.MATRIX, n
    for n in ("layers.1.engram.q_weight", "layers.14.engram.k_weight", "image_start", "norm.weight",
              "layers.0.attn.attn_sink", "aligner.w1.bias"):
        assert kinds[n] is ParamKind.VECTOR, n


def test_kinds_follow_the_modules_after_pruning(tiny_cfg):
    """A middle pipeline stage holds no embedding or head; what it holds keeps its kind."""
    model = model_template(tiny_cfg)
    prune_to_stages(model, [stage_ranges([(0, 10), (10, 20), (20, 40)])[1]])
    kinds = parameter_kinds(model)
    assert ParamKind.EMBEDDING not in kinds.values() and ParamKind.HEAD not in kinds.values()
    assert kinds["layers.14.engram.embed.weight"] is ParamKind.ENGRAM_TABLE
    assert sum(1 for v in kinds.values() if v is ParamKind.ROUTED_EXPERT) == 10 * 3
