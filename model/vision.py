"""The DeepSeek-ViT vision path (V41_SPEC §6): ViT, 3x3 pixel-unshuffle aligner, and the merge of
image features into the token sequence.

- Patch embed: Linear(3 * p * p -> vision_dim, bias) on channel-major flattened patches.
- Blocks: pre-RMSNorm (eps `vision_norm_eps`) -> attention (`wqkv`/`wo` with bias, 2D RoPE,
  bidirectional within one image, never across images) and pre-RMSNorm -> SwiGLU (`w1` fused
  [2 * inter, dim] = gate | up, `w2`, no bias); final RMSNorm.
- 2D RoPE, rotate-half over each head: with head_dim = 2R, channel i < R/2 pairs with i + R and turns
  by row * f_i, channel R/2 + i pairs with R/2 + i + R and turns by col * f_i, f_i = theta^(-2i/R).
- Aligner: pixel-unshuffle of the patch grid by r (zero padding to multiples of r, channel order
  c * r^2 + kh * r + kw) -> Linear(dim * r^2 -> D, bias) -> exact GELU -> Linear(D -> D, bias).
- Layout: START, then per row (IMAGE x w, NEWLINE), then END; every position carries
  `image_token_id`; `token_types` tells them apart. IMAGE slots take aligner rows in reading order,
  START / NEWLINE / END take the learned vectors `image_start` / `image_newline` / `image_end`.

Every weight here is stored in BF16 by the release (model/formats.py).

Parameter names follow the public checkpoint (`vision.patch_embed.proj`, `vision.blocks.{i}.attn.wqkv`,
`vision.blocks.{i}.mlp.w1`, `vision.norm`, `aligner.w1`, `image_start`, ...). The trainer freezes the ViT
body by a name rule: every `vision.*` parameter except `vision.norm.*` (`is_vision_body`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from flashtrain.model.config import ModelConfig
from flashtrain.model.formats import Linear
from flashtrain.model.norm import RMSNorm

# token_types values (V41_SPEC §6)
TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = -1, 0, 1, 2, 3

VISION_BODY_PREFIX = "vision."
VISION_TRAINABLE_WHEN_FROZEN = ("vision.norm.",)


def is_vision_body(name: str) -> bool:
    """True for ViT parameters that the freeze rule freezes (all of `vision.*` but its final norm)."""
    return name.startswith(VISION_BODY_PREFIX) and not name.startswith(VISION_TRAINABLE_WHEN_FROZEN)


def set_vision_body_trainable(model: nn.Module, trainable: bool) -> int:
    """Freeze or unfreeze the ViT body; the final norm and the aligner always train. Returns the
    number of parameters switched."""
    n = 0
    for name, p in model.named_parameters():
        if is_vision_body(name):
            p.requires_grad_(trainable)
            n += p.numel()
    return n


def vision_rope_angles(n_h: int, n_w: int, rot_dim: int, theta: float, device=None):
    """cos/sin [n_h * n_w, rot_dim] for patches in reading order: the first rot_dim/2 angles follow the
    row index, the last rot_dim/2 the column index (rot_dim = head_dim / 2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim))
    rows = torch.arange(n_h, device=device).repeat_interleave(n_w).float()
    cols = torch.arange(n_w, device=device).repeat(n_h).float()
    ang = torch.cat([rows.unsqueeze(-1) * freqs, cols.unsqueeze(-1) * freqs], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half: x [..., N, H, 2R] with cos/sin [N, R]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def pixel_unshuffle(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """x [n_h * n_w, C] (reading order) -> [ceil(n_h/r) * ceil(n_w/r), C * r * r], zero-padded, with
    channel order c * r^2 + kh * r + kw, cells in reading order."""
    grid = x.reshape(n_h, n_w, -1).permute(2, 0, 1)  # [C, n_h, n_w]
    grid = F.pad(grid, (0, -n_w % r, 0, -n_h % r))
    C, H, W = grid.shape
    cells = grid.reshape(C, H // r, r, W // r, r).permute(1, 3, 0, 2, 4)  # [h, w, C, kh, kw]
    return cells.reshape((H // r) * (W // r), C * r * r)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.proj = Linear(3 * cfg.vision_patch_size ** 2, cfg.vision_dim, cfg, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(-3))


class VisionAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.vision_n_heads
        self.head_dim = cfg.vision_dim // cfg.vision_n_heads
        self.wqkv = Linear(cfg.vision_dim, 3 * cfg.vision_dim, cfg, bias=True)
        self.wo = Linear(cfg.vision_dim, cfg.vision_dim, cfg, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n_images, N, dim]: every image attends only to its own N patches."""
        B, N, _ = x.shape
        q, k, v = (t.view(B, N, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(o.transpose(1, 2).reshape(B, N, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = Linear(cfg.vision_dim, 2 * cfg.vision_inter_dim, cfg)
        self.w2 = Linear(cfg.vision_inter_dim, cfg.vision_dim, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.vision_dim, cfg.vision_norm_eps, cfg.qat)
        self.attn = VisionAttention(cfg)
        self.norm2 = RMSNorm(cfg.vision_dim, cfg.vision_norm_eps, cfg.qat)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.patch = cfg.vision_patch_size
        self.rot_dim = cfg.vision_dim // cfg.vision_n_heads // 2
        self.theta = cfg.vision_rope_theta
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vision_n_layers))
        self.norm = RMSNorm(cfg.vision_dim, cfg.vision_norm_eps, cfg.qat)

    def patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, (H/p) * (W/p), 3, p, p] in reading order."""
        n, C, H, W = pixels.shape
        p = self.patch
        return pixels.reshape(n, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(n, -1, C, p, p)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [n, 3, H, W] (n images of one size) -> features [n, (H/p) * (W/p), vision_dim]."""
        n_h, n_w = pixels.shape[-2] // self.patch, pixels.shape[-1] // self.patch
        x = self.patch_embed(self.patchify(pixels))
        cos, sin = vision_rope_angles(n_h, n_w, self.rot_dim, self.theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.r = cfg.vision_downsample_ratio
        self.w1 = Linear(cfg.vision_dim * self.r ** 2, cfg.dim, cfg, bias=True)
        self.w2 = Linear(cfg.dim, cfg.dim, cfg, bias=True)

    def forward(self, feats: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """feats [n_h * n_w, vision_dim] of one image -> [ceil(n_h/r) * ceil(n_w/r), dim]."""
        return self.w2(F.gelu(self.w1(pixel_unshuffle(feats, n_h, n_w, self.r))))


def aligner_rows(cfg: ModelConfig, image: torch.Tensor) -> int:
    """How many aligner rows (LLM positions of IMAGE type) an image [3, H, W] gives."""
    r, p = cfg.vision_downsample_ratio, cfg.vision_patch_size
    return -(-(image.shape[-2] // p) // r) * -(-(image.shape[-1] // p) // r)


def encode_images(vit: ViT, aligner: Aligner, images: list[torch.Tensor]) -> list[torch.Tensor]:
    """Aligner rows [n_llm_h * n_llm_w, dim] of each image [3, H, W], in the order given. Images of one
    size run through the ViT as one batch; attention never crosses images."""
    p = vit.patch
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, img in enumerate(images):
        if img.dim() != 3 or img.shape[0] != 3 or img.shape[1] % p or img.shape[2] % p:
            raise ValueError(f"image {i}: pixels must be [3, H, W] with H and W multiples of the patch size {p}, "
                             f"got {tuple(img.shape)}; preprocess it with data.images.load_image")
        groups[tuple(img.shape[1:])].append(i)
    out: list[torch.Tensor] = [None] * len(images)  # type: ignore[list-item]
    for (H, W), idx in groups.items():
        feats = vit(torch.stack([images[i] for i in idx]))
        for j, i in enumerate(idx):
            out[i] = aligner(feats[j], H // p, W // p)
    return out


def merge_images(h: torch.Tensor, token_types: torch.Tensor, rows: list[list[torch.Tensor]],
                 start: torch.Tensor, newline: torch.Tensor, end: torch.Tensor,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """Write aligner rows into IMAGE positions (reading order, per sample) and the learned vectors into
    START / NEWLINE / END positions. h [B, S, D]; rows[b] = the aligner rows of sample b's images.
    `positions` (context parallelism): h holds only these positions of the [B, S] sequences that
    token_types describes; each gets the row its position has in the whole sequence."""
    B = h.shape[0]
    if len(rows) != B:
        raise ValueError(f"images are given for {len(rows)} samples but the batch has {B}")
    out = h.clone()
    for b in range(B):
        is_image = token_types[b] == IMAGE
        pos = is_image.nonzero().squeeze(-1)
        feats = torch.cat(rows[b]) if rows[b] else h.new_zeros(0, h.shape[-1])
        n_start = int((token_types[b] == IMAGE_START).sum())
        if pos.numel() != feats.shape[0] or n_start != len(rows[b]):
            raise ValueError(
                f"sample {b}: token_types has {pos.numel()} IMAGE positions in {n_start} image span(s), but "
                f"{len(rows[b])} image(s) give {feats.shape[0]} aligner rows; build the span with "
                f"data.images.image_token_types(n_llm_h, n_llm_w) for each processed image")
        if positions is None:
            out[b, pos] = feats.to(h.dtype)
        else:
            local = is_image[positions]
            row = (is_image.long().cumsum(0) - 1)[positions]  # which aligner row each local position takes
            out[b, local] = feats[row[local]].to(h.dtype)
    types = token_types if positions is None else token_types[:, positions]
    for t, vec in ((IMAGE_START, start), (IMAGE_NEWLINE, newline), (IMAGE_END, end)):
        out = torch.where((types == t).unsqueeze(-1), vec.to(h.dtype), out)
    return out
