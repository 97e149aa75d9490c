"""Whole-model behaviour of flash_tiny: training step, aux-loss plumbing, checkpoint names."""

import dataclasses

import torch
import torch.nn.functional as F

from flashtrain.model import Transformer
from flashtrain.model.aux import StepStats


def _lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def test_forward_backward_finite_with_gradients_everywhere(tiny_cfg, tiny_model):
    from conftest import random_image, vl_sample

    torch.manual_seed(0)
    img_a, img_b = random_image(tiny_cfg, 84, 84, seed=1), random_image(tiny_cfg, 120, 90, seed=2)
    t0, y0, im0 = vl_sample(tiny_cfg, [30, img_a, 40, img_b], seed=3)
    S = t0.numel()
    t1 = torch.randint(3, tiny_cfg.image_token_id, (S,))
    tokens, types = torch.stack([t0, t1]), torch.stack([y0, torch.full_like(y0, -1)])
    n_image_pos = int((y0 >= 0).sum())
    stats = StepStats()
    loss = _lm_loss(tiny_model(tokens, types, [im0, []], stats), tokens)
    assert torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(float(tiny_cfg.vocab_size))).item()) < 0.5  # near uniform at init
    loss.backward()
    for name, p in tiny_model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"
    # side channel: one balance loss per MoE layer, one indexer loss per indexer layer, loads per modality
    L = tiny_cfg.n_layers
    assert sorted(stats.balance_loss) == list(range(L))
    assert sorted(stats.indexer_loss) == tiny_cfg.index_source_layers
    k = tiny_cfg.n_activated_experts
    for l in range(L):
        assert stats.expert_load[l][1].sum().item() == n_image_pos * k
        assert stats.expert_load[l][0].sum().item() == (2 * S - n_image_pos) * k


def test_indexer_kl_trains_only_indexer_weights(tiny_cfg):
    """With the balance loss off and the LM loss multiplied by 0, the only gradient left is the
    indexer KL's; its inputs are detached, so it reaches indexer weights and nothing else."""
    cfg = dataclasses.replace(tiny_cfg, balance_loss_alpha=0.0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 96))
    (model(tokens) * 0).sum().backward()
    touched = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert touched, "the indexer KL produced no gradient"
    assert all(".attn.indexer." in n for n in touched), sorted(n for n in touched if ".attn.indexer." not in n)
    for l in cfg.index_source_layers:
        assert f"layers.{l}.attn.indexer.wq_b.weight" in touched
        assert f"layers.{l}.attn.indexer.weights_proj.weight" in touched
    assert "layers.2.attn.indexer.wk.weight" in touched


def test_aux_grad_scale_scales_only_the_aux_gradient(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, indexer_loss_weight=0.0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 64))
    grads = []
    for scale in (1.0, 0.25):
        model.zero_grad()
        (model(tokens, aux_grad_scale=scale) * 0).sum().backward()
        grads.append(model.layers[5].ffn.gate.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0] * 0.25)


def test_image_positions_route_with_bias_vl(tiny_cfg, tiny_model):
    from conftest import random_image, vl_sample

    block = tiny_model.layers[3]
    with torch.no_grad():
        block.ffn.gate.bias_vl[5], block.ffn.gate.bias_vl[2] = 100.0, -100.0
        block.ffn.gate.bias[2], block.ffn.gate.bias[5] = 100.0, -100.0
    tokens, types, images = vl_sample(tiny_cfg, [10, random_image(tiny_cfg, 84, 84), 22])
    n_img = int((types >= 0).sum())
    assert n_img == 8  # START + 2 x (2 IMAGE + NEWLINE) + END
    stats = StepStats()
    with torch.no_grad():
        tiny_model(tokens[None], types[None], [images], stats)
    text, image = stats.expert_load[3]
    assert image[5].item() == n_img and image[2].item() == 0
    assert text[2].item() == 32 and text[5].item() == 0


