"""Model FLOPs per token, device peak FLOP/s and MFU: the single source for the trainer's metrics
(`flops_per_token`, `mfu` in every record) and `launch/bench_model.py`.

Model FLOPs per token (averaged over positions 0..S-1 of one sequence of S tokens, S = `data.seq_len` in
the trainer, `--seq` in the benchmark):

    flops/token = 6 * P_mm + F_attn + F_index

- P_mm, activated matmul parameters per token: every dense weight a text token multiplies with --
  attention (wq_a, wq_b, wkv, wo_a, wo_b; wo_a is block-diagonal over o_groups but each of its weights
  is still used once per token), the compressor's wkv / wgate (projected per token before pooling),
  the indexer's wq_b and weights_proj, its wk divided by the compress ratio (it runs on the S / m
  compressed entries), the mHC mixing matrices hc_{attn,ffn}_fn, the MoE gate, the shared expert,
  `n_activated_experts` of the routed experts' w1 / w2 / w3 (only the experts a token activates), Engram's
  wkv, and the LM head (with `model.ffn: dense`, the MoE ablation, its SwiGLU instead: part `dense_ffn`).
  Not counted: the token embedding and the Engram tables (lookups), norms, sinks and other element-wise
  parameters, and the vision tower (it runs per image; the count is per text token). 6 = 2 (multiply-add)
  x 3 (forward, input gradient, weight gradient); the indexer's wq_b /
  weights_proj see detached inputs (no input gradient: 4 would be exact), kept at 6 for simplicity.
- F_attn, the attention core, per layer, per query t, per head: 2 * 2 * head_dim * (w_t + c_t) for
  QK^T and PV, times 3 for forward + backward, with w_t = min(window_size, t + 1) window slots (the
  causal prefix at short sequences; t + 1 under `model.attention: dense`) and, for layers with a
  compress ratio m, c_t = min(index_topk, n_t, pool) selected compressed entries, n_t = (t + 1) // m
  visible ones (pool = candidate_topk_blocks * candidate_block_size when the layer's index source scores
  inside the candidate pool). SWA layers (ratio 0) have c_t = 0. The backward's recomputation of the
  logits (the lean path) is not counted.
- F_index, per layer with its own indexer (`LayerRole.has_indexer`: FULL and REINDEX), per query:
  2 * index_n_heads * index_head_dim * n_t for scoring every visible entry (forward only: no gradient
  flows through the selection; the candidate restriction is ignored, the reference scores every
  visible entry), plus 4 * index_n_heads * index_head_dim * c_t for the backward of the KL loss's logits
  on the selected entries (dq and dk). REUSE layers read their source's top-k and score nothing.
- Not counted: the compressor's pooling (a softmax-weighted sum over each entry's m tokens: O(head_dim)
  per token, element-wise), the mHC Sinkhorn / collapse / expand, softmaxes and the other element-wise
  work, and activation recomputation (`train.recompute`): these are model FLOPs, so the MFU does not
  rise when a run recomputes.

By component (`flop_components`, `flops_by_component`; they sum to flops per token): `dense_matmuls` (6 x every
P_mm part but the routed experts and the indexer: attention, compressor, mHC, gate, shared expert, Engram, LM
head), `routed_experts` (6 x the activated experts' share), `attention_core` (F_attn) and `indexer` (6 x its
wq_b / weights_proj / wk share of P_mm, plus F_index).

Checked against torch's FLOP counter (tests/test_flop_count.py, `python -m pytest -q tests/test_flop_count.py`):
forward + backward under `torch.utils.flop_counter.FlopCounterMode`, recomputation off, the CPU reference path
(`model.use_triton=false`: the counter has no formula for `torch._grouped_mm`, so it would miss the grouped
experts), every counted matmul attributed to its component by where the model computed it. The counter sees
what that path computes, which differs from the model FLOPs above as follows; with these differences added
to the formula, every component matches the count to float64 rounding (relative 1e-9):
- attention core, masked band keys: the reference scores a chunk of `attn_chunk_size` (C) queries against
  its whole key band [t0 - W + 1, t1) and masks the keys outside each query's window: up to C + W - 1 keys
  per query where the formula has w_t <= W (V41_SPEC §2).
- attention core, empty top-k slots: all k = min(index_topk, S // m) columns are computed, also where a
  query has fewer than k entries to select (c_t < k while (t + 1) // m < k), and then masked.
- attention core, recomputed logits: the lean backward recomputes QK^T (FlashAttention-style): 14, not 12,
  FLOPs per (query, slot, head channel).
- indexer, detached inputs: wq_b and weights_proj read detached inputs (V41_SPEC §2: only the KL loss
  trains the indexer), so their backward has no input gradient: 4 per weight, where the formula keeps 6.
- indexer, scoring: the reference scores all S // m entries per query and masks the invisible ones; the
  formula counts the n_t = (t + 1) // m visible ones (about half, averaged over the sequence).
- indexer, KL logits: the lean function computes the selected entries' logits again in forward (with
  gradient; the selection ran without) and recomputes them in backward: 8 per (query, slot, index
  channel) on all k columns, where the formula has 4 on the c_t selected ones.
- dense matmuls, mHC B mixing: X'_j = sum_i B_ij X_i (V41_SPEC §3) is n^2 D multiply-adds per token and
  site, a batched matmul to the counter (6 n^2 D with its backward) and element-wise work to the formula.
- not counted by either: element-wise work (norms, RoPE, softmaxes, Sinkhorn, SwiGLU, the pooling) and the
  embedding and Engram lookups; the counter counts matmul-type ops only.
Measured, per token (counted = formula + the differences, named as in the list above):
                           formula     counted  differences
    flash_tiny, EIGHT_LAYERS, B 2, S 64, C 32
      dense_matmuls       1,769,472   1,867,776  mHC mixing +98,304
      routed_experts        589,824     589,824  none
      attention_core        120,336     326,144  band +155,904, empty +3,312, recompute +46,592
      indexer                33,360      34,816  detached -6,912, scoring +5,056, KL +3,072 +240
      total               2,512,992   2,818,560  1.12x
    flash_small widths, FOUR_LAYERS, B 1, S 256
      dense_matmuls      36,274,176  36,470,784  mHC mixing +196,608
      routed_experts      4,718,592   4,718,592  none
      attention_core      1,477,632   4,128,768  band +1,963,008, empty +98,304, recompute +589,824
      indexer               151,552     174,080  detached -34,816, scoring +16,384, KL +32,768 +8,192
      total              42,621,952  45,492,224  1.07x
(flash_tiny: `model.attn_chunk_size=32`; both: `model.use_triton=false model.vision_n_layers=0
model.hc_sinkhorn_iters=1`, execution- or text-only overrides.) The GPU path's Triton kernels are invisible to
the counter; the figure the trainer reports is the model FLOPs above on every device.

Comparing MFU across frameworks. The convention is the usual one: 6 FLOPs per multiply-add with a weight
(forward, input gradient, weight gradient), 12 per attended (query, key) pair and head channel (PaLM's
6N + 12 L H Q T with the attended keys in place of T), over the bf16 dense peak, recomputation not counted.
Megatron-Bridge's DeepSeek-V4 count (src/megatron/bridge/training/utils/flop_utils.py,
`experimental_attention_variant == "dsv4_hybrid"`, as read at commit 0494433b) is, per token, 6 x the attention
projections (wq_a, wq_b, wkv, the grouped wo_a, wo_b; it also counts the q / kv norm weights), the
compressors, the indexer's projections, the top-k routed and shared experts, the LM head (padded vocabulary)
and V4's MTP layers, plus 12 x heads x head_dim x (window + mean selected entries) per layer, plus
6 x index_heads x index_head_dim x S / 4 per indexer layer. What differs from the figure here:
- not counted there: the MoE gate, the mHC matrices hc_{attn,ffn}_fn, Engram's wkv (V4 has no Engram): 2.4%
  of flops per token at exp=flash (seq 65,536: 108.2 GFLOP, of which gate 0.47, mHC 0.24, Engram 1.89);
- the window: every query counts the whole window there, min(window, t + 1) here (equal past W tokens);
- the indexer's scoring: there every compressed entry of the sequence, forward and backward (6); here the
  visible ones, forward only (2: no gradient flows through the selection), plus the KL backward (4) on the
  selected ones -- that rule (with S / m for S / 4) on exp=flash's 8 indexers at seq 65,536 gives 10.5
  GFLOP/token where this formula has 1.8;
- the compress ratios: it accepts 0, 4 and 128 (V4's CSA / HCA) and rejects V4.1-Flash's 1 and 2, so it does
  not evaluate this model as it stands; V4.1's index keys come from `wk` on the compressed latent (S / m
  entries), V4's from an indexer compressor on every token;
- the drafter: V4's MTP layers are in its pre-training count; V4.1's DSpark drafter is a stage of its own here
  (`dspark_flops_per_token`).
NeMo 2's `nemo/utils/flops_formulas.py` (as read at commit 034b17b3) has no V4 entry; its `deepseekv3` counts
6 x the MLA projections and the shared + top-k routed experts per token plus 6 x (qk + v head dims) x S^2 per
layer and sequence (no causal halving), without the LM head or the router. For an "activated parameters"
comparison: `dense_matmuls` + `routed_experts` = 6 x the activated matmul parameters per token (embedding
excluded, LM head included), and `attention_core` + `indexer` is the attention.

The DSpark stage (train/dspark/stage.py; `dspark_flops_per_token`), per token of the data (one anchor): the frozen
backbone's forward (a third of the above), plus, 6x (forward and backward), the drafter's matmul parameters
once per anchor for `main_proj` and K = `dspark_block_size` times for the rest (each draft position runs the
drafter blocks, the shared head, the Markov head's projection and the confidence head; the drafter's
`n_activated_experts` of its routed experts), plus its attention core on every draft query over its
min(window, t + 1) context slots and the K block slots, per layer. Not counted: the embedding and Markov
lookups and the context keys' projection per anchor (small next to the K draft positions').

MFU = flops_per_token * tokens_per_s / (peak_flops * world), with tokens_per_s the global batch's
tokens (padding positions included: every position is computed) over the step's wall time, and
peak_flops the per-device peak (`peak_flops`): every rank of the run is one device.

Peak per device (`train.peak_tflops.{cuda,cpu}`; null = automatic):
- CUDA: the bf16 dense (no sparsity) tensor-core peak of the device, looked up by a substring of
  `torch.cuda.get_device_name()` in PEAK_TFLOPS; a GPU not in the table has no MFU (null) until
  `train.peak_tflops.cuda` is set.
- CPU: measured once per machine and cached (`cached_cpu_peak`): the best FLOP/s of a 2048^3 fp32 matmul
  at the process's torch thread count (`measured_cpu_peak`, up to 10 runs in 2 s), kept in
  `$FLASHTRAIN_CACHE/peak_flops.json` (default `~/.cache/flashtrain/`, beside the default corpus) under the
  machine's name, CPU model and thread count, so every later start -- and its MFU -- uses the same peak
  whatever else runs then; deleting the file measures again. `train.peak_tflops.cpu` fixes it instead.
The peak and where it comes from are logged once at start-up (`peak_flops`).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashtrain.config.errors import ConfigError
from flashtrain.config.typed import typed_config
from flashtrain.model.config import ModelConfig
from flashtrain.model.dspark import DSpark
from flashtrain.model.inspect import VISION_ROOTS, inspect_model
from flashtrain.model.layer_plan import layer_plan
from flashtrain.parallel.construct import model_template

log = logging.getLogger(__name__)

# bf16 dense (no sparsity) tensor-core peak TFLOP/s; the first substring found in the device name wins,
# so the more specific names come first ("H200" before "H20", "GB200" before "B200", "L40S" before "L4")
PEAK_TFLOPS: list[tuple[str, float]] = [
    ("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("H800", 989.0), ("H20", 148.0), ("A100", 312.0), ("A800", 312.0), ("GB200", 2500.0),
    ("B200", 2250.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("RTX 4090", 165.0),
]


# --------------------------------------------------------------------------------------------- flops
# the components of flops per token (`flop_components`), as tests/test_flop_count.py counts them
COMPONENTS = ("dense_matmuls", "routed_experts", "attention_core", "indexer")


def matmul_params(model, cfg: ModelConfig) -> dict[str, float]:
    """Activated matmul parameters per text token by part (see the module docstring); `model` may be on
    the meta device. Unknown 2-D parameters are counted under `other` (and should be classified here)."""
    k_over_e = cfg.n_activated_experts / cfg.n_routed_experts
    parts = dict.fromkeys(("attention", "compressor", "indexer", "mhc", "gate", "shared_expert",
                           "routed_experts", "dense_ffn", "engram", "head", "other"), 0.0)
    for name, p in model.named_parameters():
        root = name.split(".")[0]
        if root in VISION_ROOTS or root == "embed":
            continue
        if name == "head.weight":
            parts["head"] += p.numel()
            continue
        if root != "layers":
            if p.dim() >= 2:
                parts["other"] += p.numel()
            continue
        layer = int(name.split(".")[1])
        rest = name.split(".", 2)[2]
        if rest.startswith("engram."):
            if rest == "engram.wkv.weight":
                parts["engram"] += p.numel()
            continue  # the table (a lookup), q_weight / k_weight (element-wise)
        if p.dim() < 2:
            continue  # norms, sinks, mHC base / scale, biases
        if rest.startswith("ffn.experts."):
            parts["routed_experts"] += p.numel() * k_over_e
        elif rest == "ffn.gate.weight":
            parts["gate"] += p.numel()
        elif rest.startswith("ffn.shared_experts."):
            parts["shared_expert"] += p.numel()
        elif rest.startswith(("ffn.w1.", "ffn.w2.", "ffn.w3.")):  # `ffn: dense` (the MoE ablation)
            parts["dense_ffn"] += p.numel()
        elif rest.startswith("attn.indexer.wk."):
            parts["indexer"] += p.numel() / cfg.compress_ratios[layer]  # on the S / m compressed entries
        elif rest.startswith("attn.indexer."):
            parts["indexer"] += p.numel()
        elif rest.startswith("attn.compressor."):
            parts["compressor"] += p.numel()
        elif rest.startswith("attn."):
            parts["attention"] += p.numel()
        elif rest in ("hc_attn_fn", "hc_ffn_fn"):
            parts["mhc"] += p.numel()
        else:
            parts["other"] += p.numel()
    return parts


def attention_flops(cfg: ModelConfig, seq: int) -> dict[str, float]:
    """Attention-core and indexer FLOPs per token (forward + backward as in the module docstring),
    averaged over positions 0..seq-1."""
    t = torch.arange(seq, dtype=torch.float64)
    window = t + 1 if cfg.attention == "dense" else (t + 1).clamp(max=cfg.window_size)
    plan = layer_plan(cfg)
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    core = index = 0.0
    for role in plan:
        per_query = 2 * 2 * cfg.head_dim * cfg.n_heads * window
        if role.compress_ratio:
            visible = torch.div(t + 1, role.compress_ratio, rounding_mode="floor")
            selected = visible.clamp(max=cfg.index_topk)
            if role.index_source is not None and plan[role.index_source].uses_candidates:
                selected = selected.clamp(max=pool)
            per_query = per_query + 2 * 2 * cfg.head_dim * cfg.n_heads * selected
            if role.has_indexer:
                hd = cfg.index_n_heads * cfg.index_head_dim
                index += float((2 * hd * visible + 4 * hd * selected).mean())
        core += 3 * float(per_query.mean())
    return {"attention_core": core, "indexer_scoring": index}


def flop_components(parts: dict[str, float], attn: dict[str, float]) -> dict[str, float]:
    """The module docstring's terms regrouped by component (`COMPONENTS`), summing to flops per token:
    6 x the dense matmul parameters (every part but the routed experts and the indexer), 6 x the
    `n_activated_experts` routed experts' share, the attention core, and the indexer (6 x its projections
    plus its scoring and KL backward). `parts`: `matmul_params`; `attn`: `attention_flops`."""
    dense = sum(v for k, v in parts.items() if k not in ("routed_experts", "indexer"))
    return {"dense_matmuls": 6 * dense, "routed_experts": 6 * parts["routed_experts"],
            "attention_core": attn["attention_core"], "indexer": 6 * parts["indexer"] + attn["indexer_scoring"]}


def flop_accounting(cfg: ModelConfig, seq: int, template=None) -> dict:
    """flops per token at `seq` with its parts, and the parameter counts they come from. `template`: the
    whole model (any device, meta is enough; not a rank's pruned model); built on the meta device if None."""
    if template is None:
        template = model_template(cfg)  # meta device: shapes only
    parts = matmul_params(template, cfg)
    p_mm = sum(parts.values())
    attn = attention_flops(cfg, seq)
    components = flop_components(parts, attn)
    info = inspect_model(template, cfg)
    return {
        "seq": seq,
        "flops_per_token": sum(components.values()),
        "flops_components": components,
        "flops_breakdown": {"matmul_params_x6": 6 * p_mm, **attn},
        "matmul_params_per_token": p_mm,
        "matmul_params_by_part": parts,
        "params_total": info["params_total"],
        "params_activated_per_token_inspect": info["params_activated_per_token"],  # model/inspect.py's count
    }


@functools.lru_cache(maxsize=8)
def _flop_components(cfg_json: str, seq: int) -> tuple[tuple[str, float], ...]:
    components = flop_accounting(typed_config(ModelConfig, json.loads(cfg_json), "model"), seq)["flops_components"]
    return tuple(components.items())


def _flops_per_token(cfg_json: str, seq: int) -> float:
    return sum(v for _, v in _flop_components(cfg_json, seq))


def flops_by_component(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Model FLOPs per token at `seq_len` by component (`flop_components`, the module docstring); their sum
    is `flops_per_token`. Cached as `flops_per_token`."""
    return dict(_flop_components(json.dumps(asdict(cfg), sort_keys=True), int(seq_len)))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs (forward + backward) per token at sequence length `seq_len` (the module docstring): the
    sum of `flops_by_component`; cached per (config, seq_len): the first call builds the model's meta-device
    template (~0.1-0.2 s)."""
    return _flops_per_token(json.dumps(asdict(cfg), sort_keys=True), int(seq_len))


def dspark_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The DSpark stage's model FLOPs per token at `seq_len` (the module docstring); cached as `flops_per_token`."""
    return _dspark_flops_per_token(json.dumps(asdict(cfg), sort_keys=True), int(seq_len))


@functools.lru_cache(maxsize=8)
def _dspark_flops_per_token(cfg_json: str, seq: int) -> float:
    cfg = typed_config(ModelConfig, json.loads(cfg_json), "model")
    with torch.device("meta"):
        drafter = DSpark(cfg, init=False)
    k_over_e = cfg.dspark_n_activated_experts / cfg.dspark_n_routed_experts
    per_anchor, per_draft = 0.0, float(cfg.vocab_size * cfg.dim)  # the shared head on every draft position
    for name, p in drafter.named_parameters():
        rest = name.split(".", 2)[2]
        if p.dim() < 2 or rest.startswith("markov_head.embed."):
            continue  # element-wise, or a lookup
        if rest == "main_proj.weight":
            per_anchor += p.numel()
        else:
            per_draft += p.numel() * (k_over_e if rest.startswith("ffn.experts.") else 1.0)
    K = cfg.dspark_block_size
    window = (torch.arange(seq, dtype=torch.float64) + 1).clamp(max=cfg.window_size)
    core = 3 * 2 * 2 * cfg.head_dim * cfg.n_heads * float((window + K).mean()) * cfg.n_mtp_layers
    backbone_forward = _flops_per_token(json.dumps(asdict(cfg), sort_keys=True), seq) / 3
    return backbone_forward + 6 * (per_anchor + K * per_draft) + K * core


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None, world: int = 1) -> float | None:
    """Model FLOPs utilisation: flops_per_token * tokens_per_s / (peak_flops * world); None without a peak.
    `tokens_per_s` is the whole run's (all ranks), `peak_flops` one device's."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_s / (peak_flops * world)


# ---------------------------------------------------------------------------------------------- peak
def gpu_peak(name: str) -> float | None:
    """bf16 dense peak FLOP/s of a GPU by its name (PEAK_TFLOPS), None if not in the table."""
    for key, peak in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return peak * 1e12
    return None


def measured_cpu_peak(n: int = 2048, reps: int = 5, budget_s: float | None = None) -> float:
    """Best FLOP/s of an n x n x n fp32 matmul over `reps` runs (after one warm-up); with `budget_s`, stops
    early once that much time has gone (warm-up included; at least one timed run)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    start = time.perf_counter()
    a @ b
    best = float("inf")
    for i in range(reps):
        if i and budget_s is not None and time.perf_counter() - start > budget_s:
            break
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


@dataclass
class PeakTflops:
    """`train.peak_tflops`: per-device peak TFLOP/s for the MFU, by device type; None = automatic (the
    module docstring)."""
    cuda: float | None = None
    cpu: float | None = None

    def validate(self) -> None:
        for k, v in asdict(self).items():
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ConfigError(f"train.peak_tflops.{k}={v}: must be a positive number of TFLOP/s, or null "
                                  f"(automatic)")
            setattr(self, k, None if v is None else float(v))


PEAK_CACHE = "peak_flops.json"  # in the flashtrain cache: the measured CPU peak per machine
_peaks: dict[tuple, tuple[float | None, str]] = {}


def cache_dir() -> Path:
    """$FLASHTRAIN_CACHE, or ~/.cache/flashtrain (the default corpus lives there too)."""
    return Path(os.environ.get("FLASHTRAIN_CACHE", Path.home() / ".cache" / "flashtrain"))


def machine_key() -> str:
    """What the CPU peak depends on: this machine, its CPU model, the torch threads a process uses."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{platform.node()} | {model} | {os.cpu_count()} cpus | {torch.get_num_threads()} torch threads"


def cached_cpu_peak(measure=None) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from): this machine's entry of the cache, or a measurement (`measure`,
    default `measured_cpu_peak` with up to 10 runs in 2 s) stored there for every later start (written
    atomically; a cache that cannot be written leaves the measurement uncached, said so)."""
    path, key = cache_dir() / PEAK_CACHE, machine_key()
    entries: dict = {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
        entries = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass
    entry = entries.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
        return float(entry["flops"]), (f"CPU fp32 matmul peak measured on this machine at {entry.get('measured_at')}, "
                                       f"cached in {path} (delete it to measure again; train.peak_tflops.cpu sets one)")
    flops = (measure or functools.partial(measured_cpu_peak, reps=10, budget_s=2.0))()
    at = datetime.datetime.now().isoformat(timespec="seconds")
    entries[key] = {"flops": flops, "measured_at": at}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{PEAK_CACHE}.{platform.node()}.{os.getpid()}.tmp")  # a cache shared by nodes
        tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
        os.replace(tmp, path)
        where = f"cached in {path} for later starts"
    except OSError as e:
        where = f"not cached ({e})"
    return flops, f"CPU fp32 matmul peak measured now ({at}), {where}; train.peak_tflops.cpu sets one"


def peak_flops(device: torch.device, configured: PeakTflops | None = None, announce: bool = True
               ) -> tuple[float | None, str]:
    """(peak FLOP/s of one `device`, where it comes from): `configured` for the device's type if set, else
    the GPU table / a CPU measurement (once per process; the module docstring). Logged once (if
    `announce`); None (with the reason) for a GPU the table does not know."""
    override = getattr(configured or PeakTflops(), device.type, None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = (device.type, name, override)
    if key not in _peaks:
        if override is not None:
            peak, source = override * 1e12, f"train.peak_tflops.{device.type}"
        elif device.type == "cuda":
            peak = gpu_peak(name)
            source = ("bf16 dense peak (PEAK_TFLOPS, train/flops.py)" if peak else
                      f"'{name}' is not in PEAK_TFLOPS (train/flops.py): set train.peak_tflops.cuda for the MFU")
        elif device.type == "cpu":
            peak, source = cached_cpu_peak()
        else:
            peak, source = None, f"no peak known for device type {device.type!r}"
        _peaks[key] = (peak, source)
        if announce:
            (log.info if peak else log.warning)(
                "MFU peak per device (%s): %s, %s", name, f"{peak / 1e12:.3f} TFLOP/s" if peak else "unknown", source)
    return _peaks[key]
