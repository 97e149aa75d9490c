"""Single-pass mHC (V41_SPEC §3) against hand computations."""

import math

import torch

from flashtrain.model.mhc import hc_collapse, hc_expand, hc_split_sinkhorn_reference


def test_comb_is_doubly_stochastic():
    """Columns are exact (the schedule ends on a column step); rows converge to 1e-5 for mix logits of
    the spread the model produces (std 0.5 here). With 20 iterations rows of much more spread logits
    stay ~1e-3 (std 1) to ~4e-2 (std 2) off: a property of the published schedule, kept as is."""
    torch.manual_seed(0)
    mixes = torch.randn(4096, 24) * 0.5
    scale = torch.tensor([1.0, 1.0, 1.0])
    base = torch.zeros(24)
    _, _, comb = hc_split_sinkhorn_reference(mixes, scale, base, 4, 20, 1e-6)
    assert comb.shape == (4096, 4, 4)
    assert (comb > 0).all()
    torch.testing.assert_close(comb.sum(-1), torch.ones(4096, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(4096, 4), atol=1e-5, rtol=0)
    wide = torch.randn(4096, 24) * 3
    _, _, comb = hc_split_sinkhorn_reference(wide, scale, base, 4, 20, 1e-6)
    torch.testing.assert_close(comb.sum(-2), torch.ones(4096, 4), atol=1e-5, rtol=0)


def test_model_sites_are_doubly_stochastic(tiny_model, tiny_cfg):
    """The mixes every site of the model produces on real hidden states."""
    from flashtrain.model.mhc import hc_mixes

    captured = []
    for block in tiny_model.layers:
        for site in ("attn", "ffn"):
            fn, base, scale = (getattr(block, f"hc_{site}_{k}") for k in ("fn", "base", "scale"))
            block.register_forward_pre_hook(
                lambda mod, args, fn=fn, base=base, scale=scale: captured.append(
                    hc_mixes(args[0].h, fn, scale, base, tiny_cfg.norm_eps, tiny_cfg.hc_eps, 20)[2]))
    tokens = torch.randint(0, tiny_cfg.vocab_size, (2, 64))
    with torch.no_grad():
        tiny_model(tokens)
    assert len(captured) == 2 * tiny_cfg.n_layers
    for comb in captured:
        torch.testing.assert_close(comb.sum(-1), torch.ones(comb.shape[:-1]), atol=1e-5, rtol=0)
        torch.testing.assert_close(comb.sum(-2), torch.ones(comb.shape[:-1]), atol=1e-5, rtol=0)


def test_pre_post_comb_formulas_by_hand():
    m = torch.zeros(24)
    m[0], m[5] = 2.0, -1.0
    m[8:24] = torch.tensor([0.3, -1.2, 0.8, 0.0, 1.5, 0.1, -0.4, 0.9, -0.7, 0.2, 2.0, -1.0, 0.6, 0.4, -0.3, 1.1])
    scale = torch.tensor([0.5, 2.0, 1.0])
    base = torch.zeros(24)
    base[1] = 1.0
    pre, post, comb = hc_split_sinkhorn_reference(m, scale, base, 4, 1, 1e-6)
    def sig(v):
        return 1 / (1 + math.exp(-v))
    assert abs(pre[0] - (sig(2.0 * 0.5) + 1e-6)) < 1e-6
    assert abs(pre[1] - (sig(1.0) + 1e-6)) < 1e-6
    assert abs(post[1] - 2 * sig(-2.0)) < 1e-6
    assert abs(post[0] - 1.0) < 1e-6
    # one iteration = row softmax (+eps), then one column normalisation, literally:
    logits = [[m[8 + 4 * i + j].item() for j in range(4)] for i in range(4)]
    rows = [[math.exp(v) / sum(math.exp(u) for u in r) + 1e-6 for v in r] for r in logits]
    cols = [sum(rows[i][j] for i in range(4)) + 1e-6 for j in range(4)]
    want = torch.tensor([[rows[i][j] / cols[j] for j in range(4)] for i in range(4)])
    torch.testing.assert_close(comb, want, atol=1e-6, rtol=0)


def test_collapse_and_expand_by_hand():
    """X'_j = C_j y + sum_i B_ij X_i: B's first index is the source stream. B here is a 3-cycle plus a
    non-symmetric spread, so a transposed B gives other numbers."""
    X = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]).view(1, 1, 4, 2)
    A = torch.tensor([0.1, 0.2, 0.3, 0.4]).view(1, 1, 4)
    torch.testing.assert_close(hc_collapse(X, A), torch.tensor([[[5.0, 6.0]]]))
    y = torch.tensor([10.0, 20.0]).view(1, 1, 2)
    C = torch.tensor([1.0, 0.0, 2.0, 0.5]).view(1, 1, 4)
    B = torch.zeros(4, 4)
    B[0, 1] = 1.0  # stream 1 receives stream 0
    B[1, 2] = 1.0  # stream 2 receives stream 1
    B[2, 0] = 1.0  # stream 0 receives stream 2
    B[3, 3], B[3, 0] = 0.75, 0.25  # stream 3 keeps 3/4 of itself and gives 1/4 to stream 0
    out = hc_expand(y, X, C, B.view(1, 1, 4, 4))[0, 0]
    want = torch.tensor([[10 + 5 + 0.25 * 7, 20 + 6 + 0.25 * 8], [0 + 1, 0 + 2], [20 + 3, 40 + 4],
                         [5 + 0.75 * 7, 10 + 0.75 * 8]])
    torch.testing.assert_close(out, want)


