"""CSA2 attention (V41_SPEC §1-2): visibility, sharing, candidate pool, causality, reference math."""

import dataclasses
import math

import pytest
import torch

from flashtrain.model.attention import Attention, Compressor, SharedKV, candidate_mask, select_candidate_blocks
from flashtrain.model.layer_plan import Role, layer_plan
from flashtrain.model.sparse_attention import sparse_attention


def _role(cfg, layer):
    return layer_plan(cfg)[layer]


def _randomize(module, std=0.3):
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)


@pytest.mark.slow
def test_compressed_groups_become_visible_exactly_when_complete(tiny_cfg):
    """Window 1 (a query sees only itself) and top-k >= groups (every visible group is selected): a
    query t then depends on an earlier position p iff p's group j = p // m is complete at t,
    i.e. t >= (j + 1) m - 1. Checked for m = 2 (layer 2) and m = 4."""
    for ratio in (2, 4):
        cfg = dataclasses.replace(tiny_cfg, window_size=1, index_topk=64,
                                  compress_ratios=[0, 0] + [ratio] * 18 + [1] * 20)
        torch.manual_seed(0)
        attn = Attention(cfg, _role(cfg, 2))
        _randomize(attn)
        S = 16
        x = torch.randn(1, S, cfg.dim)
        base = attn(x, SharedKV())
        for p in range(S):
            x2 = x.clone()
            x2[0, p] += 1.0
            out = attn(x2, SharedKV())
            changed = (out - base).abs().amax(-1)[0] > 1e-6
            for t in range(S):
                if t == p:
                    assert changed[t]  # its own window slot
                    continue
                expect = t >= (p // ratio + 1) * ratio - 1 and t > p
                assert bool(changed[t]) == expect, (ratio, p, t)


def test_compressor_pools_groups_by_hand(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, dim=2, head_dim=2, rope_head_dim=2)
    comp = Compressor(cfg, 2)
    with torch.no_grad():
        comp.wkv.weight.copy_(torch.eye(2))
        comp.wgate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])  # last token: incomplete group, dropped
    out = comp(x)
    assert out.shape == (1, 1, 2)
    w0 = [math.exp(1) / (math.exp(1) + math.exp(3)), math.exp(3) / (math.exp(1) + math.exp(3))]
    pooled = [w0[0] * 1 + w0[1] * 3, 0.5 * 2 + 0.5 * 4]
    rms = math.sqrt((pooled[0] ** 2 + pooled[1] ** 2) / 2)
    torch.testing.assert_close(out[0, 0], torch.tensor([pooled[0] / rms, pooled[1] / rms]))


def test_sparse_attention_matches_literal_softmax_with_sink():
    torch.manual_seed(0)
    B, S, H, D, W = 1, 6, 2, 4, 3
    q = torch.randn(B, S, H, D)
    kv = torch.randn(B, S, D)
    comp = torch.randn(B, 3, D)
    idx = torch.tensor([[[-1, -1], [0, -1], [0, 2], [1, -1], [2, 0], [1, 2]]])
    sink = torch.tensor([0.3, -1.0])
    out, _ = sparse_attention(q, kv, 0, W, comp, idx, sink, 0.5)
    for t in range(S):
        ents = [kv[0, p] for p in range(max(0, t - W + 1), t + 1)] + [comp[0, j] for j in idx[0, t].tolist() if j >= 0]
        E = torch.stack(ents)
        for h in range(H):
            logits = (E @ q[0, t, h]) * 0.5
            w = torch.exp(logits)
            want = (w.unsqueeze(-1) * E).sum(0) / (w.sum() + torch.exp(sink[h]))
            torch.testing.assert_close(out[0, t, h], want, atol=1e-5, rtol=1e-5)


