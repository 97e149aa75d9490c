"""Model FLOPs per token (train/flops.py) against torch's FLOP counter.

Forward + backward of flash_tiny (`EIGHT_LAYERS`: every CSA2 role) and of a flash_small-width slice
(`FOUR_LAYERS`) run under `torch.utils.flop_counter.FlopCounterMode`, recomputation off. Every FLOP the
counter counts (matmuls: mm / addmm / bmm; einsums reach it as bmm) is attributed to a component by
where the model computed it -- the Python frames of a forward op, the forward traceback that anomaly
mode keeps on the autograd node of a backward op -- and each component is compared with
`flops_by_component` (V41_SPEC §1-5): dense matmuls, routed experts, attention core, indexer.

The counter sees what the CPU reference path computes, which is not exactly the model FLOPs; each
difference is computed here by hand from the config and added to the formula's figure (train/flops.py's
docstring, "Checked against torch's FLOP counter", explains each one). With them accounted for, the
figures agree to float64 rounding (`REL`), so dropping a term or counting all experts fails.

Overrides, all of them execution-only or text-only (none changes a matmul the formula counts):
`model.use_triton=false` (the routed experts loop over per-expert matmuls: the counter has no formula for
`torch._grouped_mm`, so it would see none of their FLOPs), `model.vision_n_layers=0` (text batches),
`model.hc_sinkhorn_iters=1` (the Sinkhorn rounds are element-wise and uncounted; fewer of them only make
the run faster); flash_tiny also `model.attn_chunk_size=32`, two query chunks, so the second chunk's key
band starts inside the sequence.
"""

import re
import sys
import threading
import warnings
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from layer_plans import EIGHT_LAYERS, FOUR_LAYERS
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from flashtrain.model import Transformer
from flashtrain.model.layer_plan import layer_plan
from flashtrain.train.config import compose, model_config
from flashtrain.train.flops import COMPONENTS, flop_accounting, flops_by_component, flops_per_token

pytestmark = pytest.mark.xdist_group("flop_count")  # one worker computes each model's counts once

REL = 1e-9  # float64 rounding of the formula's means; every counted FLOP is accounted for exactly

COMMON = ["model.use_triton=false", "model.vision_n_layers=0", "model.hc_sinkhorn_iters=1"]
CASES = {  # name: (overrides, batch, sequence length)
    # window 16, index_topk 8, candidate pool 4 x 4 entries: all bind within 64 positions
    "flash_tiny": (["+exp=flash_tiny", *EIGHT_LAYERS, "model.attn_chunk_size=32", *COMMON], 2, 64),
    # flash_small's widths (dim 256, 4 x 64 heads, window 128, index_topk 64, 16 experts of which 2 active,
    # vocab 16384): 256 positions pass the window and 2 x 64 compressed entries
    "flash_small": (["+exp=flash_small", *FOUR_LAYERS, *COMMON], 1, 256),
}

# Attribution: (part, file in model/, the functions that mark it; None = any function of the file). The
# innermost frame in a listed function decides; failing that, the innermost frame in a listed file.
RULES = [
    ("attention_core", "sparse_attention.py", None),
    ("indexer", "index_logits.py", None),
    ("indexer", "attention.py", {"_select", "index_keys"}),
    ("compressor", "attention.py", {"project", "pool", "_compress"}),
    ("routed_experts", "moe.py", {"local_experts"}),
    ("mhc_mixing", "mhc.py", {"hc_expand"}),
    ("mhc", "mhc.py", {"hc_mixes"}),
    ("head", "transformer.py", {"logits"}),
    ("engram", "engram.py", None),
    ("attention", "attention.py", None),
    ("moe_dense", "moe.py", None),
]
# the dense parts and the `matmul_params` parts they count
DENSE_PARTS = {"attention": ("attention",), "compressor": ("compressor",), "mhc": ("mhc",),
               "moe_dense": ("gate", "shared_expert"), "engram": ("engram",), "head": ("head",)}
TRACEBACK_FRAME = re.compile(r'File "(.*)", line \d+, in (\S+)')


def part_of(frames: list[tuple[str, str]]) -> str:
    """frames: (file, function), innermost first."""
    for named in (True, False):
        for path, fn in frames:
            for part, file, fns in RULES:
                if (fns is not None) == named and path.endswith(f"model/{file}") and (fns is None or fn in fns):
                    return part
    return "other"


