"""The fused indexer selection kernel (model/kernels/index_topk.py) under TRITON_INTERPRET=1 against its
reference `model.attention.index_select`: the same top-k indices and candidate blocks, entry for entry
and in the same order, and the scores of the selected entries.

Most inputs are small multiples of powers of two, so every product and sum of a score is exact in fp32:
the kernel's order of summation cannot reorder entries, and ties (the lower index first) are plentiful.
The interpreter's tile is 16 entries; shapes are ragged against it."""

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"

from flashtrain.model.attention import Attention, SharedKV, index_scores, index_select, visible_compressed_at  # noqa: E402
from flashtrain.model.kernels.index_topk import _pack, _unpack, index_topk_triton  # noqa: E402
from flashtrain.model.layer_plan import Role, layer_plan  # noqa: E402
from flashtrain.model.rope import rope_angles  # noqa: E402


@triton.jit
def _keys_kernel(SCORE, KEY, SCORE_OUT, IDX_OUT, N: tl.constexpr):
    j = tl.arange(0, N).to(tl.int64)
    key = _pack(tl.load(SCORE + j), j)
    tl.store(KEY + j, key)
    score, idx = _unpack(key)
    tl.store(SCORE_OUT + j, score)
    tl.store(IDX_OUT + j, idx)


def test_keys_order_like_a_stable_descending_sort():
    """The packed keys, sorted descending, list the scores as torch's stable descending sort does: -0.0
    and +0.0 tie, equal scores by index, -inf last; unpacking gives the score and index back."""
    tiny = torch.finfo(torch.float32).tiny
    vals = [0.0, -0.0, 1.5, -1.5, float("inf"), float("-inf"), tiny, -tiny, tiny / 4, -tiny / 4, 3e38, -3e38,
            1.5, -0.0, 0.0, 2.0 ** -20, -(2.0 ** -20), 1.5, float("-inf"), 7.0, -7.0, 0.0, -1.5, 1e-3]
    scores = torch.tensor(vals + [0.25] * (32 - len(vals)), dtype=torch.float32)
    keys, back, idx = torch.empty(32, dtype=torch.long), torch.empty(32), torch.empty(32, dtype=torch.long)
    _keys_kernel[(1,)](scores, keys, back, idx, N=32)
    assert torch.equal(idx, torch.arange(32))
    assert torch.equal(back, scores.abs() * scores.sign().where(scores != 0, torch.ones(())))  # -0.0 -> +0.0
    order = keys.sort(descending=True).indices
    assert torch.equal(order, scores.sort(descending=True, stable=True).indices)
    assert keys.unique().numel() == 32


def _inputs(B, S, H, d, N, seed, exact=True):
    g = torch.Generator().manual_seed(seed)

    def draw(*shape, scale):
        if exact:
            return torch.randint(-4, 5, shape, generator=g).float() * scale
        return torch.randn(*shape, generator=g)

    return draw(B, S, H, d, scale=0.25), draw(B, S, H, scale=0.125), draw(B, N, d, scale=0.25)


def _check(q, w, k, n_vis, topk, candidates=None, block=4, source=0, chunk=16):
    ref_idx, ref_cands = index_select(q, w, k, n_vis, topk, chunk, candidates, block, source)
    idx, vals, cands = index_topk_triton(q, w, k, n_vis, topk, chunk, candidates, block, source)
    assert idx.dtype == torch.long and vals.dtype == torch.float32 and idx.shape == vals.shape == ref_idx.shape
    assert torch.equal(idx, ref_idx)
    if source:
        assert cands.dtype == torch.int32 and torch.equal(cands, ref_cands)
    else:
        assert cands is None
    scores = index_scores(q, w, k)
    expect = scores.gather(-1, idx.clamp_min(0)).masked_fill(idx < 0, 0.0)
    torch.testing.assert_close(vals, expect, rtol=1e-5, atol=1e-6)
    return idx, vals, cands


@pytest.mark.parametrize("B, S, H, d, N, topk, ratio, ahead, exact", [
    (2, 37, 2, 16, 19, 8, 2, 0, True),  # topk within one tile; the interpreter's dot rows padded to 16
    (1, 29, 3, 20, 61, 40, 1, 25, True),  # topk wider than a tile (buffer of 64); H, d not powers of two
    (2, 21, 2, 16, 21, 16, 1, 0, False),  # Gaussian inputs
])
def test_matches_reference_causal(B, S, H, d, N, topk, ratio, ahead, exact):
    """n_vis[t] = (t + 1) // ratio (+ `ahead` entries, a context-parallel rank's later queries)."""
    q, w, k = _inputs(B, S, H, d, N, seed=S, exact=exact)
    _check(q, w, k, visible_compressed_at(torch.arange(S), ratio) + ahead, topk)


def test_ties_go_to_the_lower_index():
    B, S, H, d, N, topk = 1, 24, 2, 16, 45, 24
    q, w, k = _inputs(B, S, H, d, N, seed=1)
    k[:, 20:40] = k[:, 0:20]  # every score of entries 20..39 repeats one of 0..19
    q[:, 5] = 0.0  # all scores 0: the first entries in index order
    w[:, 6] = -0.5  # -0.0 and +0.0 are one value to the reference's sort
    n_vis = torch.full((S,), N)
    n_vis[3] = 30
    idx, vals, _ = _check(q, w, k, n_vis, topk)
    assert torch.equal(idx[0, 5], torch.arange(topk))
    sel = vals[0]
    assert ((sel[:, 1:] == sel[:, :-1]) & (idx[0, :, 1:] >= 0)).sum() > S  # the ties were exercised