def test_state_dict_uses_public_checkpoint_names(tiny_model):
    keys = set(tiny_model.state_dict())
    for k in ["embed.weight", "norm.weight", "head.weight",
              "layers.0.attn.wq_a.weight", "layers.0.attn.q_norm.weight", "layers.0.attn.wq_b.weight",
              "layers.0.attn.wkv.weight", "layers.0.attn.kv_norm.weight", "layers.0.attn.wo_a.weight",
              "layers.0.attn.wo_b.weight", "layers.0.attn.attn_sink",
              "layers.2.attn.compressor.wkv.weight", "layers.2.attn.compressor.wgate.weight",
              "layers.2.attn.compressor.norm.weight", "layers.2.attn.indexer.wq_b.weight",
              "layers.2.attn.indexer.weights_proj.weight", "layers.2.attn.indexer.wk.weight",
              "layers.2.attn.indexer.k_norm.weight", "layers.24.attn.indexer.wq_b.weight",
              "layers.0.ffn.gate.weight", "layers.0.ffn.gate.bias", "layers.0.ffn.gate.bias_vl",
              "layers.0.ffn.shared_experts.w1.weight", "layers.0.ffn.shared_experts.w2.weight",
              "layers.0.ffn.shared_experts.w3.weight", "layers.0.ffn.experts.w1",
              "layers.0.attn_norm.weight", "layers.0.ffn_norm.weight",
              "layers.0.hc_attn_fn", "layers.0.hc_attn_base", "layers.0.hc_attn_scale",
              "layers.0.hc_ffn_fn", "layers.0.hc_ffn_base", "layers.0.hc_ffn_scale",
              "layers.1.engram.embed.weight", "layers.1.engram.wkv.weight",
              "layers.1.engram.q_weight", "layers.1.engram.k_weight", "layers.14.engram.embed.weight",
              "vision.patch_embed.proj.weight", "vision.patch_embed.proj.bias", "vision.blocks.0.norm1.weight",
              "vision.blocks.0.attn.wqkv.weight", "vision.blocks.0.attn.wqkv.bias", "vision.blocks.0.attn.wo.bias",
              "vision.blocks.0.norm2.weight", "vision.blocks.0.mlp.w1.weight", "vision.blocks.0.mlp.w2.weight",
              "vision.norm.weight", "aligner.w1.weight", "aligner.w1.bias", "aligner.w2.weight", "aligner.w2.bias",
              "image_start", "image_newline", "image_end"]:
        assert k in keys, k
    assert "layers.20.attn.compressor.wgate.weight" not in keys  # ratio 1: no pooling gate
    assert not any(k.startswith("layers.3.attn.compressor") or k.startswith("layers.3.attn.indexer") for k in keys)
    assert not any(k.startswith("engram_hasher") for k in keys)  # derived state, not checkpointed


def test_two_stage_split_with_shared_kv_crossing_matches_single_pass(tiny_cfg):
    """The explicit carry makes any block range a pipeline stage. Cut between layer 14 (Full) and its
    Reuse layers 15-19, run the stages as separate autograd graphs joined only by detached carry
    tensors (as a pipeline would), and the parameter gradients -- including the aux losses attached
    on the first stage and the second stage's gradient into layer 14's compressor through the shared
    KV -- equal those of one pass."""
    from flashtrain.model.attention import SharedKV
    from flashtrain.model.transformer import Carry

    torch.manual_seed(0)
    model = Transformer(tiny_cfg)
    tokens = torch.randint(3, 400, (2, 64))
    cut = 17

    def loss_of(logits):
        return _lm_loss(logits, tokens)

    loss_of(model(tokens)).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    ctx = model.context(tokens)
    c1 = model.run_blocks(model.embed_inputs(tokens), ctx, 0, cut)
    sent = {"h": c1.h, "pre_mix": c1.pre_mix, "kv": c1.shared.kv, "index_k": c1.shared.index_k}
    recv = {k: v.detach().requires_grad_(v.requires_grad) for k, v in sent.items()}
    shared = SharedKV(recv["kv"], recv["index_k"], c1.shared.topk, c1.shared.candidates)
    c2 = model.run_blocks(Carry(recv["h"], recv["pre_mix"], shared), model.context(tokens), cut)
    loss_of(model.logits(c2)).backward()
    outs, grads = zip(*[(sent[k], recv[k].grad) for k in sent if recv[k].grad is not None])
    assert any(sent[k] is c1.shared.kv for k in sent if recv[k].grad is not None)  # KV gradient crossed
    torch.autograd.backward(list(outs), list(grads))
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
