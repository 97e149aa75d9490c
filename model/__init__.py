"""flashtrain.model: the V4.1-Flash network only (no torch.distributed, no optimizer, no I/O)."""

from model.config import ConfigError, ModelConfig
from model.layer_plan import LayerRole, Role, layer_plan
from model.transformer import Carry, ForwardContext, Transformer

__all__ = ["ConfigError", "ModelConfig", "LayerRole", "Role", "layer_plan", "Carry", "ForwardContext",
           "Transformer"]
