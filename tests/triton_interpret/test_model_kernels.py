"""The flash_tiny model with every model kernel forced on (`model.use_triton=true`: sparse attention,
indexer selection, mHC, grouped experts) against the reference path (`false`), under TRITON_INTERPRET=1:
the same loss, auxiliary losses and parameter gradients.

The model: flash_tiny's widths with a 6-layer plan that holds every layer role of the 40 (`LAYERS`: SWA;
Full at ratio 2 with Engram, then Reuse of it; Full at ratio 1 as the candidate source, a Reindex
restricted to its pool, and a Reuse of that Reindex's index) -- the kernels run per layer, so the other
34 layers repeat these cases at 7x the interpreter's time. Input: the first 64 tokens of the
pipeline-parity batch's first row (text, an image span, text): 32 and 64 compressed entries against a
candidate pool of 4 blocks of 4 (the restriction bites), top-8 with empty slots at the start. Sized for
the interpreter, which runs every program of every kernel in Python: one row, and 4 Sinkhorn rounds
instead of 20 (the mHC backward recomputes the rounds, O(rounds^2); `test_mhc_kernels.py` checks 20
rounds kernel by kernel).

Tolerance: each kernel equals its reference to 1e-5 (its own test). Through the model, fp32 rounding
differences meet sums whose terms cancel -- the mHC `base` gradients sum softmax gradients, which add
up to zero over a row -- and lose digits there in any reordering (measured: ~3e-4 of such a tensor's
largest entry with the attention kernel alone, loss identical; 1.0e-3 in norm for the last layer's
3-entry `hc_ffn_scale` gradient with every kernel on). So each gradient compares in norm,
||g - g_ref|| <= 3e-3 ||g_ref||, and all gradients together to 1e-5 in norm; a wrong kernel or
wiring moves them by order one.
"""

import dataclasses
import os

import torch
import torch.nn.functional as F

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"

from parity_batch import IGNORE, batch, tiny_cfg  # noqa: E402

from flashtrain.model import Transformer  # noqa: E402
from flashtrain.model.aux import StepStats  # noqa: E402

SEQ = 64
SINKHORN_ROUNDS = 4
LAYERS = dict(n_layers=6, compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layers=[1, 3], index_source_layers=[1, 3, 4],
              candidate_source_layer=3, engram_layer_ids=[1])
ROLES = ["swa", "full", "reuse", "full", "reindex", "reuse"]


def _step(use_triton: bool):
    cfg = dataclasses.replace(tiny_cfg(), use_triton=use_triton, hc_sinkhorn_iters=SINKHORN_ROUNDS, **LAYERS)
    cfg.validate()
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert [r.role.value for r in model.plan] == ROLES and model.plan[4].uses_candidates
    tokens, types, labels, images = batch()
    assert (types[0, :SEQ] >= 0).any(), "the input must hold the image span"
    stats = StepStats()
    logits = model(tokens[:1, :SEQ], types[:1, :SEQ], images[:1], stats)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:1, :SEQ].reshape(-1), ignore_index=IGNORE)
    loss.backward()
    aux = {f"kl{k}": v for k, v in stats.indexer_loss.items()} | {f"bal{k}": v for k, v in stats.balance_loss.items()}
    return loss.detach(), aux, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_flash_tiny_forward_backward_kernels_match_reference():
    loss, aux, grads = _step(True)
    ref_loss, ref_aux, ref_grads = _step(False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert aux.keys() == ref_aux.keys() and any(k.startswith("kl") for k in aux)
    for k in aux:
        torch.testing.assert_close(aux[k], ref_aux[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    assert grads.keys() == ref_grads.keys()
    worst = max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30), n) for n in grads)
    assert worst[0] < 3e-3, worst
    flat, ref_flat = (torch.cat([g[n].flatten() for n in sorted(g)]) for g in (grads, ref_grads))
    assert (flat - ref_flat).norm() / ref_flat.norm() < 1e-5
