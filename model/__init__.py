"""flashtrain.model: the V4.1-Flash network only (no torch.distributed, no optimizer, no I/O)."""

from flashtrain.config.errors import ConfigError
from flashtrain.model.config import ModelConfig
from flashtrain.model.layer_plan import LayerRole, Role, layer_plan
from flashtrain.model.transformer import Carry, ForwardContext, Transformer

__all__ = ["ConfigError", "ModelConfig", "LayerRole", "Role", "layer_plan", "Carry", "ForwardContext",
           "Transformer"]
