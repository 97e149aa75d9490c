import pytest
import torch

from train.config import compose, model_config


@pytest.fixture(scope="session")
def tiny_cfg():
    return model_config(compose(["+exp=flash_tiny"]))


@pytest.fixture(scope="session")
def flash_cfg():
    return model_config(compose(["+exp=flash"]))


@pytest.fixture
def tiny_model(tiny_cfg):
    from model import Transformer

    torch.manual_seed(0)
    return Transformer(tiny_cfg)
