"""The process mesh (DESIGN.md "Parallelism"): pp x dp x cp ranks, pp-major, cp innermost (a context-
parallel group is `cp` consecutive ranks). The dp x cp ranks of a stage hold the same parameters (their
gradients are reduced together: "dp_cp"); they read dp distinct batches, the cp ranks of one group the
same sequences. Expert parallelism `ep` folds over dp x cp (experts are sharded over ep consecutive
ranks and replicated over dp x cp / ep): tokens are tokens, whichever rank's slice they come from.
As one DeviceMesh ("pp", "dp_rep", "ep") with dp_rep x ep = dp x cp flattened as "dp_cp", plus the cp
groups. The degrees come from `ParallelDims` (parallel/dims.py: `ParallelDims.plan` checks them against
the world size and the model before anything is built); this module only builds the mesh of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProcessMesh:
    """The run's DeviceMesh ("pp", "dp_rep", "ep") with dp_rep x ep = dp x cp flattened as "dp_cp", and
    the groups the trainer reduces over: non-expert gradients over `dp_cp`, expert gradients over
    `dp_rep` (the replicas of one expert shard), expert-parallel all-to-alls over `ep`, pipeline P2P
    over `pp`, context-parallel exchanges over `cp`. Ranks are laid out pp-major, then dp_rep, then
    ep: an EP group is `ep` consecutive ranks, a CP group `cp` consecutive ranks."""

    device_mesh: object
    dp_cp_mesh: object  # the flattened ("dp_rep", "ep") dim
    cp: int = 1
    cp_group: object = None
    _dims: dict = field(default_factory=dict, repr=False)  # name -> 1-D mesh, made once

    def _dim(self, name: str):
        """The named 1-D mesh (slicing a DeviceMesh builds a submesh from its rank tensor: once per name)."""
        if name == "dp_cp":
            return self.dp_cp_mesh
        if name not in self._dims:
            self._dims[name] = self.device_mesh[name]
        return self._dims[name]

    def group(self, name: str):
        return self.cp_group if name == "cp" else self._dim(name).get_group()

    def local_rank(self, name: str) -> int:
        if name == "cp":
            return self._dim("dp_cp").get_local_rank() % self.cp
        return self._dim(name).get_local_rank()


def build_mesh(shape, device_type: str = "cpu") -> ProcessMesh:
    """The mesh of `shape`'s degrees (a `ParallelDims`: pp, dp, ep, cp); the process group must already be
    initialised."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (shape.pp, shape.dp_cp // shape.ep, shape.ep),
                            mesh_dim_names=("pp", "dp_rep", "ep"))
    dp_cp_mesh = mesh["dp_rep", "ep"]._flatten("dp_cp")  # torch's way to name a product of dims (private-named API)
    cp_group = None
    if shape.cp > 1:  # the same rank order, cp innermost: a cp group is cp consecutive ranks
        cp_mesh = init_device_mesh(device_type, (shape.pp, shape.dp, shape.cp), mesh_dim_names=("pp", "dp", "cp"))
        cp_group = cp_mesh["cp"].get_group()
    return ProcessMesh(mesh, dp_cp_mesh, shape.cp, cp_group)
