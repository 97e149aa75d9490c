"""The released V4.1-Flash checkpoint layout: which tensor is stored under which name, in which format.

A flashtrain state dict and the public inference code's (`inference/model.py`) share their names
(DESIGN.md "The model"), with one structural difference: flashtrain stacks the routed experts of a layer
into `layers.{i}.ffn.experts.w1` [E, out, in], the release stores one tensor per expert,
`layers.{i}.ffn.experts.{j}.w1.weight`. The storage format of each tensor follows the public code's
parameter dtypes (`ModelArgs.dtype = "fp8"`, `expert_dtype = "fp4"`):

| format     | tensors                                                          | stored as |
|------------|------------------------------------------------------------------|-----------|
| `fp8`      | the default-dtype `Linear`s: attn `wq_a`, `wq_b`, `wkv`, `wo_b`; indexer `wq_b`; shared expert `w1`-`w3`; Engram `wkv` | `.weight` F8_E4M3 [out, in] + `.scale` F8_E8M0 [ceil(out/32), ceil(in/32)]: one power-of-two scale per 32 x 32 tile |
| `fp4`      | routed experts `w1`, `w2`, `w3`                                  | `.weight` I8 [out, in/2] (two E2M1 codes per byte, the even element in the low nibble) + `.scale` F8_E8M0 [out, in/32] |
| `fp8_rows` | the Engram tables `engram.embed.weight`                          | `.weight` F8_E4M3 [rows, head_dim] + `engram.embed.scale` F8_E8M0 [rows, head_dim/32] |
| `fp32`     | `attn_sink`, `ffn.gate.bias`, `ffn.gate.bias_vl`, the mHC `hc_{attn,ffn}_{fn,base,scale}` (fp32 parameters there) | F32 |
| `bf16`     | everything else: embeddings, head, norms, `wo_a`, the compressor, indexer `wk` / `weights_proj`, the gate weight, Engram `q_weight` / `k_weight`, the ViT and the aligner, the DSpark Markov head (`markov_head.embed` / `head`) and confidence head (`confidence_head.proj`) | BF16 |

The DSpark drafter (`mtp.{i}.*`, model/dspark.py) is stored like a backbone block (the same rows apply to
`mtp.{i}.` as to `layers.{i}.`: FP8 attention projections and shared expert, FP4 routed experts, FP32 sink,
gate biases and mHC) plus `mtp.0.main_proj` in FP8 and `mtp.0.main_norm`, `mtp.{n-1}.norm` and the Markov and
confidence heads in BF16, as the public code's parameter dtypes say (`DSparkBlock`, `DSparkMarkovHead`,
`DSparkConfidenceHead`: "proj in the checkpoint is stored in bf16"). The embedding and head the drafter shares
are stored once, as `embed.weight` / `head.weight`: the public blocks hold the backbone's modules, not copies
(docs/official_formats.md "The drafter's embedding and head"). A release with a drafter says so in
`config.json` (`n_mtp_layers`, `dspark_block_size` > 0, the other `dspark_*` fields, `compress_ratios` with one 0
per drafter layer after the backbone's); one without has `n_mtp_layers` 0 and `dspark_block_size` 0.

`--dtype bf16` (the unquantised variant) stores the `fp8` / `fp4` / `fp8_rows` tensors in BF16 without
scales, names unchanged (experts still one tensor each); its `config.json` says `"dtype": "bf16"`,
`"expert_dtype": null`. The public engram.py reads its tables as FP8 whatever `dtype` says, so only the
default variant loads there unchanged.

`config.json` holds the public `ModelArgs` fields (the flat file `generate.py --config` reads), derived
from `ModelConfig` by `official_config`.
"""  # noqa: E501 - markdown table rows cannot be wrapped

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from flashtrain.config.errors import ConfigError, DataError
from flashtrain.model.config import ModelConfig
from flashtrain.model.param_kinds import ParamKind

BLOCK = 32  # the release's fp8 tile / fp4 and Engram scale block (inference/model.py: fp8_block_size, fp4_block_size)

_FP8 = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                  r"|engram\.wkv|main_proj)\.weight$")
_FP32 = re.compile(r"^(layers|mtp)\.\d+\.(attn\.attn_sink|ffn\.gate\.bias|ffn\.gate\.bias_vl"
                   r"|hc_(attn|ffn)_(fn|base|scale))$")


