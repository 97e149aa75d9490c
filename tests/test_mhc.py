"""Single-pass mHC (V41_SPEC §3) against hand computations."""

import math

import torch

from model.mhc import hc_collapse, hc_expand, hc_split_sinkhorn_reference


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
    from model.mhc import hc_mixes

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
    m[8:24] = torch.arange(16, dtype=torch.float32) / 10
    scale = torch.tensor([0.5, 2.0, 1.0])
    base = torch.zeros(24)
    base[1] = 1.0
    pre, post, comb = hc_split_sinkhorn_reference(m, scale, base, 4, 1, 1e-6)
    sig = lambda v: 1 / (1 + math.exp(-v))
    assert abs(pre[0] - (sig(2.0 * 0.5) + 1e-6)) < 1e-6
    assert abs(pre[1] - (sig(1.0) + 1e-6)) < 1e-6
    assert abs(post[1] - 2 * sig(-2.0)) < 1e-6
    assert abs(post[0] - 1.0) < 1e-6
    # one iteration = row softmax (+eps), then one column normalisation, literally:
    logits = [[(4 * i + j) / 10 for j in range(4)] for i in range(4)]
    rows = [[math.exp(v) / sum(math.exp(u) for u in r) + 1e-6 for v in r] for r in logits]
    cols = [sum(rows[i][j] for i in range(4)) + 1e-6 for j in range(4)]
    want = torch.tensor([[rows[i][j] / cols[j] for j in range(4)] for i in range(4)])
    torch.testing.assert_close(comb, want, atol=1e-6, rtol=0)


def test_collapse_and_expand_by_hand():
    X = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]).view(1, 1, 4, 2)
    A = torch.tensor([0.1, 0.2, 0.3, 0.4]).view(1, 1, 4)
    torch.testing.assert_close(hc_collapse(X, A), torch.tensor([[[5.0, 6.0]]]))
    y = torch.tensor([10.0, 20.0]).view(1, 1, 2)
    C = torch.tensor([1.0, 0.0, 2.0, 0.5]).view(1, 1, 4)
    B = torch.zeros(4, 4)
    B[0, 1] = 1.0  # stream 1 receives stream 0
    B[1, 0] = 1.0  # stream 0 receives stream 1
    B[2, 2] = B[3, 3] = 1.0
    out = hc_expand(y, X, C, B.view(1, 1, 4, 4))[0, 0]
    want = torch.tensor([[10 + 3, 20 + 4], [0 + 1, 0 + 2], [20 + 5, 40 + 6], [5 + 7, 10 + 8]], dtype=torch.float32)
    torch.testing.assert_close(out, want)


def test_init_is_a_plain_residual(tiny_cfg):
    """With identical streams (the embedding copied 4 times) the initial site values (fn aside)
    compute X'_j = X + F(X) exactly; the small random fn keeps it within a few percent."""
    from model.init import init_mhc_site
    from model.mhc import hc_mixes

    D = 8
    fn, base, scale = torch.empty(24, 4 * D), torch.empty(24), torch.empty(3)
    init_mhc_site(fn, base, scale, tiny_cfg)
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