def current_frames() -> list[tuple[str, str]]:
    """Where the op being counted comes from: the live Python stack in forward; in backward, the forward
    traceback of the autograd node being run (anomaly mode stores it)."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return [TRACEBACK_FRAME.search(line).groups() for line in reversed(node.metadata["traceback_"])]
    frames, f = [], sys._getframe()
    while f is not None:
        frames.append((f.f_code.co_filename, f.f_code.co_name))
        f = f.f_back
    return frames


def counted_by_part(model: Transformer, tokens: torch.Tensor) -> dict[str, int]:
    """FLOPs the counter counts in one forward + backward, by part; checks that the parts sum to its total."""
    by_part: dict[str, int] = defaultdict(int)

    def attributed(formula):
        def count(*args, **kwargs):
            flops = formula(*args, **kwargs)
            by_part[part_of(current_frames())] += flops
            return flops
        count._get_raw = True  # the registry's formulas take the op's arguments, not their shapes
        return count

    counter = FlopCounterMode(display=False, custom_mapping={op: attributed(f) for op, f in flop_registry.items()})

    def step():
        with torch.autograd.detect_anomaly(check_nan=False), counter:
            logits = model(tokens)
            F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        in_thread(step)
    assert sum(by_part.values()) == counter.get_total_flops()
    return dict(by_part)


def in_thread(fn) -> None:
    """fn() on a fresh thread: its stack starts near empty, so the traceback anomaly mode formats for
    every autograd node holds the model's frames without pytest's (about a third as many to format)."""
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # re-raised on the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def differences(cfg, seq: int) -> dict[str, dict[str, float]]:
    """What the CPU reference computes beyond (or short of) the model FLOPs, per token, by component,
    worked out from the config (train/flops.py's docstring, "Checked against torch's FLOP counter")."""
    S, W, C = seq, cfg.window_size, cfg.attn_chunk_size
    per_slot = 2 * 2 * cfg.n_heads * cfg.head_dim  # forward QK^T and PV (2 FLOPs per multiply-add), per slot
    train = 3  # forward + backward, as the formula counts: 3 x the forward (12 per slot and head channel)
    index_dim = cfg.index_n_heads * cfg.index_head_dim
    plan = layer_plan(cfg)
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    attended = band = computed_comp = attended_comp = 0  # slots summed over the layers and queries
    scored = visible_sum = logit_cols = logit_sel = 0
    for role in plan:
        attended += sum(min(W, t + 1) for t in range(S))
        band += sum((min(S, t0 + C) - t0) * (min(S, t0 + C) - max(0, t0 - W + 1)) for t0 in range(0, S, C))
        if not role.compress_ratio:
            continue
        m, n = role.compress_ratio, S // role.compress_ratio
        cols = min(cfg.index_topk, n)  # top-k columns, empty slots (-1) included
        limit = pool if plan[role.index_source].uses_candidates else cfg.index_topk
        selected = sum(min(cfg.index_topk, (t + 1) // m, limit) for t in range(S))
        computed_comp += S * cols
        attended_comp += selected
        if role.has_indexer:
            scored += S * n
            visible_sum += sum((t + 1) // m for t in range(S))
            logit_cols += S * cols
            logit_sel += selected
    n_indexers = sum(role.has_indexer for role in plan)
    # wq_b and weights_proj: no input gradient, 2 FLOPs per weight fewer than the formula's 6
    detached = 2 * (cfg.q_lora_rank * index_dim + cfg.dim * cfg.index_n_heads)
    sites = 2  # mHC sites per block: attention, FFN
    mixing = train * 2 * cfg.hc_mult ** 2 * cfg.dim  # B X per token: n^2 D multiply-adds, forward + backward
    per_entry = 2 * index_dim  # one indexer logit q . k over the index heads
    return {
        "dense_matmuls": {"mHC B mixing (hc_expand)": sites * len(plan) * mixing},
        "routed_experts": {},
        "attention_core": {
            "masked keys of the chunk's band": train * per_slot * (band - attended) / S,
            "empty top-k slots": train * per_slot * (computed_comp - attended_comp) / S,
            "logits recomputed in backward": per_slot / 2 * (band + computed_comp) / S},  # QK^T: half the forward
        "indexer": {
            "wq_b / weights_proj see detached inputs (4, not 6)": -detached * n_indexers,
            "scores every compressed entry, masks the invisible": per_entry * (scored - visible_sum) / S,
            # the lean KL logits: forward (again, with gradient) and backward's recomputation, on all k columns
            "KL logits recomputed (forward and backward)": 2 * per_entry * logit_cols / S,
            # the formula's KL backward (dq, dk: 2 x per_entry) on the empty columns too
            "KL logits of empty top-k slots": 2 * per_entry * (logit_cols - logit_sel) / S},
    }


@pytest.fixture(scope="module", params=list(CASES))
def measured(request):
    overrides, batch, seq = CASES[request.param]
    cfg = model_config(compose(overrides))
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.set_recompute("none")
    tokens = torch.randint(3, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    counted = {k: v / (batch * seq) for k, v in counted_by_part(model, tokens).items()}
    return request.param, cfg, seq, counted


def table(rows: dict[str, tuple[float, float]]) -> str:
    return "\n".join(f"  {k:16} expected {e:14.1f}  counted {c:14.1f}" for k, (e, c) in rows.items())


def test_components_match_the_flop_counter(measured):
    """Each component of `flops_by_component` plus the reference path's differences is what the counter
    counts: the dense matmuls, the routed experts actually activated (each token's k of them, however
    unbalanced the routing), the attention core and the indexer."""
    name, cfg, seq, counted = measured
    formula = flops_by_component(cfg, seq)
    assert list(formula) == list(COMPONENTS)
    assert sum(formula.values()) == flops_per_token(cfg, seq)
    assert counted.get("other", 0) == 0, f"{name}: FLOPs counted outside every known part: {counted}"
    diffs = differences(cfg, seq)
    got = {"dense_matmuls": sum(counted.get(p, 0) for p in (*DENSE_PARTS, "mhc_mixing")),
           "routed_experts": counted.get("routed_experts", 0),
           "attention_core": counted.get("attention_core", 0), "indexer": counted.get("indexer", 0)}
    rows = {c: (formula[c] + sum(diffs[c].values()), got[c]) for c in COMPONENTS}
    assert all(e == pytest.approx(c, rel=REL) for e, c in rows.values()), f"{name} (per token):\n{table(rows)}"


def test_dense_parts_match_the_flop_counter(measured):
    """The dense matmuls part by part: 6 x each part's activated parameters (`matmul_params`)."""
    name, cfg, seq, counted = measured
    params = flop_accounting(cfg, seq)["matmul_params_by_part"]
    assert params["other"] == 0
    rows = {p: (6 * sum(params[k] for k in parts), counted.get(p, 0)) for p, parts in DENSE_PARTS.items()}
    assert all(e == pytest.approx(c, rel=REL) for e, c in rows.values()), f"{name} (per token):\n{table(rows)}"

