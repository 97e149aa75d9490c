"""The memory-lean sparse-attention path (model/sparse_attention.py) against the chunked reference and
against finite differences: the same output, KL target and gradients (q, window KV, compressed KV,
sink), with empty slots, window edges and a chunk size that does not divide the sequence; and what it
saves for backward (q, output, log-sum-exp, indices) is a fraction of what the reference keeps."""

import pytest
import torch

from flashtrain.model.sparse_attention import sparse_attention, sparse_attention_lean


def _inputs(B=2, S=23, H=3, D=8, N=9, k=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g, dtype=dtype)
    kv = torch.randn(B, S, D, generator=g, dtype=dtype)
    comp = torch.randn(B, N, D, generator=g, dtype=dtype)
    # causal-looking selections with empty slots: query t sees groups < t // 2 + 1 (at most N)
    topk = torch.full((B, S, k), -1, dtype=torch.long)
    for b in range(B):
        for t in range(S):
            vis = min(N, t // 2 + 1)
            pick = torch.randperm(vis, generator=g)[:k]
            topk[b, t, :len(pick)] = pick
    sink = torch.randn(H, generator=g, dtype=dtype)
    return [x.requires_grad_() if x.is_floating_point() else x for x in (q, kv, comp, sink)] + [topk]


def _reference(q, kv, comp, sink, topk, window, scale, chunk):
    outs, probs = [], []
    for t0 in range(0, q.shape[1], chunk):
        t1 = min(q.shape[1], t0 + chunk)
        o, p = sparse_attention(q[:, t0:t1], kv, t0, window, comp, topk[:, t0:t1], sink, scale)
        outs.append(o)
        probs.append(p)
    return torch.cat(outs, 1), torch.cat(probs, 1).sum(dim=2)


@pytest.mark.parametrize("window, chunk", [(5, 7), (1, 23), (30, 4)])
def test_lean_path_equals_the_reference_forward_and_gradients(window, chunk):
    q, kv, comp, sink, topk = _inputs()
    assert (topk < 0).any() and (topk >= 0).any()
    scale = 0.35
    ref_out, ref_target = _reference(q, kv, comp, sink, topk, window, scale, chunk=6)
    out, target = sparse_attention_lean(q, kv, comp, topk, sink, window, scale, chunk)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(target, ref_target, atol=1e-6, rtol=1e-5)
    assert not target.requires_grad
    g = torch.randn_like(out)
    want = torch.autograd.grad(ref_out, (q, kv, comp, sink), g)
    got = torch.autograd.grad(out, (q, kv, comp, sink), g)
    for name, a, b in zip(("q", "window_kv", "comp_kv", "sink"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")


def test_lean_backward_matches_finite_differences():
    q, kv, comp, sink, topk = _inputs(B=1, S=9, H=2, D=3, N=4, k=3, dtype=torch.float64, seed=1)

    def f(q, kv, comp, sink):
        return sparse_attention_lean(q, kv, comp, topk, sink, 3, 0.6, 4)[0]

    assert torch.autograd.gradcheck(f, (q, kv, comp, sink))


def test_without_compressed_slots_and_with_an_infinite_sink():
    q, kv, _, sink, _ = _inputs(S=11)
    with torch.no_grad():
        sink[1] = float("-inf")
    ref, _ = sparse_attention(q, kv, 0, 4, None, None, sink, 0.5)
    out, target = sparse_attention_lean(q, kv, None, None, sink, 4, 0.5, 5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert target.shape == (2, 11, 0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, kv, sink), g), torch.autograd.grad(ref, (q, kv, sink), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _saved_bytes(fn):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(total)


def test_lean_path_saves_only_q_output_lse_and_indices():
    q, kv, comp, sink, topk = _inputs(B=1, S=64, H=4, D=16, N=32, k=16)
    lean = _saved_bytes(lambda: sparse_attention_lean(q, kv, comp, topk, sink, 16, 0.25, 16))
    ref = _saved_bytes(lambda: _reference(q, kv, comp, sink, topk, 16, 0.25, 16))
    def nbytes(t):
        return t.numel() * t.element_size()
    lse = q.shape[0] * q.shape[1] * q.shape[2] * 4
    assert lean == nbytes(q) * 2 + lse + nbytes(topk) + nbytes(kv) + nbytes(comp) + nbytes(sink)
    assert ref > 3 * lean, (ref, lean)


@pytest.mark.parametrize("chunk", [5, 32])
def test_lean_index_logits_equal_the_reference_and_finite_differences(chunk):
    """The KL's indexer logits of the selected entries: values and gradients (q, w, index keys) equal the
    chunked reference; empty slots (-1) send no gradient to key row 0; gradcheck in float64."""
    from flashtrain.model.index_logits import index_logits_lean, index_logits_reference

    g = torch.Generator().manual_seed(2)
    B, S, H, d, N, k = 2, 21, 3, 6, 8, 4
    q = torch.randn(B, S, H, d, generator=g, requires_grad=True)
    w = torch.randn(B, S, H, generator=g, requires_grad=True)
    keys = torch.randn(B, N, d, generator=g, requires_grad=True)
    idx = torch.randint(0, N, (B, S, k), generator=g)
    idx[:, :5, 2:] = -1
    valid = idx >= 0
    ref = torch.cat([index_logits_reference(q[:, t0:t0 + 7], w[:, t0:t0 + 7], keys, idx[:, t0:t0 + 7])
                     for t0 in range(0, S, 7)], 1)
    out = index_logits_lean(q, w, keys, idx, chunk)
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-6, rtol=1e-5)
    gout = torch.randn_like(out).masked_fill(~valid, 0.0)  # the KL never looks at empty slots
    want = torch.autograd.grad(ref, (q, w, keys), gout)
    got = torch.autograd.grad(out, (q, w, keys), gout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # an empty slot with a non-zero incoming gradient still sends nothing to key row 0
    only_empty = torch.zeros_like(out)
    only_empty[~valid] = 1.0
    assert torch.autograd.grad(index_logits_lean(q, w, keys, idx, chunk), keys, only_empty)[0].abs().sum() == 0
    small = ([t.detach().double()[:1, :6].requires_grad_() for t in (q, w)]
             + [keys.detach().double()[:1].requires_grad_()])
    assert torch.autograd.gradcheck(lambda a, b, c: index_logits_lean(a, b, c, idx[:1, :6], 4), small)
