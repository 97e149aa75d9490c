"""The fixed flash_tiny model and batch that the pipeline parity runs and their single-process
reference share (tests/dist/pipeline_parity.py, tests/test_pipeline_dist.py; also the context, expert,
optimizer and recomputation parity runs). The model is flash_tiny on the 8-layer plan of
tests/layer_plans.py: every CSA2 role and both Engram modules, a fifth of the 40 layers' cost."""

import torch
from layer_plans import EIGHT_LAYERS

from flashtrain.data.loader import IGNORE
from flashtrain.model import Transformer
from flashtrain.train.config import compose, model_config

MICROBATCHES = 4  # of one sequence each: enough for DualPipeV / ZBV with 4 virtual stages
SEQ_LEN = 128

__all__ = ["IGNORE", "MICROBATCHES", "batch", "tiny_model"]


def tiny_cfg():
    return model_config(compose(["+exp=flash_tiny", *EIGHT_LAYERS]))


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_cfg())


def batch():
    """tokens, token_types, labels [M, S] and per-row images: rows 0 and 2 hold an image."""
    from conftest import random_image, vl_sample

    cfg = tiny_cfg()
    rows = []
    for r in range(MICROBATCHES):
        if r % 2 == 0:
            img = random_image(cfg, 84 + 12 * r, 84, seed=r)
            t, y, ims = vl_sample(cfg, [20 + r, img], seed=r)
            n = SEQ_LEN - t.numel()
            t2, y2, _ = vl_sample(cfg, [n], seed=100 + r)
            t, y = torch.cat([t, t2]), torch.cat([y, y2])
        else:
            t, y, ims = vl_sample(cfg, [SEQ_LEN], seed=r)
        rows.append((t, y, ims))
    tokens = torch.stack([r[0] for r in rows])
    types = torch.stack([r[1] for r in rows])
    labels = torch.cat([tokens[:, 1:], torch.full((MICROBATCHES, 1), IGNORE)], dim=1)
    labels = labels.masked_fill(torch.cat([types[:, 1:], torch.zeros(MICROBATCHES, 1, dtype=torch.long)], 1) >= 0,
                                IGNORE)
    return tokens, types, labels, [r[2] for r in rows]
