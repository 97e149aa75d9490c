"""Typed configuration of the V4.1-Flash text backbone (V41_SPEC §1).

Field names follow DeepSeek's public V4.1 config / inference `ModelArgs` (`dim`, `compress_ratios`,
`kv_source_layers`, ...). Hydra fills this from `conf/model/*.yaml`; `validate()` runs before any
model is built and every error names the field, the bad value and what would fix it.

Choices the report leaves open are fields too (documented where they are used):
`balance_loss_alpha`, `indexer_loss_weight`, `init_std`, `hc_fn_init_scale`, `hc_comb_init_logit`,
`attn_chunk_size`.

The DSpark drafter (V41_SPEC §8b) has the public `ModelArgs` fields `n_mtp_layers`, `dspark_block_size`,
`dspark_noise_token_id`, `dspark_target_layer_ids`, `dspark_markov_rank`, `dspark_n_routed_experts`,
`dspark_n_activated_experts`, and `compress_ratios` may list one (0) entry per drafter layer after the
backbone's, as the released config does. Only the DSpark stage builds the drafter (model/dspark.py); its
fields are checked by `validate_drafter()` there, so a backbone run with a short layer plan is unaffected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashtrain.config.errors import ConfigError


@dataclass
class QATConfig:
    """Quantisation-aware training (issue 16): fake-quantise (straight-through) the tensors the public
    inference kernels store quantised, in their formats (model/quant.py), so a model trained with it serves
    with the official quantised kernels without skew. All off by default.

    - `indexer_fp4`: the indexer's query and key after RoPE in MXFP4 (E2M1, an E8M0 scale per 32 channels);
    - `compressed_kv_fp4`: the main compressed KV after RoPE in E2M1 with an E4M3 scale per 16 channels
      (the V4.1 report's FP4 KV, §2.4.4);
    - `window_kv_fp8`: the sliding-window KV after RoPE in FP8 E4M3 with an E8M0 scale per 32 channels.

    And the weights, in the formats the release stores them in (issue 35; model/formats.py), so that an
    exported checkpoint is exactly the model that was trained (docs/official_formats.md "Exact export"):

    - `experts_fp4`: the routed experts' w1 / w2 / w3 in E2M1 with an E8M0 scale per 32 inputs (MXFP4);
    - `weights_fp8`: the Linears the release stores in FP8 (attention wq_a / wq_b / wkv / wo_b, indexer
      wq_b, shared expert, Engram wkv) in E4M3 with an E8M0 scale per 32 x 32 tile, and the Engram
      tables in E4M3 with an E8M0 scale per 32 channels of a row;
    - `weights_bf16`: every weight the release stores in BF16 (embedding, head, norms, wo_a, compressor,
      indexer wk / weights_proj, gate, Engram q / k weights, ViT, aligner, image vectors) rounded to BF16.

    Each is fake-quantised in the forward from the fp32 master weight with a straight-through gradient."""
    indexer_fp4: bool = False
    compressed_kv_fp4: bool = False
    window_kv_fp8: bool = False
    experts_fp4: bool = False
    weights_fp8: bool = False
    weights_bf16: bool = False

    # channel blocks of the formats (the public code's fp4_block_size, its compressed-KV groups, fp8_block_size)
    INDEXER_BLOCK = 32
    COMPRESSED_KV_BLOCK = 16
    WINDOW_KV_BLOCK = 32
    WEIGHT_BLOCK = 32  # fp8_block_size (32 x 32 weight tiles, 32-channel Engram rows) and fp4_block_size (experts)


@dataclass
class FP8Config:
    """FP8 GEMMs (issue 35; model/fp8_linear.py): the forward and both backward GEMMs (dgrad, wgrad) of the
    Linears the release stores in FP8 run on E4M3 operands with E8M0 (power-of-two) scales -- the weight
    in the release's 32 x 32 tiles, activations and output gradients in blocks of 32 along the reduction
    dimension -- accumulated in fp32 (V3 report §3.3, with V4.1's block of 32). Real FP8 GEMMs on CUDA (a
    Triton kernel, model/kernels/fp8_gemm.py), an exact emulation (dequantise, fp32 matmul) on the CPU.
    Off by default."""
    enabled: bool = False

    BLOCK = 32  # the scale block (the public code's fp8_block_size)


@dataclass
class ModelConfig:
    # vocabulary and width
    vocab_size: int = 129280
    dim: int = 5120
    n_layers: int = 40
    # attention (§1): MQA-like, one shared K=V latent of head_dim
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    norm_eps: float = 1e-20
    window_size: int = 128
    # CSA2 layer roles (§2)
    compress_ratios: list[int] = field(default_factory=lambda: [0] * 2 + [2] * 18 + [1] * 20)
    kv_source_layers: list[int] = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layers: list[int] = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    candidate_source_layer: int = 20  # -1 disables the candidate pool
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    candidate_restriction: bool = True  # Reindex layers score only inside the pool (§2, last line)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    # RoPE (§1): ratio-0 layers plain theta; others compress_rope_theta with YaRN
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # DeepSeekMoE (§4)
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2304
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    balance_loss_alpha: float = 1e-4
    # mHC (§3)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram (§5)
    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 14])
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    # None: taken from the token map handed to the model (identity map -> vocab_size)
    engram_compressed_vocab_size: int | None = 99092
    # vision (§6); vision_n_layers = 0 disables the vision path
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024  # positions of one image span, START/NEWLINE/END included
    vision_min_pixels: int = 544 * 544
    vision_max_wh_ratio: int | None = None
    vision_norm_eps: float = 1e-6
    # special ids
    bos_id: int = 0
    eos_id: int = 1
    pad_id: int = 2
    image_token_id: int = 129264
    # DSpark drafter (V41_SPEC §8b; public ModelArgs names): built only by the DSpark stage (model/dspark.py)
    n_mtp_layers: int = 3  # drafter blocks, stored as mtp.0 .. mtp.{n-1}
    dspark_block_size: int = 5  # draft positions per block: the last accepted token + block_size - 1 noise tokens
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [37, 38, 39])  # backbone layers whose
    # attention inputs (hc-mean) form the drafter's context
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # indexer KL auxiliary loss weight (not published; Megatron-LM's DSA form, §2)
    indexer_loss_weight: float = 1.0
    # initialisation (not published; see model/init.py)
    init_std: float = 0.006
    hc_fn_init_scale: float = 0.1
    hc_comb_init_logit: float = 1.0
    # runtime: queries processed per attention chunk (memory, not math)
    attn_chunk_size: int = 1024
    # runtime: None = the Triton kernels on CUDA, the plain-PyTorch references on CPU (model/kernels/);
    # False forces the references (debugging), True the kernels (CUDA, or CPU under TRITON_INTERPRET=1)
    use_triton: bool | None = None
    # quantisation-aware training in the formats of the public inference kernels and of the release's
    # weights (off by default)
    qat: QATConfig = field(default_factory=QATConfig)
    # FP8 GEMMs of the Linears the release stores in FP8 (off by default)
    fp8: FP8Config = field(default_factory=FP8Config)
    # Ablations (docs/training.md "What each component buys"): each switch replaces one V4.1 component by its
    # plain counterpart; the published model is csa2 / mhc / moe (Engram off is `engram_layer_ids: []`)
    attention: str = "csa2"  # "dense": every layer attends causally over the whole prefix, uncompressed
    residual: str = "mhc"  # "plain": one residual stream, x + F(norm(x)), no hc_* parameters
    ffn: str = "moe"  # "dense": one SwiGLU of (n_activated_experts + n_shared_experts) x moe_inter_dim

    ABLATIONS = {"attention": ("csa2", "dense"), "residual": ("mhc", "plain"), "ffn": ("moe", "dense")}

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"model.{name}={getattr(self, name)!r}: {why}")

        for name, values in self.ABLATIONS.items():
            if getattr(self, name) not in values:
                raise bad(name, f"must be one of {', '.join(values)} ({values[0]}: V4.1 as published)")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups",
                     "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
                     "n_routed_experts", "n_activated_experts", "moe_inter_dim", "hc_mult",
                     "hc_sinkhorn_iters", "attn_chunk_size"):
            if int(getattr(self, name)) <= 0:
                raise bad(name, "must be a positive integer")
        if self.rope_head_dim <= 0 or self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise bad("rope_head_dim", f"must be even, positive and <= head_dim={self.head_dim}")
        if self.index_head_dim < self.rope_head_dim:
            raise bad("index_head_dim", f"must be >= rope_head_dim={self.rope_head_dim} (RoPE on its tail)")
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise bad("o_groups", f"must divide n_heads*head_dim={self.n_heads * self.head_dim}")
        if self.n_heads % self.o_groups:
            raise bad("o_groups", f"must divide n_heads={self.n_heads} (a group owns whole heads)")
        if self.n_activated_experts > self.n_routed_experts:
            raise bad("n_activated_experts", f"cannot exceed n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts not in (0, 1):
            raise bad("n_shared_experts", "V4.1 has exactly one shared expert (0 disables it)")
        if self.hc_mult != 4:
            raise bad("hc_mult", "the single-pass mHC layout (24 mixes per site) is defined for 4 streams")
        if len(self.compress_ratios) not in (self.n_layers, self.n_layers + self.n_mtp_layers):
            raise bad("compress_ratios", f"needs one entry per layer: {len(self.compress_ratios)} given, "
                                         f"n_layers={self.n_layers} (optionally followed by one 0 per drafter "
                                         f"layer, n_mtp_layers={self.n_mtp_layers})")
        if any(self.compress_ratios[self.n_layers:]):
            raise bad("compress_ratios", f"the drafter layers' entries (after the first {self.n_layers}) must be 0: "
                                         f"the DSpark blocks attend over a sliding window only")
        if self.n_mtp_layers < 0:
            raise bad("n_mtp_layers", "must be >= 0")
        if any(r < 0 for r in self.compress_ratios):
            raise bad("compress_ratios", "entries must be 0 (SWA only), 1, or a pooling ratio m > 1")
        L = self.n_layers
        for name in ("kv_source_layers", "index_source_layers", "engram_layer_ids"):
            ids = list(getattr(self, name))
            if any(not 0 <= i < L for i in ids):
                raise bad(name, f"layer ids must lie in [0, {L - 1}]")
            if ids != sorted(set(ids)):
                raise bad(name, "layer ids must be strictly increasing, without repeats")
        for l in self.kv_source_layers:
            if self.compress_ratios[l] == 0:
                raise bad("kv_source_layers", f"layer {l} has compress ratio 0; a kv source must compress")
        for l in self.index_source_layers:
            if self.compress_ratios[l] == 0:
                raise bad("index_source_layers", f"layer {l} has compress ratio 0; it has no compressed KV to index")
        for l in range(L):
            r = self.compress_ratios[l]
            if r == 0:
                continue
            srcs = [s for s in self.kv_source_layers if s <= l]
            if not srcs:
                raise bad("kv_source_layers", f"layer {l} has compress ratio {r} but no kv source at or before it")
            if self.compress_ratios[srcs[-1]] != r:
                raise bad("compress_ratios",
                          f"layer {l} has ratio {r} but its kv source {srcs[-1]} has ratio "
                          f"{self.compress_ratios[srcs[-1]]}; a reader must share its source's ratio")
            isrcs = [s for s in self.index_source_layers if s <= l]
            if not isrcs:
                raise bad("index_source_layers", f"layer {l} compresses but has no index source at or before it")
            if isrcs[-1] < srcs[-1]:
                raise bad("index_source_layers", f"layer {l}: its kv source {srcs[-1]} is newer than its index "
                                                 f"source {isrcs[-1]}; every kv source must also be an index source")
        c = self.candidate_source_layer
        if c >= 0:
            if c >= L or c not in self.kv_source_layers:
                raise bad("candidate_source_layer", "must be a kv source layer (or -1 to disable)")
            if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
                raise bad("candidate_topk_blocks", "candidate_topk_blocks and candidate_block_size must be > 0")
            later = [l for l in self.kv_source_layers if l > c]
            if later and self.candidate_restriction:
                # the public inference code restricts every indexer after the candidate source to its pool,
                # Full layers included, and never clears the pool; flashtrain restricts the Reindex layers that
                # read the candidate source's KV. The two agree only without kv sources after the source.
                raise bad("candidate_source_layer",
                          f"kv source layer(s) {later} come after it: the public inference code would restrict "
                          f"their indexers (and every later one) to layer {c}'s candidate pool, which flashtrain "
                          f"does not, so the trained model would not serve as trained. Make the candidate source "
                          f"the last kv source (e.g. model.candidate_source_layer={self.kv_source_layers[-1]}), or "
                          f"set model.candidate_restriction=false")
        q = self.qat
        for on, name, width, block in ((q.indexer_fp4, "indexer_fp4", "index_head_dim", q.INDEXER_BLOCK),
                                       (q.compressed_kv_fp4, "compressed_kv_fp4", "head_dim", q.COMPRESSED_KV_BLOCK),
                                       (q.window_kv_fp8, "window_kv_fp8", "head_dim", q.WINDOW_KV_BLOCK)):
            if on and getattr(self, width) % block:
                raise ConfigError(f"model.qat.{name}=true needs model.{width} (={getattr(self, width)}) to be a "
                                  f"multiple of {block}, the format's channel block; widen it or switch "
                                  f"model.qat.{name} off")
        block = q.WEIGHT_BLOCK
        if q.experts_fp4:
            for width in ("dim", "moe_inter_dim"):
                if getattr(self, width) % block:
                    raise ConfigError(f"model.qat.experts_fp4=true needs model.{width} (={getattr(self, width)}) to be "
                                      f"a multiple of {block}: the routed experts' FP4 format scales blocks of {block} "
                                      f"inputs; widen it or switch model.qat.experts_fp4 off")
        if q.weights_fp8 and self.engram_layer_ids and self.engram_head_dim % block:
            raise ConfigError(f"model.qat.weights_fp8=true needs model.engram_head_dim (={self.engram_head_dim}) to "
                              f"be a multiple of {block}: the Engram tables' FP8 format scales blocks of {block} "
                              f"channels of a row; widen it or switch model.qat.weights_fp8 off")
        if self.engram_layer_ids:
            if self.engram_max_ngram_size < 2:
                raise bad("engram_max_ngram_size", "n-gram orders start at 2, so it must be >= 2")
            for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size"):
                if getattr(self, name) <= 0:
                    raise bad(name, "must be positive when engram_layer_ids is non-empty")
            if not 0 <= self.engram_pad_id < self.vocab_size:
                raise bad("engram_pad_id", f"must be a token id in [0, {self.vocab_size})")
            if self.engram_compressed_vocab_size is not None and self.engram_compressed_vocab_size <= 0:
                raise bad("engram_compressed_vocab_size", "must be positive, or null to take it from the token map")
        if self.vision_n_layers < 0:
            raise bad("vision_n_layers", "must be >= 0 (0 disables the vision path)")
        if self.vision_n_layers:
            for name in ("vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
                         "vision_downsample_ratio", "vision_min_pixels"):
                if getattr(self, name) <= 0:
                    raise bad(name, "must be positive when vision_n_layers > 0")
            if self.vision_dim % self.vision_n_heads or (self.vision_dim // self.vision_n_heads) % 4:
                raise bad("vision_n_heads", f"vision_dim={self.vision_dim} / vision_n_heads must be a head dim "
                                            f"divisible by 4 (2D RoPE turns a quarter of each head per axis)")
            if self.vision_max_n_token < 4:
                raise bad("vision_max_n_token", "an image span needs at least 4 positions (START, 1 IMAGE, "
                                                "NEWLINE, END)")
        for name in ("bos_id", "eos_id", "pad_id", "image_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise bad(name, f"must be a token id in [0, {self.vocab_size})")
        if self.use_triton not in (None, True, False):
            raise bad("use_triton", "must be null (kernels on CUDA, references on CPU), true or false")
        if self.norm_eps <= 0 or self.hc_eps <= 0:
            raise bad("norm_eps", "norm_eps and hc_eps must be > 0")

    @property
    def backbone_compress_ratios(self) -> list[int]:
        """The backbone layers' entries of `compress_ratios` (without the drafter's trailing zeros); all 0
        (no compression: every layer attends by its window) with `attention: dense`."""
        if self.attention == "dense":
            return [0] * self.n_layers
        return list(self.compress_ratios[:self.n_layers])

    @property
    def n_streams(self) -> int:
        """Residual streams per token: `hc_mult` under mHC, 1 with `residual: plain`."""
        return self.hc_mult if self.residual == "mhc" else 1

    @property
    def dense_ffn_dim(self) -> int:
        """The SwiGLU width of `ffn: dense`: the MoE's activated width, routed and shared."""
        return (self.n_activated_experts + self.n_shared_experts) * self.moe_inter_dim

    @property
    def ablated(self) -> list[str]:
        """The ablation switches set away from V4.1, as `name=value` (empty for the published model)."""
        return [f"{name}={getattr(self, name)}" for name, values in self.ABLATIONS.items()
                if getattr(self, name) != values[0]]

    def validate_drafter(self) -> None:
        """The DSpark drafter's fields (V41_SPEC §8b), checked where the drafter is built (the DSpark stage)."""
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"model.{name}={getattr(self, name)!r}: {why}")

        self.validate()
        if self.n_mtp_layers < 1:
            raise bad("n_mtp_layers", "the DSpark stage needs at least one drafter block")
        if self.dspark_block_size < 1:
            raise bad("dspark_block_size", "must be >= 1 (the draft positions per block)")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size or self.dspark_noise_token_id in (
                self.bos_id, self.eos_id, self.pad_id, self.image_token_id):
            raise bad("dspark_noise_token_id", f"must be a token id in [0, {self.vocab_size}) that the data never "
                                               f"holds (not BOS/EOS/PAD or the image token): a reserved id")
        ids = list(self.dspark_target_layer_ids)
        if not ids or ids != sorted(set(ids)) or not all(0 <= i < self.n_layers for i in ids):
            raise bad("dspark_target_layer_ids", f"needs strictly increasing backbone layer ids in "
                                                 f"[0, {self.n_layers - 1}] (with a short layer plan, set them to "
                                                 f"its last layers)")
        if self.dspark_markov_rank < 1:
            raise bad("dspark_markov_rank", "must be >= 1")
        if self.dspark_n_routed_experts < 1 or not 1 <= self.dspark_n_activated_experts <= self.dspark_n_routed_experts:
            raise bad("dspark_n_activated_experts", f"needs 1 <= dspark_n_activated_experts <= dspark_n_routed_experts"
                                                    f"={self.dspark_n_routed_experts}")
