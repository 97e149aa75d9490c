"""The V4.1 three-optimizer split: Muon (hybrid Newton-Schulz, head-wise mode), the Sinkhorn-balanced
update, AdamW; parameter routing; Triton kernels next to their plain-PyTorch references.

Each optimizer's step runs its own data-parallel exchanges over the groups it is given
(`parallel.dims.ParallelDims` builds the groups and the ZeRO-1 plan, it does not run these): under
ZeRO-1 Muon and SinkhornBalanced broadcast every piece from its owner and ShardedAdamW all-gathers its
chunks; SinkhornBalanced all-reduces the row statistics of a row-sharded table."""

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
