"""The DSpark drafter (model/dspark.py; V41_SPEC §8b) against independent references: the batched training
forward over every anchor against a literal per-anchor loop that follows the public `forward_spec` step by
step (its attention written out: window of projected context + whole block + sink), the Markov and
confidence heads and the greedy draft loop against hand computations, and the backbone's target-layer
inputs against a layer-by-layer run."""

import pytest
import torch

from flashtrain.model.dspark import DSpark, block_tokens, context_features
from flashtrain.model.mhc import hc_collapse, hc_expand, hc_mixes, one_hot_pre
from flashtrain.model.rope import apply_rope, rope_angles


@pytest.fixture(scope="module")
def drafter(tiny_cfg):
    torch.manual_seed(0)
    d = DSpark(tiny_cfg, seed=3)
    with torch.no_grad():  # non-degenerate: sinks, norms and mHC biases away from their initial values
        for name, p in d.named_parameters():
            if name.endswith(("attn_sink", "norm.weight", "_base", "_scale")):
                p.add_(0.3 * torch.randn_like(p))
        for block in d.mtp:
            block.ffn.gate.bias.copy_(0.05 * torch.randn_like(block.ffn.gate.bias))
    return d


def literal_attention(attn, x, main_x, t, K, W):
    """The public DSparkAttention for one anchor t: x [B, K, dim] the block, main_x [B, S, dim] the context.
    Keys: kv_norm(wkv(.)) of the context positions max(0, t - W + 1) .. t (RoPE at their positions) and of
    the K block positions t + 1 .. t + K; one softmax per (query, head) over them and the head's sink."""
    B = x.shape[0]
    H, hd = attn.n_heads, attn.head_dim
    ctx_pos = torch.arange(max(0, t - W + 1), t + 1)
    blk_pos = torch.arange(t + 1, t + 1 + K)
    c_cos, c_sin = rope_angles(attn.rope_freqs, ctx_pos)
    b_cos, b_sin = rope_angles(attn.rope_freqs, blk_pos)
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(B, K, H, hd)
    q = apply_rope(q, b_cos, b_sin)
    kv = torch.cat([apply_rope(attn.kv_norm(attn.wkv(main_x[:, ctx_pos])), c_cos, c_sin),
                    apply_rope(attn.kv_norm(attn.wkv(x)), b_cos, b_sin)], dim=1)  # [B, n, hd]
    s = torch.einsum("bkhd,bnd->bkhn", q, kv) * hd ** -0.5
    sink = attn.attn_sink.view(1, 1, H, 1).expand(B, K, H, 1)
    w = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]  # the sink adds to the denominator only
    out = torch.einsum("bkhn,bnd->bkhd", w, kv)
    out = apply_rope(out, b_cos, b_sin, inverse=True).reshape(B, K, attn.n_groups, -1)
    wo_a = attn.wo_a.weight.view(attn.n_groups, attn.o_lora_rank, -1)
    return attn.wo_b(torch.einsum("bkgd,grd->bkgr", out, wo_a).flatten(2))


