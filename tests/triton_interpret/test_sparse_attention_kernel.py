"""The CSA2 sparse-attention kernels (model/kernels/sparse_attention.py) under TRITON_INTERPRET=1 (fp32, CPU
tensors): `sparse_attention_lean(..., use_triton=True)` against its chunked PyTorch path (use_triton=False)
and against the literal per-chunk reference `sparse_attention` -- output, KL target, log-sum-exp and the
gradients of q, window KV, compressed KV and sink -- with a ragged sequence (tiles of 16), empty top-k
slots and an all-empty row, a context-parallel halo (q_offset > 0, rows no query sees), no compressed
part, a head dimension that is not a power of two and more heads than one head block."""

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"

from flashtrain.model.kernels.sparse_attention import sparse_attention_fwd_triton  # noqa: E402
from flashtrain.model.sparse_attention import sparse_attention, sparse_attention_lean  # noqa: E402


def _inputs(B, S, H, D, N, k, q_offset=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g)
    kv = torch.randn(B, q_offset + S, D, generator=g)
    comp = torch.randn(B, N, D, generator=g)
    sink = torch.randn(H, generator=g)
    # causal-looking selections with scattered empty slots, and one query whose slots are all empty
    topk = torch.full((B, S, k), -1, dtype=torch.long)
    for b in range(B):
        for t in range(S):
            vis = min(N, t // 2 + 1)
            pick = torch.randperm(N, generator=g)[:min(k, vis)]
            topk[b, t, :len(pick)] = pick
            topk[b, t] = topk[b, t, torch.randperm(k, generator=g)]
    topk[0, S // 2] = -1
    return [x.requires_grad_() for x in (q, kv, comp, sink)] + [topk]


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


def _assert_close(got, want, name, rtol=1e-5):
    if want is None:
        assert got is None or not got.any(), name
        return
    atol = 1e-5 * max(1.0, want.abs().max().item() if want.numel() else 0.0)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _compare_paths(q, kv, comp, sink, topk, window, scale, q_offset):
    out, target = sparse_attention_lean(q, kv, comp, topk, sink, window, scale, 16, q_offset, use_triton=True)
    ref_out, ref_target = sparse_attention_lean(q, kv, comp, topk, sink, window, scale, 7, q_offset,
                                                use_triton=False)
    _assert_close(out, ref_out, "out")
    _assert_close(target, ref_target, "target")
    assert not target.requires_grad and target.shape == ref_target.shape
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    inputs = (q, kv, comp, sink)
    got, want = _grads(out, inputs, g), _grads(ref_out, inputs, g)
    for name, a, b in zip(("dq", "dwindow_kv", "dcomp_kv", "dsink"), got, want):
        _assert_close(a, b, name)
    return out, target, got


@pytest.mark.parametrize("B, S, H, D, N, k, window, q_offset", [
    (2, 37, 3, 48, 11, 6, 20, 0),   # ragged S (tiles of 16), D not a power of two, band wider than a tile
    (1, 37, 4, 32, 9, 8, 5, 12),    # halo: rows 0..7 of window_kv are seen by no query
    (2, 19, 2, 16, 7, 3, 40, 3),    # a window longer than the sequence (every earlier row visible)
    (1, 21, 2, 24, 5, 4, 1, 0),     # window 1: each query sees only its own row
])
def test_kernel_path_matches_pytorch_path(B, S, H, D, N, k, window, q_offset):
    q, kv, comp, sink, topk = _inputs(B, S, H, D, N, k, q_offset)
    assert (topk < 0).any() and (topk >= 0).any() and (topk[0, S // 2] < 0).all()
    out, target, (_, dkv, _, _) = _compare_paths(q, kv, comp, sink, topk, window, 0.3, q_offset)
    # empty slots carry no probability; the all-empty row's output comes from its window alone
    assert (target[topk < 0] == 0).all() and (target[topk >= 0] > 0).all()
    first_seen = max(0, q_offset - window + 1)
    if first_seen:
        assert (dkv[:, :first_seen] == 0).all()
    assert (dkv[:, first_seen:].abs().sum(-1) > 0).all()


def test_several_head_blocks():
    """18 heads: two head blocks of 16, the second one ragged; the target sums over both."""
    q, kv, comp, sink, topk = _inputs(1, 9, 18, 16, 6, 3, q_offset=2, seed=3)
    _compare_paths(q, kv, comp, sink, topk, 4, 0.25, 2)


@pytest.mark.parametrize("empty", ["none", "k0"])
def test_without_compressed_part(empty):
    q, kv, comp, sink, _ = _inputs(2, 37, 3, 48, 4, 2, q_offset=5, seed=1)
    topk = None if empty == "none" else torch.zeros(2, 37, 0, dtype=torch.long)
    out, target, (_, _, dcomp, _) = _compare_paths(q, kv, comp, sink, topk, 9, 0.4, 5)
    assert target.shape == (2, 37, 0)
    assert dcomp is None


def test_kernel_path_matches_literal_reference():
    """Against `sparse_attention` itself, chunk by chunk (autograd through the reference), with a halo."""
    B, S, H, D, N, k, window, off, scale = 2, 37, 3, 48, 10, 5, 13, 6, 0.2
    q, kv, comp, sink, topk = _inputs(B, S, H, D, N, k, off, seed=2)
    out, target = sparse_attention_lean(q, kv, comp, topk, sink, window, scale, 16, off, use_triton=True)
    outs, probs = [], []
    for t0 in range(0, S, 10):
        t1 = min(S, t0 + 10)
        o, p = sparse_attention(q[:, t0:t1], kv, t0 + off, window, comp, topk[:, t0:t1], sink, scale)
        outs.append(o)
        probs.append(p)
    ref_out, ref_target = torch.cat(outs, 1), torch.cat(probs, 1).sum(dim=2)
    _assert_close(out, ref_out, "out")
    _assert_close(target, ref_target, "target")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    for name, a, b in zip(("dq", "dwindow_kv", "dcomp_kv", "dsink"), _grads(out, (q, kv, comp, sink), g),
                          _grads(ref_out, (q, kv, comp, sink), g)):
        _assert_close(a, b, name)


def test_forward_lse_includes_the_sink():
    """The saved log-sum-exp: over the band, the non-empty selected slots and the sink."""
    B, S, H, D, N, k, window, off, scale = 1, 17, 2, 20, 6, 3, 4, 2, 0.5
    q, kv, comp, sink, topk = (x.detach() if x.is_floating_point() else x for x in _inputs(B, S, H, D, N, k, off))
    _, lse, _ = sparse_attention_fwd_triton(q, kv, comp, topk, sink, window, scale, off)
    want = torch.empty(B, S, H)
    for t in range(S):
        pos = t + off
        keys = kv[0, max(0, pos - window + 1):pos + 1]
        sel = topk[0, t][topk[0, t] >= 0]
        keys = torch.cat([keys, comp[0, sel]])
        logits = torch.cat([q[0, t] @ keys.T * scale, sink.view(H, 1)], dim=1)
        want[0, t] = logits.logsumexp(dim=1)
    torch.testing.assert_close(lse, want, rtol=1e-5, atol=1e-5)
