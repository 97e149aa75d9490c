"""The vision path (V41_SPEC §6): preprocessing, token layout, 2D RoPE, pixel-unshuffle, image
isolation, causality around images, freezing."""

import io
import math

import pytest
import torch
from conftest import random_image, vl_sample
from PIL import Image

from flashtrain.data.images import (
    ImageDecodeError,
    ImageProcessorConfig,
    image_token_types,
    load_image,
    num_image_positions,
    plan_image_size,
)
from flashtrain.model.vision import (
    apply_rope_2d,
    encode_images,
    is_vision_body,
    pixel_unshuffle,
    set_vision_body_trainable,
    vision_rope_angles,
)

FLASH = ImageProcessorConfig(patch_size=14, downsample_ratio=3, max_n_token=1024, min_pixels=544 * 544)


def _png(width, height, color=(200, 30, 30)):
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def test_1302_square_is_31x31_tokens_in_994_positions():
    img = load_image(_png(1302, 1302), FLASH)
    assert (img.n_vit_h, img.n_vit_w) == (93, 93)
    assert (img.n_llm_h, img.n_llm_w) == (31, 31)
    assert num_image_positions(img.n_llm_h, img.n_llm_w) == 31 * 32 + 2 == 994
    assert img.pixels.shape == (3, 1302, 1302)
    types = img.token_types()
    assert types.numel() == 994 and int((types == 1).sum()) == 31 * 31 and int((types == 2).sum()) == 31


def test_1344_square_is_shrunk_to_fit_1024_positions():
    n_h, n_w, H, W = plan_image_size(1344, 1344, FLASH)
    # unshrunk it would be 96 patches -> 32 x 32 tokens -> 1058 positions
    assert math.ceil(1344 / 14 / 3) * (math.ceil(1344 / 14 / 3) + 1) + 2 == 1058
    assert n_h * (n_w + 1) + 2 <= 1024
    assert H < 1344 and W < 1344 and H % 14 == 0 and W % 14 == 0
    assert n_h == n_w == 31  # the largest square grid with h (h + 1) + 2 <= 1024: 31 -> 994, 32 -> 1058


def test_small_image_is_upscaled_to_min_pixels():
    img = load_image(_png(100, 80), FLASH)
    H, W = img.pixels.shape[1:]
    assert H * W >= 544 * 544
    assert abs(W / H - 100 / 80) * H <= 14  # aspect kept within a patch


@pytest.mark.parametrize("w, h", [(2000, 1000), (700, 1500), (1303, 917)])
def test_non_square_keeps_aspect_within_one_patch(w, h):
    n_h, n_w, H, W = plan_image_size(w, h, FLASH)
    assert n_h * (n_w + 1) + 2 <= 1024
    assert abs(W - H * w / h) <= 14 or abs(H - W * h / w) <= 14


