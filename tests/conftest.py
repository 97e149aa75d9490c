import os as _os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flashtrain.train.config import compose, model_config

if _os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each, and for the processes
    _os.environ["OMP_NUM_THREADS"] = "1"  # they launch (torchrun sets the same for its workers)
    torch.set_num_threads(1)


class Allocations(TorchDispatchMode):
    """What operators create while the mode is on: `total` storage bytes of every real (non-meta)
    tensor created (never decreased, so whatever was allocated counts even if freed again) and the
    `largest` single one. Views and in-place / out= results create nothing."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func._schema.is_mutable):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    n = t.untyped_storage().nbytes()
                    self.total += n
                    self.largest = max(self.largest, n)
        return out


def _remember_compositions():
    """The suite composes the same overrides again and again (`compose(["+exp=flash_tiny"])` in many tests),
    ~0.25 s of Hydra each: each pytest process composes a list of overrides once and hands out deep copies
    (conf/ does not change during a session; a composition that fails is not kept and fails again)."""
    import copy

    from flashtrain.train import config as config_module

    compose_once, kept = config_module._hydra_compose, {}

    def remembered(overrides):
        key = tuple(overrides)
        if key not in kept:
            kept[key] = compose_once(list(overrides))
        cfg, run_dir = kept[key]
        return copy.deepcopy(cfg), run_dir

    config_module._hydra_compose = remembered


_remember_compositions()


@pytest.fixture(scope="session")
def tiny_cfg():
    return model_config(compose(["+exp=flash_tiny"]))


@pytest.fixture(scope="session")
def flash_cfg():
    return model_config(compose(["+exp=flash"]))


@pytest.fixture
def tiny_model(tiny_cfg):
    from flashtrain.model import Transformer

    torch.manual_seed(0)
    return Transformer(tiny_cfg)


def image_config(cfg):
    from flashtrain.train.config import token_spec

    return token_spec(cfg).image


def random_image(cfg, width, height, seed=0):
    """A processed random RGB image of the given size (through the real preprocessing)."""
    import numpy as np
    from PIL import Image

    from flashtrain.data.images import process_image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return process_image(img, image_config(cfg))


def vl_sample(cfg, segments, seed=0):
    """segments: ints (that many random text tokens) and ProcessedImages, in order.
    Returns (tokens [S], token_types [S], [pixels, ...])."""
    g = torch.Generator().manual_seed(seed)
    tokens, types, images = [], [], []
    for seg in segments:
        if isinstance(seg, int):
            tokens.append(torch.randint(3, cfg.image_token_id, (seg,), generator=g))
            types.append(torch.full((seg,), -1, dtype=torch.long))
        else:
            t = seg.token_types()
            tokens.append(torch.full((t.numel(),), cfg.image_token_id, dtype=torch.long))
            types.append(t)
            images.append(seg.pixels)
    return torch.cat(tokens), torch.cat(types), images


# Triton kernel tests run in their own pytest process with TRITON_INTERPRET=1 set before triton is
# imported (tests/test_triton_kernels.py starts it); the main session does not collect them.
if _os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore = ["triton_interpret"]


def pytest_collection_modifyitems(config, items):
    """The offline compile gate (`gate`: every kernel x config at exp=flash's shapes, ~110 s in a pool of its own
    2 processes) first, then the modules with the most slow tests, each module kept together (for its
    module-scoped fixtures): with two workers the long runs start early instead of trailing at the end.
    `python -m pytest -q -m gate tests` runs the gate alone."""
    slow: dict[str, set] = {item.module.__name__: set() for item in items}
    for item in items:  # slow test functions, a parametrised one counted once
        if item.get_closest_marker("slow"):
            slow[item.module.__name__].add(item.originalname)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (item.get_closest_marker("gate") is None, -len(slow[item.module.__name__]),
                                 order[id(item)]))
