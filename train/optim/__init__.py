"""The V4.1 three-optimizer split: Muon (hybrid Newton-Schulz, head-wise mode), the Sinkhorn-balanced
update, AdamW; parameter routing; Triton kernels next to their plain-PyTorch references."""

from flashtrain.train.optim.config import OptimConfig
from flashtrain.train.optim.muon import Muon
from flashtrain.train.optim.newton_schulz import newton_schulz, newton_schulz_reference
from flashtrain.train.optim.routing import (
           OptimizerSet,
           RoutingError,
           build_optimizers,
           route_parameters,
           routing_summary,
)
from flashtrain.train.optim.sinkhorn import SinkhornBalanced, sinkhorn_update_reference

__all__ = ["OptimConfig", "Muon", "SinkhornBalanced", "OptimizerSet", "RoutingError", "build_optimizers",
           "route_parameters", "routing_summary", "newton_schulz", "newton_schulz_reference",
           "sinkhorn_update_reference"]