def literal_site(m, scale, base, iters, eps=1e-6):
    """V41_SPEC §3 for one token, in Python floats: m is the 24 mix values of the site."""
    def sig(v):
        return 1 / (1 + math.exp(-v))
    pre = [sig(m[i] * scale[0] + base[i]) + eps for i in range(4)]
    post = [2 * sig(m[4 + i] * scale[1] + base[4 + i]) for i in range(4)]
    logits = [[m[8 + 4 * i + j] * scale[2] + base[8 + 4 * i + j] for j in range(4)] for i in range(4)]
    B = [[math.exp(v) / sum(math.exp(u) for u in row) + eps for v in row] for row in logits]

    def normalise_columns(B):
        cols = [sum(B[i][j] for i in range(4)) + eps for j in range(4)]
        return [[B[i][j] / cols[j] for j in range(4)] for i in range(4)]

    B = normalise_columns(B)
    for _ in range(iters - 1):
        B = [[v / (sum(row) + eps) for v in row] for row in B]
        B = normalise_columns(B)
    return pre, post, B


def test_split_sinkhorn_equals_the_literal_schedule_on_random_logits():
    """Random mixes, scales and bases (rows of comb far from uniform): pre, post and comb equal the
    spec's formulas with exactly 20 Sinkhorn iterations; 19 or 21 would give visibly other numbers."""
    g = torch.Generator().manual_seed(0)
    mixes = torch.randn(16, 24, generator=g) * 2.0
    scale = torch.tensor([0.7, 1.3, 0.9])
    base = torch.randn(24, generator=g)
    pre, post, comb = hc_split_sinkhorn_reference(mixes, scale, base, 4, 20, 1e-6)
    for t in range(16):
        m = mixes[t].tolist()
        lp, lq, lb = literal_site(m, scale.tolist(), base.tolist(), 20)
        torch.testing.assert_close(pre[t], torch.tensor(lp), atol=1e-6, rtol=0)
        torch.testing.assert_close(post[t], torch.tensor(lq), atol=1e-6, rtol=0)
        torch.testing.assert_close(comb[t], torch.tensor(lb), atol=2e-6, rtol=0)
    off = max(max(abs(a - b)
                  for ra, rb in zip(literal_site(mixes[t].tolist(), scale.tolist(), base.tolist(), it)[2],
                                    literal_site(mixes[t].tolist(), scale.tolist(), base.tolist(), 20)[2])
                  for a, b in zip(ra, rb)) for t in range(16) for it in (19, 21))
    assert off > 20 * 2e-6  # so the comparison above can tell the iteration count


def test_site_mixes_use_one_rms_statistic_per_token():
    """m = (flatten(X) . fn^T) * rsqrt(mean(X^2) + eps) over all 4 D values of the token, no weight."""
    from flashtrain.model.mhc import hc_mixes

    g = torch.Generator().manual_seed(1)
    D = 3
    h = torch.randn(1, 2, 4, D, generator=g) * torch.tensor([1.0, 3.0, 0.5, 2.0]).view(1, 1, 4, 1)
    fn = torch.randn(24, 4 * D, generator=g)
    scale, base = torch.tensor([0.5, 1.5, 1.0]), torch.randn(24, generator=g)
    pre, post, comb = hc_mixes(h, fn, scale, base, 1e-20, 1e-6, 20)
    for t in range(2):
        x = h[0, t].flatten().tolist()
        r = 1 / math.sqrt(sum(v * v for v in x) / len(x) + 1e-20)
        m = [sum(a * b for a, b in zip(row, x)) * r for row in fn.tolist()]
        lp, lq, lb = literal_site(m, scale.tolist(), base.tolist(), 20)
        torch.testing.assert_close(pre[0, t], torch.tensor(lp), atol=1e-5, rtol=0)
        torch.testing.assert_close(post[0, t], torch.tensor(lq), atol=1e-5, rtol=0)
        torch.testing.assert_close(comb[0, t], torch.tensor(lb), atol=1e-5, rtol=0)