@dataclass(frozen=True)
class Stored:
    """One tensor as the file holds it: name, safetensors dtype string, shape."""
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class OfficialTensor:
    """A released tensor: its logical (dequantised) shape, its format, and where it lives in flashtrain
    (`source`, and `expert` = the row of the stacked expert tensor, else None)."""
    name: str
    shape: tuple[int, ...]
    fmt: str
    source: str
    expert: int | None = None

    @property
    def scale_name(self) -> str:
        return self.name[: -len(".weight")] + ".scale"

    def stored(self) -> list[Stored]:
        """The data tensor and, for the quantised formats, its scale tensor."""
        out, inn = (self.shape + (0,))[:2]
        if self.fmt == "fp8":
            return [Stored(self.name, "F8_E4M3", self.shape),
                    Stored(self.scale_name, "F8_E8M0", (-(-out // BLOCK), -(-inn // BLOCK)))]
        if self.fmt == "fp4":
            return [Stored(self.name, "I8", (out, inn // 2)), Stored(self.scale_name, "F8_E8M0", (out, inn // BLOCK))]
        if self.fmt == "fp8_rows":
            return [Stored(self.name, "F8_E4M3", self.shape), Stored(self.scale_name, "F8_E8M0", (out, inn // BLOCK))]
        return [Stored(self.name, "F32" if self.fmt == "fp32" else "BF16", self.shape)]


def storage_format(key: str, kind: ParamKind | None, quantised: bool) -> str:
    """The release's format of flashtrain state-dict tensor `key` of `kind` (model/param_kinds.py; None for a
    buffer) (`quantised`: the default FP8/FP4 variant)."""
    if _FP32.match(key):
        return "fp32"
    if not quantised:
        return "bf16"
    if _FP8.match(key):
        return "fp8"
    if kind is ParamKind.ROUTED_EXPERT:
        return "fp4"
    if kind is ParamKind.ENGRAM_TABLE:
        return "fp8_rows"
    return "bf16"


def official_tensors(shapes: dict[str, tuple[int, ...]], kinds: dict[str, ParamKind],
                     quantised: bool) -> list[OfficialTensor]:
    """The released tensors for a flashtrain state dict with these shapes (name -> shape, in state-dict
    order) and parameter kinds (model/param_kinds.py); the stacked experts become one tensor per expert."""
    out = []
    for key, shape in shapes.items():
        fmt = storage_format(key, kinds.get(key), quantised)
        if kinds.get(key) is ParamKind.ROUTED_EXPERT:
            prefix, w = key.rsplit(".", 1)
            out += [OfficialTensor(f"{prefix}.{j}.{w}.weight", tuple(shape[1:]), fmt, key, j) for j in range(shape[0])]
        else:
            out.append(OfficialTensor(key, tuple(shape), fmt, key))
    return out


def check_quantisable(tensors: list[OfficialTensor]) -> None:
    """The FP4 and Engram formats scale blocks of 32 along the input dimension (and pack two values per
    byte): refuse widths they cannot hold, naming the tensor and the fix."""
    for t in tensors:
        if t.fmt in ("fp4", "fp8_rows") and t.shape[-1] % BLOCK:
            raise ConfigError(f"{t.name} has {t.shape[-1]} input channels, not a multiple of {BLOCK}: the release's "
                             f"{'FP4 expert' if t.fmt == 'fp4' else 'FP8 Engram'} format scales blocks of {BLOCK} "
                             f"channels. Export with --dtype bf16, or use widths that are multiples of {BLOCK}")


# ---------------------------------------------------------------------------------------------- config.json
_SAME_NAME = ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts", "n_shared_experts",
              "n_activated_experts", "route_scale", "swiglu_limit", "q_lora_rank", "head_dim", "rope_head_dim",
              "norm_eps", "o_groups", "o_lora_rank", "window_size", "compress_ratios", "kv_source_layers",
              "index_source_layers", "compress_rope_theta", "original_seq_len", "rope_theta", "rope_factor",
              "beta_fast", "beta_slow", "index_n_heads", "index_head_dim", "index_topk", "candidate_topk_blocks",
              "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids",
              "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_pad_id",
              "engram_compressed_vocab_size", "vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim",
              "vision_patch_size", "vision_rope_theta", "vision_downsample_ratio", "vision_max_n_token",
              "vision_min_pixels", "vision_max_wh_ratio", "image_token_id")
# fixed by the architecture flashtrain implements (V41_SPEC §1, §4): the public ModelArgs could say otherwise
ARCHITECTURE = {"score_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True}
FORMAT_FIELDS = ("dtype", "expert_dtype")
# the DSpark drafter's fields (public ModelArgs names): written when the release holds the drafter
DRAFTER_CONFIG = ("n_mtp_layers", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
                  "dspark_markov_rank", "dspark_n_routed_experts", "dspark_n_activated_experts")


def has_drafter_config(found: dict) -> bool:
    """Does a config.json describe a drafter (the public Transformer builds `mtp` iff dspark_block_size)?"""
    return bool(found.get("dspark_block_size")) and bool(found.get("n_mtp_layers"))


def official_config(cfg: ModelConfig, engram_rows: list[int], quantised: bool = True,
                    compressed_vocab: int | None = None, drafter: bool = False) -> dict:
    """The public `ModelArgs` fields for this model. `engram_rows`: each Engram table's row count
    (`engram_num_embeddings`); `compressed_vocab` fills a null `engram_compressed_vocab_size`. Without the
    candidate restriction the public code gets no candidate source (`candidate_source_layer = -1`): its
    rule restricts every indexer after a source. `drafter`: the release holds the DSpark drafter (its
    fields, and one 0 per drafter layer in `compress_ratios`); else `n_mtp_layers` and `dspark_block_size` 0."""
    out = {k: getattr(cfg, k) for k in _SAME_NAME}
    out = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in out.items()}
    out["compress_ratios"] = cfg.backbone_compress_ratios
    if out["engram_compressed_vocab_size"] is None:
        out["engram_compressed_vocab_size"] = compressed_vocab
    out["candidate_source_layer"] = cfg.candidate_source_layer if cfg.candidate_restriction else -1
    out["engram_num_embeddings"] = list(engram_rows)
    out.update(ARCHITECTURE)
    out["dtype"], out["expert_dtype"] = ("fp8", "fp4") if quantised else ("bf16", None)
    if drafter:
        out.update({k: list(getattr(cfg, k)) if k == "dspark_target_layer_ids" else getattr(cfg, k)
                    for k in DRAFTER_CONFIG})
        out["compress_ratios"] = cfg.backbone_compress_ratios + [0] * cfg.n_mtp_layers
    else:
        out["n_mtp_layers"], out["dspark_block_size"] = 0, 0
    return out


def config_differences(found: dict, expected: dict) -> list[str]:
    """'field: config.json has X, the model config Y' for every field of `expected` (but the storage
    format fields) that config.json lacks or holds another value for. Numbers compare by value (JSON
    has no int / float distinction); a null compressed vocabulary in `expected` is not compared; the
    drafter layers (`n_mtp_layers`, their `compress_ratios` entries after the backbone's) are not part of
    the model trained here, and their tensors (`mtp.*`) are listed as unused on import -- unless `expected` has
    a drafter (`official_config(..., drafter=True)`): then its fields are compared too."""
    out = []
    n_layers = expected["n_layers"]
    drafter = has_drafter_config(expected)
    for k, want in expected.items():
        if k in FORMAT_FIELDS or (k == "engram_compressed_vocab_size" and want is None):
            continue
        if k in DRAFTER_CONFIG and not drafter:
            continue
        if k not in found:
            out.append(f"{k}: missing from config.json (the model config has {want!r})")
            continue
        got = found[k]
        if k == "compress_ratios" and isinstance(got, list) and not drafter:
            got = got[:n_layers]  # the release lists its drafter (MTP) layers' ratios after the backbone's
        same = (list(got) == list(want)) if isinstance(want, list) and isinstance(got, (list, tuple)) else got == want
        if not same:
            out.append(f"{k}: config.json has {got!r}, the model config {want!r}")
    return out


def quantised_from_config(found: dict) -> bool:
    """Which variant a release is (its `dtype`/`expert_dtype`): FP8 + FP4 experts, or BF16."""
    dtype, expert = found.get("dtype", "fp8"), found.get("expert_dtype", "fp4" if found.get("dtype", "fp8") == "fp8"
                                                                  else None)
    if (dtype, expert) == ("fp8", "fp4"):
        return True
    if (dtype, expert) == ("bf16", None):
        return False
    raise DataError(f"config.json has dtype={dtype!r}, expert_dtype={expert!r}: flashtrain reads the release's FP8 "
                     f"weights with FP4 experts (\"fp8\", \"fp4\") or the BF16 variant (\"bf16\", null)")


def normalise_name(name: str) -> str:
    """Accept the spellings of the Hugging Face layout as the public convert.py does: a `model.` prefix,
    `self_attn` / `mlp` in the text layers, `weight_scale_inv` for `scale`, `e_score_correction_bias` for
    the gate's bias."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers."):  # the ViT's own blocks keep `mlp` / `attn`
        name = name.replace(".self_attn.", ".attn.").replace(".mlp.", ".ffn.")
    name = name.replace(".weight_scale_inv", ".scale").replace(".e_score_correction_bias", ".bias")
    return name


TORCH_DTYPE = {"BF16": torch.bfloat16, "F32": torch.float32, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
               "F8_E8M0": torch.float8_e8m0fnu}
