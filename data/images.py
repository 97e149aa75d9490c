"""Image preprocessing of the public V4.1 inference code (V41_SPEC §6) and the image token layout.

An image of W x H pixels becomes a pixel tensor [3, H', W'] (H', W' multiples of the patch size p), a
patch grid (H'/p) x (W'/p) for the ViT and a token grid n_llm_h x n_llm_w = ceil(patches / r) after
the r x r aligner, which the sequence holds as
    [START] + ([IMAGE] * n_llm_w + [NEWLINE]) * n_llm_h + [END]      (n_llm_h (n_llm_w + 1) + 2 positions)

Steps: (optionally clamp the width to `max_wh_ratio` x height); upscale images under `min_pixels`
keeping the aspect ratio; round both sides up to multiples of p; if the span would exceed
`max_n_token` positions, shrink proportionally to the largest size that fits; pad (centered) to that
size with gray 127 keeping the aspect ratio; normalise (x / 255 - 0.5) / 0.5.

Undecodable bytes raise `ImageDecodeError`, which the data loader counts and skips.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass

import numpy as np
import torch

# token_types values; model/vision.py defines the same ones (data/ does not import model/)
TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = -1, 0, 1, 2, 3
PAD_GRAY = 127


class ImageDecodeError(ValueError):
    """The bytes are not a readable image (corrupt, truncated, unknown format)."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Filled from the model config's `vision_*` fields."""

    patch_size: int = 14
    downsample_ratio: int = 3
    max_n_token: int = 1024
    min_pixels: int = 544 * 544
    max_wh_ratio: int | None = None


@dataclass
class ProcessedImage:
    pixels: torch.Tensor  # [3, H, W] float32, normalised
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    def token_types(self) -> torch.Tensor:
        return image_token_types(self.n_llm_h, self.n_llm_w)


def num_image_positions(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def image_token_types(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """[START] + ([IMAGE] * w + [NEWLINE]) * h + [END] as an int64 tensor."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEWLINE]
    return torch.tensor([IMAGE_START] + row * n_llm_h + [IMAGE_END], dtype=torch.int64)


def llm_grid(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """Token grid the aligner makes from a pixel size (multiples of the patch size)."""
    r, p = cfg.downsample_ratio, cfg.patch_size
    return math.ceil((height // p) / r), math.ceil((width // p) / r)


def _fit_size(height: float, width: float, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """Largest aspect-preserving pixel size (multiples of p) whose span fits in max_n_token."""
    p, cell = cfg.patch_size, cfg.patch_size * cfg.downsample_ratio
    ratio = height / width
    # h (w + 1) + 2 <= max with h = ratio * w  =>  w <= sqrt((max - 2) / ratio + 1/4) - 1/2
    max_w = math.sqrt((cfg.max_n_token - 2) / ratio + 0.25) - 0.5
    max_h = max_w * ratio
    if max_w < 1.0:  # very tall: one column
        return (cfg.max_n_token - 2) // 2 * cell, cell
    if max_h < 1.0:  # very wide: one row
        return cell, (cfg.max_n_token - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def plan_image_size(width: int, height: int, cfg: ImageProcessorConfig) -> tuple[int, int, int, int]:
    """(n_llm_h, n_llm_w, target_height, target_width) for an image of the given size."""
    p = cfg.patch_size
    if cfg.max_wh_ratio is not None and width > height * cfg.max_wh_ratio:
        width = height * cfg.max_wh_ratio
    if 0 < width * height < cfg.min_pixels:
        scale = (cfg.min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_w, best_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    n_h, n_w = llm_grid(best_h, best_w, cfg)
    if num_image_positions(n_h, n_w) > cfg.max_n_token:
        best_h, best_w = _fit_size(height, width, cfg)
        n_h, n_w = llm_grid(best_h, best_w, cfg)
    return n_h, n_w, best_h, best_w


def decode_image(data: bytes):
    """bytes -> RGB PIL image, or ImageDecodeError. A palette image with transparency (a GIF, an 8-bit PNG) goes
    through RGBA, where PIL reads its transparency, and then drops the alpha as the conversion of any RGBA
    image does: the colours its palette gives, as `convert("RGB")` would give them, without the UserWarning
    PIL raises on the direct conversion of a palette whose transparency is given per entry ("Palette images
    with Transparency expressed in bytes should be converted to RGBA images")."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as src:
            src.load()
            if src.mode == "P" and "transparency" in src.info:
                return src.convert("RGBA").convert("RGB")
            return src.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageDecodeError(f"cannot decode image ({len(data)} bytes): {decode_problem(e)}") from e


def decode_problem(error: Exception) -> str:
    """What PIL's error says, without the in-memory file object it names (`<_io.BytesIO object at 0x...>`):
    the caller names the file."""
    from PIL import UnidentifiedImageError

    if isinstance(error, UnidentifiedImageError):
        return "not an image format PIL can read"
    return re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(error)) or type(error).__name__


def process_image(image, cfg: ImageProcessorConfig) -> ProcessedImage:
    """A PIL image -> normalised pixels at the planned size, padded with gray to keep the aspect ratio."""
    from PIL import ImageOps

    p = cfg.patch_size
    n_h, n_w, H, W = plan_image_size(image.width, image.height, cfg)
    if cfg.max_wh_ratio is not None and image.width >= cfg.max_wh_ratio * image.height:
        image = image.resize((W, H))
    else:
        image = ImageOps.pad(image, (W, H), color=(PAD_GRAY,) * 3)
    x = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
    return ProcessedImage((x - 0.5) / 0.5, H // p, W // p, n_h, n_w)


def load_image(data: bytes, cfg: ImageProcessorConfig) -> ProcessedImage:
    """Encoded image bytes -> ProcessedImage (raises ImageDecodeError on unreadable bytes)."""
    return process_image(decode_image(data), cfg)