def test_nothing_visible_and_fewer_visible_than_topk():
    B, S, H, d, N, topk = 2, 19, 2, 16, 35, 24
    q, w, k = _inputs(B, S, H, d, N, seed=2)
    n_vis = torch.randint(0, N + 1, (S,), generator=torch.Generator().manual_seed(2))
    n_vis[[0, 7, 8]] = 0
    n_vis[[1, 2]] = torch.tensor([1, 17])
    idx, vals, _ = _check(q, w, k, n_vis, topk)
    assert (idx[:, [0, 7, 8]] == -1).all() and (vals[:, [0, 7, 8]] == 0).all()
    assert ((idx >= 0).sum(-1) <= n_vis.clamp(max=topk)).all()


@pytest.mark.parametrize("block, source", [(4, 3), (3, 50), (4, 9), (20, 2)])
def test_candidate_source(block, source):
    """Blocks ranked by their max score, the newest visible block pinned; ties among the blocks too.
    block 3: each block padded to 4 in the kernel's tiles; source 50: more slots than blocks; block 20:
    a tile widened to one block (32 entries), wider than the top-k buffer (16)."""
    B, S, H, d, N, topk = 2, 33, 2, 16, 37, 12
    q, w, k = _inputs(B, S, H, d, N, seed=block * source)
    n_vis = visible_compressed_at(torch.arange(S), 1)
    n_vis[4] = 0
    _, _, cands = _check(q, w, k, n_vis, topk, block=block, source=source)
    assert cands.shape[-1] == min(source, -(-N // block)) and (cands[:, 4] == -1).all()


def _pool(B, S, n_blocks, n, seed):
    """Distinct block ids per query with empty (-1) slots scattered among them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_blocks, generator=g)[:n] for _ in range(B * S)]).view(B, S, n)
    ids[torch.rand(B, S, n, generator=g) < 0.3] = -1
    return ids.to(torch.int32)


@pytest.mark.parametrize("block, topk", [(4, 8), (3, 24), (20, 12)])
def test_candidate_restriction(block, topk):
    """Only entries of listed blocks; lists hold empty slots anywhere and blocks not yet visible."""
    B, S, H, d, N = 2, 26, 2, 16, 41
    q, w, k = _inputs(B, S, H, d, N, seed=block)
    nb = -(-N // block)
    cands = _pool(B, S, nb, min(7, nb), seed=block)
    cands[0, 3] = -1  # an empty pool
    n_vis = visible_compressed_at(torch.arange(S), 1) + 10
    idx, _, _ = _check(q, w, k, n_vis, topk, candidates=cands, block=block)
    assert (idx[0, 3] == -1).all()
    listed = torch.zeros(B, S, nb + 1, dtype=torch.bool)
    listed.scatter_(-1, torch.where(cands >= 0, cands, listed.shape[-1] - 1).long(), True)
    assert torch.gather(listed, -1, (idx.clamp_min(0) // block))[idx >= 0].all()


def test_candidate_source_and_restriction_together():
    B, S, H, d, N, block = 1, 22, 3, 16, 30, 4
    q, w, k = _inputs(B, S, H, d, N, seed=7)
    _check(q, w, k, visible_compressed_at(torch.arange(S), 1), 10, candidates=_pool(B, S, 8, 5, seed=7), block=block,
           source=3)


@pytest.mark.parametrize("short_pool", [False, True])
def test_attention_select_kernel_path_matches_reference(tiny_cfg, short_pool):
    """Attention._select with the kernel and with the reference: the candidate source (ratio 1) and a
    Reindex layer restricted to its pool publish the same top-k and candidates; the kernel's values are
    the forward of the indexer logits. `short_pool`: a pool of 2 blocks of 2 under a top-k of 8, topped up
    with visible entries from outside it (issue 16 (a)) on both paths."""
    if short_pool:
        tiny_cfg = dataclasses.replace(tiny_cfg, candidate_topk_blocks=2, candidate_block_size=2)
    plan = layer_plan(tiny_cfg)
    src, reindex = tiny_cfg.candidate_source_layer, 24
    assert plan[src].is_candidate_source and plan[reindex].role is Role.REINDEX
    S = 40
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, S, tiny_cfg.dim, generator=g)
    index_k = torch.randn(1, S, tiny_cfg.index_head_dim, generator=g)
    n_vis = visible_compressed_at(torch.arange(S), 1)
    got = {}
    for flag in (False, True):
        cfg = dataclasses.replace(tiny_cfg, use_triton=flag)
        torch.manual_seed(0)
        layers = [Attention(cfg, plan[src]), Attention(cfg, plan[reindex])]
        shared = SharedKV(index_k=index_k)
        for attn in layers:
            with torch.no_grad():
                for p in attn.parameters():
                    p.normal_(0, 0.3)
            cos, sin = rope_angles(attn.rope_freqs, torch.arange(S))
            qr = attn.q_norm(attn.wq_a(x))
            made = {}  # what the layer publishes (the candidate source: its pool; model/carry.py)
            out = attn._select(x, qr, shared.index_k, shared.candidates, cos, sin, n_vis, made)
            shared.candidates = made.get("candidates", shared.candidates)
            got[flag, attn.role.id] = out + (shared.candidates,)
    for layer in (src, reindex):
        (t0, l0, v0, c0), (t1, l1, v1, c1) = got[False, layer], got[True, layer]
        assert torch.equal(t0, t1) and torch.equal(v0, v1) and torch.equal(c0, c1)
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert (got[True, reindex][0] == -1).any()  # the pool (or, when short, visibility) limited some queries
    if short_pool:  # later queries select k entries although their pool holds 3 or 4
        assert ((got[True, reindex][0][0, 8:] >= 0).sum(-1) == tiny_cfg.index_topk).all()