def literal_forward_spec(d, main_hidden, first, embed, t):
    """forward_spec for anchor t: main_x = main_norm(main_proj(main_hidden)); the block [first, noise ...]
    embedded, copied to the 4 streams, one-hot pre; each DSpark block with the literal attention; the
    last pending pre collapses. Returns x [B, K, dim] (before the final norm)."""
    cfg = d.cfg
    K, W = cfg.dspark_block_size, cfg.window_size
    main_x = d.mtp[0].main_norm(d.mtp[0].main_proj(main_hidden))
    ids = torch.full((first.shape[0], K), cfg.dspark_noise_token_id)
    ids[:, 0] = first
    h = embed(ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
    pre = one_hot_pre(h)
    for blk in d.mtp:
        args = (cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        a_pre, a_post, a_comb = hc_mixes(h, blk.hc_attn_fn, blk.hc_attn_scale, blk.hc_attn_base, *args)
        x = literal_attention(blk.attn, blk.attn_norm(hc_collapse(h, pre)), main_x, t, K, W)
        h = hc_expand(x, h, a_post, a_comb)
        f_pre, f_post, f_comb = hc_mixes(h, blk.hc_ffn_fn, blk.hc_ffn_scale, blk.hc_ffn_base, *args)
        x = blk.ffn(blk.ffn_norm(hc_collapse(h, a_pre)), None)
        h = hc_expand(x, h, f_post, f_comb)
        pre = f_pre
    return hc_collapse(h, pre)


def literal_forward_head(d, x, first, head):
    """forward_head at temperature 0: logits_k = head(norm(x_k)) + markov.head(markov.embed(prev_k)), prev_0 =
    the block's first token, prev_{k+1} = argmax logits_k; confidence_k = proj . [x_k (not normed),
    markov.embed(prev_k)]."""
    last = d.mtp[-1]
    E, Wm, w = last.markov_head.embed.weight, last.markov_head.head.weight, last.confidence_head.proj.weight[0]
    prev, toks, logits, conf = first, [], [], []
    for k in range(x.shape[1]):
        z = head(last.norm(x[:, k])) + E[prev] @ Wm.T
        conf.append(torch.cat([x[:, k], E[prev]], dim=-1) @ w)
        prev = z.argmax(-1)
        toks.append(prev)
        logits.append(z)
    return torch.stack(toks, 1), torch.stack(logits, 1), torch.stack(conf, 1)


def test_batched_forward_equals_per_anchor_forward_spec(drafter, tiny_cfg):
    """Every anchor of two sequences in one pass (windows clipped at the start and full later: S = 24 > W = 16)
    equals the literal per-anchor loop: the hidden states, and the greedy draft's logits (Markov bias of the
    previous drafted token) and confidence."""
    cfg = tiny_cfg
    torch.manual_seed(1)
    B, S, K = 2, 20, cfg.dspark_block_size
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.dim)
    head = torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
    main_hidden = torch.randn(B, S, len(cfg.dspark_target_layer_ids) * cfg.dim)
    first = torch.randint(3, 490, (B, S))
    with torch.no_grad():
        x = drafter.hidden(main_hidden, block_tokens(first, K, cfg.dspark_noise_token_id), embed)
        assert x.shape == (B, S, K, cfg.dim)
        for t in range(S):
            ref = literal_forward_spec(drafter, main_hidden, first[:, t], embed, t)
            torch.testing.assert_close(x[:, t], ref, rtol=1e-4, atol=1e-5, msg=f"anchor {t}")
            tok, logits, conf = drafter.draft(x[:, t], first[:, t], head)
            rtok, rlogits, rconf = literal_forward_head(drafter, ref, first[:, t], head)
            torch.testing.assert_close(logits, rlogits, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(conf, rconf, rtol=1e-4, atol=1e-5)
            assert torch.equal(tok, rtok)
    # the inputs tell a window from no window and one anchor from another
    assert (x[:, 19] - x[:, 18]).abs().max() > 1e-2


def test_batched_forward_gradient_flows_to_every_drafter_parameter(drafter, tiny_cfg):
    cfg = tiny_cfg
    B, S, K = 1, 8, cfg.dspark_block_size
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.dim).requires_grad_(False)
    main_hidden = torch.randn(B, S, len(cfg.dspark_target_layer_ids) * cfg.dim)
    tokens = block_tokens(torch.randint(3, 490, (B, S)), K, cfg.dspark_noise_token_id)
    x = drafter.hidden(main_hidden, tokens, embed)
    bias, e = drafter.markov(tokens)
    (x.square().sum() + drafter.confidence(x, e).sum() + bias.square().mean()
     + drafter.base_logits(x, torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)).mean()).backward()
    missing = [n for n, p in drafter.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    drafter.zero_grad(set_to_none=True)
    assert not missing


def test_markov_and_confidence_heads_by_hand(drafter, tiny_cfg):
    """bias[v] = sum_r head[v, r] embed[prev, r]; confidence = w . [x, embed[prev]] -- in Python floats."""
    mh, ch = drafter.mtp[-1].markov_head, drafter.mtp[-1].confidence_head
    r = tiny_cfg.dspark_markov_rank
    prev = torch.tensor([7, 300])
    bias, e = mh(prev)
    E, Hd = mh.embed.weight.tolist(), mh.head.weight.tolist()
    for i, p in enumerate(prev.tolist()):
        for v in (0, 5, 123, 511):
            want = sum(Hd[v][j] * E[p][j] for j in range(r))
            assert abs(bias[i, v].item() - want) < 1e-6
    x = torch.randn(2, tiny_cfg.dim)
    c = ch(x, e)
    w = ch.proj.weight[0].tolist()
    for i in range(2):
        feats = x[i].tolist() + e[i].tolist()
        assert abs(c[i].item() - sum(a * b for a, b in zip(w, feats))) < 1e-5


def test_greedy_draft_loop_by_hand(tiny_cfg):
    """Vocab 6, rank 2, block 3: the Markov bias of the previously drafted token changes the argmax chain
    (without it every position would pick token 1)."""
    from flashtrain.model.dspark import DSparkMarkovHead

    mh = DSparkMarkovHead(6, 2)
    with torch.no_grad():
        mh.embed.weight.copy_(torch.tensor([[0.0, 0], [1, 0], [0, 1], [0, 0], [1, 1], [0, 0]]))
        # bias[v] = head[v] . embed[prev]: after token 1 -> token 4 gets +3; after 4 -> token 2 gets +3 + 1
        mh.head.weight.copy_(torch.tensor([[0.0, 0], [0, 0], [1, 3], [0, 0], [3, 0], [0, 0]]))
    base = torch.tensor([[[0.0, 2.0, 0.5, 0.0, 0.0, 0.0]] * 3])  # [1, K=3, V=6]

    class Stub:
        markov = mh.forward

        def base_logits(self, x, head):
            return base.clone()

        def confidence(self, x, e):
            return e.sum(-1)

    tok, logits, conf = DSpark.draft(Stub(), torch.zeros(1, 3, 4), torch.tensor([1]), None)
    # k=0: prev 1 -> bias [0,0,0,0,1... ] head.embed[1] = column 0: [0,0,1,0,3,0] -> 0,2,1.5,0,3 -> token 4
    # k=1: prev 4 -> embed [1,1]: bias [0,0,4,0,3,0] -> 0,2,4.5,0,3 -> token 2
    # k=2: prev 2 -> embed [0,1]: bias [0,0,3,0,0,0] -> 0,2,3.5,0,0 -> token 2
    assert tok.tolist() == [[4, 2, 2]]
    assert logits[0, 1, 2].item() == pytest.approx(4.5)
    assert conf.tolist() == [[1.0, 2.0, 1.0]]  # sums of the embeddings of tokens 1, 4, 2


def test_target_layer_inputs_are_hc_means():
    """`ForwardContext.captures` holds, for each target layer, the mean over the 4 streams of that layer's
    input (after its Engram): the same as running the blocks before it and averaging the carry."""
    from layer_plans import FOUR_LAYERS

    from flashtrain.model import Transformer
    from flashtrain.train.config import compose, model_config

    cfg = model_config(compose(["+exp=flash_tiny", *FOUR_LAYERS]))
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(3, 490, (2, 32))
    targets = [1, 3]  # 1 carries Engram: the capture follows the Engram update
    with torch.no_grad():
        ctx = model.context(tokens)
        ctx.captures = dict.fromkeys(targets)
        model.run_blocks(model.embed_inputs(tokens), ctx)
        feats = context_features(ctx.captures, targets)
        for j, layer in enumerate(targets):
            ctx2 = model.context(tokens)
            carry = model.run_blocks(model.embed_inputs(tokens), ctx2, 0, layer)
            h = carry.h
            blk = model.layers[layer]
            if blk.engram is not None:
                h = blk.engram(h, ctx2.engram_ids[:, :, blk.engram.index], None)
            want = h.mean(dim=2)
            torch.testing.assert_close(feats[..., j * cfg.dim:(j + 1) * cfg.dim], want)
    assert not torch.equal(feats[..., :cfg.dim], feats[..., cfg.dim:2 * cfg.dim])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_drafter_blocks_give_the_same_gradients(drafter, tiny_cfg, mode):
    """train.recompute (exp=flash: full) on the drafter's blocks: the context (`ForwardContext.draft`) reaches
    the recomputation; gradients equal the kept-activation run's."""
    cfg = tiny_cfg
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.dim).requires_grad_(False)
    main_hidden = torch.randn(2, 6, len(cfg.dspark_target_layer_ids) * cfg.dim)
    tokens = block_tokens(torch.randint(3, 490, (2, 6)), cfg.dspark_block_size, cfg.dspark_noise_token_id)
    grads = []
    for m in ("none", mode):
        drafter.set_recompute(m)
        drafter.zero_grad(set_to_none=True)
        drafter.hidden(main_hidden, tokens, embed).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
    drafter.set_recompute("none")
    drafter.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 50
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6, msg=n)