def test_padding_is_gray_and_normalisation():
    img = load_image(_png(700, 1500, color=(255, 0, 0)), FLASH)
    px = img.pixels
    # red content normalises to (1, -1, -1); gray 127 padding to 127/255*2-1
    gray = 127 / 255 * 2 - 1
    centre = px[:, px.shape[1] // 2, px.shape[2] // 2]
    torch.testing.assert_close(centre, torch.tensor([1.0, -1.0, -1.0]))
    # 700 x 1500 -> 700 x 1512 (108 patches high): 6 rows of gray above and below the content
    assert px.shape == (3, 1512, 700)
    torch.testing.assert_close(px[:, :6, :], torch.full((3, 6, 700), gray), atol=1e-6, rtol=0)
    torch.testing.assert_close(px[:, -6:, :], torch.full((3, 6, 700), gray), atol=1e-6, rtol=0)
    torch.testing.assert_close(px[:, 6, 0], torch.tensor([1.0, -1.0, -1.0]))


def test_corrupt_bytes_raise_typed_error():
    good = _png(50, 50)
    with pytest.raises(ImageDecodeError):
        load_image(good[: len(good) // 2], FLASH)
    with pytest.raises(ImageDecodeError):
        load_image(b"definitely not an image", FLASH)


def test_token_type_layout():
    assert image_token_types(2, 3).tolist() == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]


def test_pixel_unshuffle_channel_order_by_hand():
    # 4 x 4 patch grid, 2 channels, r = 3: padded to 6 x 6, cells in reading order
    n_h, n_w, C, r = 4, 4, 2, 3
    x = torch.zeros(n_h * n_w, C)
    for i in range(n_h):
        for j in range(n_w):
            for c in range(C):
                x[i * n_w + j, c] = 100 * c + 10 * i + j
    out = pixel_unshuffle(x, n_h, n_w, r)
    assert out.shape == (4, C * 9)
    for cell, (ci, cj) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        for c in range(C):
            for kh in range(3):
                for kw in range(3):
                    i, j = 3 * ci + kh, 3 * cj + kw
                    want = 100 * c + 10 * i + j if (i < n_h and j < n_w) else 0.0
                    assert out[cell, c * 9 + kh * 3 + kw].item() == want, (cell, c, kh, kw)


def test_2d_rope_rows_for_one_half_columns_for_the_other():
    head_dim, theta = 16, 10000.0
    R = head_dim // 2  # rot_dim
    n_h, n_w = 3, 5
    cos, sin = vision_rope_angles(n_h, n_w, R, theta)
    x = torch.randn(n_h * n_w, 1, head_dim)
    y = apply_rope_2d(x, cos, sin)
    f = [theta ** (-2 * i / R) for i in range(R // 2)]
    for n in range(n_h * n_w):
        row, col = divmod(n, n_w)
        for i in range(R // 2):
            for (a, b), ang in (((i, i + R), row * f[i]), ((R // 2 + i, R // 2 + i + R), col * f[i])):
                xa, xb = x[n, 0, a].item(), x[n, 0, b].item()
                assert abs(y[n, 0, a].item() - (xa * math.cos(ang) - xb * math.sin(ang))) < 1e-5
                assert abs(y[n, 0, b].item() - (xb * math.cos(ang) + xa * math.sin(ang))) < 1e-5


def test_images_do_not_attend_to_each_other(tiny_cfg, tiny_model):
    a, b = random_image(tiny_cfg, 84, 84, seed=1), random_image(tiny_cfg, 84, 84, seed=2)
    c = random_image(tiny_cfg, 126, 84, seed=3)
    with torch.no_grad():
        base = encode_images(tiny_model.vision, tiny_model.aligner, [a.pixels, b.pixels, c.pixels])
        perturbed = a.pixels + torch.randn_like(a.pixels)
        out = encode_images(tiny_model.vision, tiny_model.aligner, [perturbed, b.pixels, c.pixels])
    assert not torch.allclose(out[0], base[0])
    torch.testing.assert_close(out[1], base[1])  # same size: ran in the same ViT batch
    torch.testing.assert_close(out[2], base[2])
    assert base[2].shape[0] == c.n_llm_h * c.n_llm_w


def test_text_after_an_image_sees_it_text_before_does_not(tiny_cfg, tiny_model):
    img = random_image(tiny_cfg, 84, 84, seed=1)
    tokens, types, images = vl_sample(tiny_cfg, [20, img, 20])
    span = slice(20, 20 + num_image_positions(img.n_llm_h, img.n_llm_w))
    with torch.no_grad():
        base = tiny_model(tokens[None], types[None], [images])
        other = tiny_model(tokens[None], types[None], [[images[0] + torch.randn_like(images[0])]])
    torch.testing.assert_close(other[0, :20], base[0, :20])
    assert not torch.allclose(other[0, span.stop:], base[0, span.stop:])


def test_mismatched_image_positions_are_an_error(tiny_cfg, tiny_model):
    img = random_image(tiny_cfg, 84, 84)
    tokens, types, images = vl_sample(tiny_cfg, [10, img, 10])
    types = types.clone()
    types[11] = -1  # drop one IMAGE position
    with pytest.raises(ValueError, match="3 IMAGE positions.*4 aligner rows"):
        tiny_model(tokens[None], types[None], [images])
    # checked on the device without a host read (torch._assert_async: raised here, asynchronously on CUDA)
    with pytest.raises(RuntimeError, match="no images"):
        tiny_model(tokens[None], vl_sample(tiny_cfg, [10, img, 10])[1][None])


def test_freeze_rule_and_training_with_frozen_and_unfrozen_vit(tiny_cfg, tiny_model):
    names = [n for n, _ in tiny_model.named_parameters()]
    body = [n for n in names if is_vision_body(n)]
    assert "vision.norm.weight" not in body and "vision.blocks.0.attn.wqkv.weight" in body
    assert not any(n.startswith("aligner.") for n in body)
    assert set(n for n in names if n.startswith("vision.")) - set(body) == {"vision.norm.weight"}

    tokens, types, images = vl_sample(tiny_cfg, [16, random_image(tiny_cfg, 84, 84), 16,
                                                 random_image(tiny_cfg, 98, 140, seed=5), 8])

    def step(opt):
        tiny_model.zero_grad(set_to_none=True)
        logits = tiny_model(tokens[None], types[None], [images])
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[1:])
        loss.backward()
        opt.step()
        return loss

    set_vision_body_trainable(tiny_model, False)
    opt = torch.optim.AdamW([p for p in tiny_model.parameters() if p.requires_grad], lr=1e-3)
    assert torch.isfinite(step(opt))
    params = dict(tiny_model.named_parameters())
    for n in body:
        assert params[n].grad is None and params[n] not in opt.state, n
    for n in ("vision.norm.weight", "aligner.w1.weight", "aligner.w2.bias", "image_start", "image_newline"):
        assert params[n].grad is not None and torch.isfinite(params[n].grad).all() and params[n].grad.abs().sum() > 0, n

    set_vision_body_trainable(tiny_model, True)
    opt = torch.optim.AdamW([p for p in tiny_model.parameters() if p.requires_grad], lr=1e-3)
    step(opt)
    for n in body:
        g = params[n].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, n


def test_token_type_values_agree_between_data_and_model():
    import flashtrain.data.images as d
    import flashtrain.model.vision as m

    for name in ("TEXT", "IMAGE_START", "IMAGE", "IMAGE_NEWLINE", "IMAGE_END"):
        assert getattr(d, name) == getattr(m, name), name
    assert (d.TEXT, d.IMAGE_START, d.IMAGE, d.IMAGE_NEWLINE, d.IMAGE_END) == (-1, 0, 1, 2, 3)  # V41_SPEC §6


def test_aligner_is_unshuffle_linear_exact_gelu_linear_by_hand(tiny_cfg):
    """Aligner on random features, written out: each 3 x 3 cell (zero-padded) flattened as
    c * 9 + kh * 3 + kw, then w1 (+ bias), the exact (erf) GELU, w2 (+ bias). Pre-activations are
    spread over [-3, 3], where the tanh approximation of GELU is off by up to ~1e-3."""
    from flashtrain.model.vision import Aligner

    torch.manual_seed(0)
    al = Aligner(tiny_cfg)
    with torch.no_grad():
        for p in al.parameters():
            p.normal_(0, 0.3)
    n_h, n_w, C = 4, 5, tiny_cfg.vision_dim
    feats = torch.randn(n_h * n_w, C)
    with torch.no_grad():
        out = al(feats, n_h, n_w).double()
    def gelu(v):
        return 0.5 * v * (1 + math.erf(v / math.sqrt(2)))
    cells = [(ci, cj) for ci in range(2) for cj in range(2)]
    assert out.shape == (len(cells), tiny_cfg.dim)
    spread = 0.0
    for cell, (ci, cj) in enumerate(cells):
        v = torch.zeros(C * 9, dtype=torch.float64)
        for c in range(C):
            for kh in range(3):
                for kw in range(3):
                    i, j = 3 * ci + kh, 3 * cj + kw
                    if i < n_h and j < n_w:
                        v[c * 9 + kh * 3 + kw] = feats[i * n_w + j, c].item()
        pre = al.w1.weight.double() @ v + al.w1.bias.double()
        spread = max(spread, pre.abs().max().item())
        hidden = torch.tensor([gelu(a) for a in pre.tolist()], dtype=torch.float64)
        torch.testing.assert_close(out[cell], al.w2.weight.double() @ hidden + al.w2.bias.double(),
                                   atol=1e-5, rtol=1e-5)
    assert spread > 1.5