def test_block_applies_the_single_pass_shift(tiny_cfg):
    """One block (layer 0) with its attention and FFN replaced by fixed nonlinear maps and random mHC
    parameters, against the spec written out per token: the attention site collapses X with the
    *incoming* pending pre, the FFN site with the attention site's pre, each expands with its own post
    and comb (computed from the streams it updates), and the block hands on the FFN site's pre."""
    from flashtrain.model.attention import SharedKV
    from flashtrain.model.layer_plan import layer_plan
    from flashtrain.model.transformer import Block, Carry, ForwardContext

    cfg = tiny_cfg
    D = cfg.dim
    block = Block(cfg, layer_plan(cfg)[0], None)
    g = torch.Generator().manual_seed(2)
    Ma, Mf = torch.randn(D, D, generator=g) / math.sqrt(D), torch.randn(D, D, generator=g) / math.sqrt(D)

    class Fixed(torch.nn.Module):
        def __init__(self, M):
            super().__init__()
            self.M = M

        def forward(self, x, *rest):
            return torch.tanh(x @ self.M)

    block.attn, block.ffn = Fixed(Ma), Fixed(Mf)
    with torch.no_grad():
        for site in ("attn", "ffn"):
            getattr(block, f"hc_{site}_fn").copy_(torch.randn(24, 4 * D, generator=g) / math.sqrt(4 * D))
            getattr(block, f"hc_{site}_base").copy_(torch.randn(24, generator=g) * 0.5)
            getattr(block, f"hc_{site}_scale").copy_(torch.rand(3, generator=g) + 0.5)
            getattr(block, f"{site}_norm").weight.copy_(torch.rand(D, generator=g) + 0.5)
    S = 3
    h = torch.randn(1, S, 4, D, generator=g)
    incoming = torch.rand(1, S, 4, generator=g) + 0.1
    with torch.no_grad():
        out = block(Carry(h, incoming, SharedKV()), ForwardContext(None, None, None))

    def rmsnorm(v, w):
        r = 1 / math.sqrt(sum(a * a for a in v) / len(v) + cfg.norm_eps)
        return torch.tensor([a * r for a in v], dtype=torch.float64) * w.double()

    def site(X, name):
        x = X.flatten().tolist()
        r = 1 / math.sqrt(sum(v * v for v in x) / len(x) + cfg.norm_eps)
        m = [sum(a * b for a, b in zip(row, x)) * r for row in getattr(block, f"hc_{name}_fn").tolist()]
        return literal_site(m, getattr(block, f"hc_{name}_scale").tolist(), getattr(block, f"hc_{name}_base").tolist(),
                            cfg.hc_sinkhorn_iters, cfg.hc_eps)

    def sublayer(X, pre_in, name, M):
        pre, post, B = site(X, name)
        y = torch.tanh(rmsnorm(sum(pre_in[i] * X[i] for i in range(4)).tolist(),
                               getattr(block, f"{name}_norm").weight) @ M.double())
        return torch.stack([post[j] * y + sum(B[i][j] * X[i] for i in range(4)) for j in range(4)]), pre

    for t in range(S):
        X = h[0, t].double()
        X1, attn_pre = sublayer(X, incoming[0, t].tolist(), "attn", Ma)
        X2, ffn_pre = sublayer(X1, attn_pre, "ffn", Mf)
        torch.testing.assert_close(out.h[0, t].double(), X2, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out.pre_mix[0, t].double(), torch.tensor(ffn_pre, dtype=torch.float64),
                                   atol=1e-6, rtol=0)


def test_init_is_a_plain_residual(tiny_cfg):
    """With identical streams (the embedding copied 4 times) the initial site values (fn aside)
    compute X'_j = X + F(X) exactly; the small random fn keeps it within a few percent."""
    from flashtrain.model.init import init_mhc_site
    from flashtrain.model.mhc import hc_mixes

    D = 8
    fn, base, scale = torch.empty(24, 4 * D), torch.empty(24), torch.empty(3)
    init_mhc_site(fn, base, scale, tiny_cfg, lambda t, std: t.normal_(0.0, std))
    assert 0 < fn.std() < 2 * tiny_cfg.hc_fn_init_scale / math.sqrt(4 * D)
    x = torch.randn(2, 3, D)
    h = x.unsqueeze(2).expand(-1, -1, 4, -1).contiguous()
    f = torch.randn(2, 3, D)
    for fn_used, tol in ((torch.zeros_like(fn), 1e-5), (fn, 0.2)):
        pre, post, comb = hc_mixes(h, fn_used, scale, base, 1e-20, 1e-6, 20)
        torch.testing.assert_close(hc_collapse(h, pre), x, atol=tol * x.abs().max().item(), rtol=0)
        out = hc_expand(f, h, post, comb)
        for j in range(4):
            torch.testing.assert_close(out[:, :, j], x + f, atol=tol * (x.abs().max() + f.abs().max()).item(), rtol=0)