def test_reuse_layers_have_no_indexer_and_backprop_into_owner_compressor(tiny_cfg):
    plan = layer_plan(tiny_cfg)
    from flashtrain.model import Transformer

    with torch.device("meta"):
        model = Transformer(tiny_cfg, init=False)
    for role, block in zip(plan, model.layers):
        names = [n for n, _ in block.attn.named_parameters()]
        assert any(n.startswith("indexer.") for n in names) == (role.role in (Role.FULL, Role.REINDEX)), role
        assert any(n.startswith("compressor.") for n in names) == (role.role is Role.FULL), role
        assert any(n.startswith("indexer.wk") for n in names) == (role.role is Role.FULL), role

    torch.manual_seed(0)
    full, reuse = Attention(tiny_cfg, plan[2]), Attention(tiny_cfg, plan[3])
    assert plan[3].role is Role.REUSE and plan[3].kv_source == 2
    _randomize(full)
    _randomize(reuse)
    S = 48
    shared = SharedKV()
    full(torch.randn(1, S, tiny_cfg.dim), shared)
    out = reuse(torch.randn(1, S, tiny_cfg.dim), shared)
    out.pow(2).sum().backward()
    g = full.compressor.wkv.weight.grad
    assert g is not None and g.abs().sum() > 0
    assert full.compressor.wgate.weight.grad.abs().sum() > 0
    # ... and only through the shared KV: the owner's query path is untouched by the reader's loss
    assert full.wq_a.weight.grad is None


@pytest.mark.slow
def test_reindex_layers_select_only_inside_candidate_pool(tiny_cfg, tiny_model):
    plan = tiny_model.plan
    cand_layer = tiny_cfg.candidate_source_layer
    reindex = [r.id for r in plan if r.role is Role.REINDEX]
    assert reindex == [24, 28, 32, 36] and all(plan[l].uses_candidates for l in reindex)
    seen = {}
    for l in [cand_layer] + reindex:
        tiny_model.layers[l].register_forward_hook(
            lambda mod, args, out, l=l: seen.__setitem__(l, (out.shared.topk, out.shared.candidates)))
    S, bs = 128, tiny_cfg.candidate_block_size
    with torch.no_grad():
        tiny_model(torch.randint(0, tiny_cfg.vocab_size, (2, S)))
    idx = seen[cand_layer][1]
    n_cand = tiny_cfg.candidate_topk_blocks
    assert idx.shape == (2, S, n_cand) and idx.dtype == torch.int32
    t = torch.arange(S)
    # query t sees t + 1 positions, i.e. t // bs + 1 blocks: slots beyond that are empty (-1)
    torch.testing.assert_close((idx >= 0).sum(-1), torch.clamp(t // bs + 1, max=n_cand).expand(2, S))
    valid_idx = idx[idx >= 0]
    assert ((valid_idx >= 0) & (valid_idx < S // bs)).all()
    cands = candidate_mask(idx, S, bs).unflatten(-1, (S // bs, bs))[..., 0]  # [2, S, S // bs] block mask
    assert (cands.sum(-1) == (idx >= 0).sum(-1)).all()  # no duplicate blocks
    # the block holding the newest visible position (t itself at ratio 1) is always in the pool
    assert cands[:, t, t // bs].all()
    restricted = 0
    for l in reindex:
        topk = seen[l][0]
        valid = topk >= 0
        block = topk.clamp_min(0) // bs
        inside = torch.gather(cands, 2, block)
        assert inside[valid].all(), l
        assert (topk[valid] <= t.view(1, S, 1).expand_as(topk)[valid]).all()  # causal
        restricted += int((valid.sum(-1) < topk.shape[-1]).sum())
    # the pool (4 blocks of 4) is what limits selection once t is large: some queries have empty slots
    assert restricted > 0


def test_select_candidate_blocks_by_hand():
    scores = torch.tensor([[[5.0, 1.0, 0.0, 0.0, 9.0, 2.0, 3.0, float("-inf")]]])
    n_vis = torch.tensor([7])
    keep = select_candidate_blocks(scores, n_vis, topk_blocks=2, block=2)
    # block maxima: [5, 0, 9, 3]; newest visible position 6 lies in block 3 (pinned); best other: block 2
    assert sorted(keep[0, 0].tolist()) == [2, 3]
    # fewer visible blocks than slots: empty slots are -1; the mask expands blocks to entries
    scores = torch.tensor([[[1.0, 4.0, float("-inf"), float("-inf"), float("-inf")]]])
    keep = select_candidate_blocks(scores, torch.tensor([2]), topk_blocks=3, block=2)
    assert keep[0, 0].tolist() == [0, -1, -1]
    assert candidate_mask(keep, 5, 2)[0, 0].tolist() == [True, True, False, False, False]


@pytest.mark.slow
def test_causality_every_layer(tiny_cfg, tiny_model):
    """Changing tokens after t leaves every block's output (and the logits) up to t unchanged."""
    outs = {}
    for block in tiny_model.layers:
        block.register_forward_hook(lambda mod, args, out: outs.__setitem__(mod.layer_id, out.h))
    torch.manual_seed(1)
    S = 128
    tokens = torch.randint(3, tiny_cfg.vocab_size, (1, S))
    with torch.no_grad():
        base_logits = tiny_model(tokens)
        base = dict(outs)
        for t in (0, 16, 47, 64, 100):
            changed = tokens.clone()
            changed[0, t + 1:] = torch.randint(3, tiny_cfg.vocab_size, (S - t - 1,))
            logits = tiny_model(changed)
            torch.testing.assert_close(logits[0, :t + 1], base_logits[0, :t + 1], atol=1e-5, rtol=1e-5)
            for l in range(tiny_cfg.n_layers):
                torch.testing.assert_close(
                    outs[l][0, :t + 1], base[l][0, :t + 1], atol=1e-5, rtol=1e-5,
                    msg=lambda m, l=l, t=t: f"layer {l} ({tiny_model.plan[l].role.value}) t={t}: {m}")
            assert not torch.allclose(logits[0, t + 1:], base_logits[0, t + 1:])


def test_index_scores_by_hand():
    """score(t, j) = sum_h ReLU(q_th . k_j) * w_th: a negative dot product contributes nothing, a
    negative weight subtracts."""
    from flashtrain.model.attention import index_scores

    q = torch.tensor([[[[1.0, 0.0], [0.5, -1.0]]]])  # [B=1, C=1, H=2, d=2]
    k = torch.tensor([[[2.0, 1.0], [-1.0, 3.0], [0.0, -2.0]]])  # [B=1, N=3, d=2]
    w = torch.tensor([[[0.5, -2.0]]])
    # head 0 dots: 2, -1, 0 -> relu 2, 0, 0; head 1 dots: 0, -3.5, 2 -> relu 0, 0, 2
    want = [0.5 * 2 + -2.0 * 0, 0.0, 0.5 * 0 + -2.0 * 2]
    torch.testing.assert_close(index_scores(q, w, k), torch.tensor([[want]]))


def _literal_topk(scores, n_vis, k):
    """Per query: the k largest scores among the visible entries (ties broken by index)."""
    return [sorted(range(int(n_vis[t])), key=lambda j: (-row[j], j))[:k] for t, row in enumerate(scores)]


def _is_top_k(chosen, row, n_vis, k, tol=1e-6):
    """Is `chosen` a top-k set of the visible entries of `row`? (Entries whose scores tie at the
    boundary -- ReLU makes exact zeros common -- may be either in or out.)"""
    visible = range(int(n_vis))
    if len(chosen) != len(set(chosen)) or len(chosen) != min(k, int(n_vis)) or any(j not in visible for j in chosen):
        return False
    rest = [row[j] for j in visible if j not in chosen]
    return not rest or min(row[j] for j in chosen) >= max(rest) - tol


def test_indexer_selects_the_literal_top_k_of_visible_entries(tiny_cfg):
    """A Full layer (ratio 2) with random weights: its published top-k is, per query, a set of the k best
    visible compressed entries under score(t, j) = sum_h ReLU(q_th . k_j) * w_th, with
    q = RoPE(wq_b(q_norm(wq_a(x)))), w = weights_proj(x) / sqrt(H d), k_j = RoPE_{2j}(k_norm(wk(latent_j)));
    queries that see fewer than k groups get exactly that many -1 slots. The inputs are checked to
    tell the formula from plausible variants (no ReLU, unweighted heads, one group of look-ahead)."""
    from flashtrain.model.attention import visible_compressed_at
    from flashtrain.model.rope import apply_rope, rope_angles

    k_sel = 5
    cfg = dataclasses.replace(tiny_cfg, index_topk=k_sel)
    role = _role(cfg, 2)
    assert role.role is Role.FULL and role.compress_ratio == 2
    torch.manual_seed(3)
    attn = Attention(cfg, role)
    _randomize(attn)
    S = 40
    x = torch.randn(1, S, cfg.dim)
    shared = SharedKV()
    with torch.no_grad():
        attn(x, shared)
        H, d = cfg.index_n_heads, cfg.index_head_dim
        ix = attn.indexer
        cos, sin = rope_angles(attn.rope_freqs, torch.arange(S))
        q = apply_rope(ix.wq_b(attn.q_norm(attn.wq_a(x))).view(1, S, H, d), cos, sin)[0]
        w = ix.weights_proj(x)[0] / math.sqrt(H * d)
        torch.testing.assert_close(ix.queries(x, attn.q_norm(attn.wq_a(x)), cos, sin)[1][0], w)  # the KL's logits scale
        latent = attn.compressor(x)
        n = latent.shape[1]
        ccos, csin = rope_angles(attn.rope_freqs, torch.arange(n) * 2)
        keys = apply_rope(ix.k_norm(ix.wk(latent)), ccos, csin)[0]
    dots = torch.einsum("thd,jd->thj", q.double(), keys.double())
    scores = (dots.clamp_min(0) * w.double().unsqueeze(-1)).sum(1).tolist()
    n_vis = [(t + 1) // 2 for t in range(S)]  # group j complete at t >= 2j + 1
    assert visible_compressed_at(torch.arange(S), 2).tolist() == n_vis
    topk = shared.topk[0]
    assert topk.shape == (S, k_sel)
    for t in range(S):
        got = [j for j in topk[t].tolist() if j >= 0]
        assert _is_top_k(got, scores[t], n_vis[t], k_sel), (t, got, scores[t][:n_vis[t]])
        assert (topk[t] < 0).sum().item() == k_sel - min(k_sel, n_vis[t]), t
    assert any(v < k_sel for v in n_vis) and sum(v > k_sel for v in n_vis) > S // 2
    # the input distinguishes the formula from plausible wrong ones
    no_relu = _literal_topk((dots * w.double().unsqueeze(-1)).sum(1).tolist(), n_vis, k_sel)
    unweighted = _literal_topk(dots.clamp_min(0).sum(1).tolist(), n_vis, k_sel)
    ahead = _literal_topk(scores, [min(n, v + 1) for v in n_vis], k_sel)
    for variant in (no_relu, unweighted, ahead):
        assert not all(_is_top_k(variant[t], scores[t], n_vis[t], k_sel) for t in range(S))


def test_indexer_kl_by_hand():
    """KL(p || softmax(logits)) over each query's valid entries, p = the main-attention probability summed
    over heads (by the attention core) and renormalised; averaged over the queries that have any valid
    entry."""
    from flashtrain.model.attention import indexer_kl

    probs = torch.tensor([[[[0.1, 0.2, 0.3], [0.3, 0.0, 0.05]],    # query 0: 2 heads x 3 slots
                           [[0.5, 0.1, 0.0], [0.1, 0.2, 0.0]],     # query 1: slot 2 invalid
                           [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]]])   # query 2: nothing valid
    logits = torch.tensor([[[1.0, -0.5, 2.0], [0.3, 0.7, 9.0], [0.0, 0.0, 0.0]]])
    valid = torch.tensor([[[True, True, True], [True, True, False], [False, False, False]]])

    def kl(p, z):
        p = [v / sum(p) for v in p]
        lz = math.log(sum(math.exp(v) for v in z))
        return sum(pi * (math.log(pi) - (zi - lz)) for pi, zi in zip(p, z) if pi > 0)

    want = (kl([0.4, 0.2, 0.35], [1.0, -0.5, 2.0]) + kl([0.6, 0.3], [0.3, 0.7])) / 2
    assert indexer_kl(probs.sum(dim=2), logits, valid).item() == pytest.approx(want, rel=1e-5)


def test_swa_layer_equals_the_literal_per_head_computation(tiny_cfg):
    """A ratio-0 layer written out from the spec, per query and head: q = RoPE(wq_b(q_norm(wq_a x))),
    k = v = RoPE(kv_norm(wkv x)) at the key's position, softmax over the window with scale
    head_dim^-1/2 and exp(sink) in the denominator, inverse RoPE at the query position, then the
    block-diagonal grouped wo_a and wo_b. Pins the softmax scale and the head / group layout."""
    from flashtrain.model.rope import apply_rope, rope_angles

    W = 4
    cfg = dataclasses.replace(tiny_cfg, window_size=W)
    role = _role(cfg, 0)
    assert role.compress_ratio == 0
    torch.manual_seed(5)
    attn = Attention(cfg, role)
    _randomize(attn, std=0.2)
    with torch.no_grad():
        attn.attn_sink.copy_(torch.tensor([0.5, -0.7]))
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.kv_norm.weight.uniform_(0.5, 1.5)
    S, H, D = 10, cfg.n_heads, cfg.head_dim
    x = torch.randn(1, S, cfg.dim)
    with torch.no_grad():
        out = attn(x, SharedKV())[0].double()
        cos, sin = rope_angles(attn.rope_freqs, torch.arange(S))
        q = apply_rope(attn.wq_b(attn.q_norm(attn.wq_a(x))).view(1, S, H, D), cos, sin)[0].double()
        kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin)[0].double()
        wo_a = attn.wo_a.weight.double().view(cfg.o_groups, cfg.o_lora_rank, -1)
        wo_b = attn.wo_b.weight.double()
    heads_per_group = H // cfg.o_groups
    for t in range(S):
        keys = range(max(0, t - W + 1), t + 1)
        o = []
        for h in range(H):
            logits = [float(q[t, h] @ kv[p]) / math.sqrt(D) for p in keys]
            den = sum(math.exp(v) for v in logits) + math.exp(attn.attn_sink[h].item())
            o.append(sum(math.exp(v) / den * kv[p] for v, p in zip(logits, keys)))
        o = apply_rope(torch.stack(o).unsqueeze(0).float(), cos[t:t + 1], sin[t:t + 1], inverse=True)[0].double()
        grouped = torch.cat([wo_a[g] @ o[g * heads_per_group:(g + 1) * heads_per_group].flatten()
                             for g in range(cfg.o_groups)])
        torch.testing.assert_close(out[t], wo_b @ grouped, atol=1e-5, rtol=1e-4)


def _official_picks(scores: torch.Tensor, n_vis: torch.Tensor, k: int) -> list[set[int]]:
    """The public indexer's last two lines, literally: topk of the (pool-masked) scores, then every pick
    whose index is visible is kept, whatever its score."""
    idx = scores.topk(k, dim=-1, sorted=False).indices
    kept = torch.where(idx < n_vis.unsqueeze(-1), idx, -1)
    return [set(row[row >= 0].tolist()) for row in kept.reshape(-1, k)]


def test_short_pool_keeps_visible_picks_as_the_public_code_does():
    """Divergence (a) of issue 16, hand-made: 8 entries, blocks of 2, top-k 8 = every entry (the case where
    the public code's picks are defined without tie-breaking). Query 0 sees 8 entries, its pool is block 1
    (entries 2, 3); query 1 sees 5 entries with pool blocks 0 and 2 (entries 0, 1, 4). The public code keeps
    all visible entries; dropping the -inf picks (the former rule) would leave only the pool."""
    from flashtrain.model.attention import keep_visible_outside_pool, top_indices

    n_vis = torch.tensor([8, 5])
    cands = torch.tensor([[[1, -1]], [[0, 2]]]).view(1, 2, 2)
    pool = candidate_mask(cands, 8, 2)
    torch.manual_seed(0)
    scores = torch.rand(1, 2, 8).masked_fill(torch.arange(8) >= n_vis.unsqueeze(-1), float("-inf"))
    masked = scores.masked_fill(~pool, float("-inf"))
    dropped = top_indices(masked, 8)
    assert [set(r[r >= 0].tolist()) for r in dropped[0]] == [{2, 3}, {0, 1, 4}]
    got = keep_visible_outside_pool(dropped, n_vis, cands, 2)
    assert [set(r[r >= 0].tolist()) for r in got[0]] == [set(range(8)), set(range(5))]
    assert _official_picks(masked, n_vis, 8) == [set(range(8)), set(range(5))]
    # the pool's own picks keep their slots (score order); the top-ups follow, lowest index first
    assert got[0, 0, :2].tolist() == dropped[0, 0, :2].tolist() and got[0, 0, 2:].tolist() == [0, 1, 4, 5, 6, 7]


def test_short_pool_tops_up_with_the_lowest_visible_entries():
    """k < N: the public code's top-ups are torch.topk's pick among equal -inf scores (unspecified);
    flashtrain's are the lowest-index visible entries outside the pool. 16 entries, blocks of 2, k = 4,
    10 visible, pool = block 4 (entries 8, 9): picks 8, 9, then 0, 1. With 3 visible (pool: block 1, of
    which entry 2 is visible) the picks are every visible entry: 2, then 0, 1."""
    from flashtrain.model.attention import keep_visible_outside_pool

    topk = torch.tensor([[[9, 8, -1, -1], [2, -1, -1, -1]]])
    cands = torch.tensor([[[4], [1]]])
    got = keep_visible_outside_pool(topk, torch.tensor([10, 3]), cands, 2)
    assert got.tolist() == [[[9, 8, 0, 1], [2, 0, 1, -1]]]


def test_attention_tops_up_a_short_pool_on_both_selection_paths(tiny_cfg):
    """Through a Reindex layer whose pool (1 block of 2) is smaller than its top-k (4): every query that sees
    at least k entries selects k of them, and the entries outside the pool are the lowest visible ones."""
    cfg = dataclasses.replace(tiny_cfg, candidate_topk_blocks=1, candidate_block_size=2, index_topk=4,
                              compress_ratios=[0, 0] + [2] * 18 + [2] * 20)
    plan = layer_plan(cfg)
    src, reidx = Attention(cfg, plan[20]), Attention(cfg, plan[24])
    assert reidx.pool_may_fall_short and plan[24].uses_candidates
    torch.manual_seed(0)
    _randomize(src), _randomize(reidx)
    S = 32
    x = torch.randn(1, S, cfg.dim)
    shared = SharedKV()
    with torch.no_grad():
        src(x, shared)
        reidx(x, shared)
    topk, cands = shared.topk, shared.candidates
    n_vis = (torch.arange(S) + 1) // 2
    valid = topk >= 0
    torch.testing.assert_close(valid.sum(-1)[0], torch.clamp(n_vis, max=4))
    pool = candidate_mask(cands, S // 2, 2)
    topped_up = 0
    for t in range(S):
        n = int(n_vis[t])
        picks = topk[0, t][valid[0, t]].tolist()
        free = [p for p in range(n) if not pool[0, t, p]]
        inside = min(4, int(pool[0, t, :n].sum()))
        want = free[:max(0, min(4, n) - inside)]
        assert sorted(p for p in picks if not pool[0, t, p]) == want, t
        topped_up += len(want)
    assert topped_up > 0
