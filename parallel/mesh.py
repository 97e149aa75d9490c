"""The process mesh (DESIGN.md "Parallelism"): one DeviceMesh with dims ("pp", "dp_rep", "ep"), dp = dp_rep x ep
also addressable as "dp"; expert parallelism `ep` divides `dp` (experts sharded over ep, replicated over
dp / ep). Degrees are checked against the
world size and the model before anything is built, with messages that name the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ConfigError


@dataclass(frozen=True)
class MeshShape:
    world: int
    pp: int
    dp: int
    ep: int


def mesh_shape(world: int, pp: int, ep: int, n_layers: int, n_routed_experts: int) -> MeshShape:
    if world < 1:
        raise ConfigError(f"world size {world}: must be >= 1")
    if pp < 1 or world % pp:
        raise ConfigError(f"parallel.pp={pp} does not divide the world size {world}; use a pp that divides the "
                          f"number of processes (--nproc_per_node x nodes)")
    if pp > n_layers:
        raise ConfigError(f"parallel.pp={pp} exceeds the {n_layers} layers: every stage needs a block")
    dp = world // pp
    if ep < 1 or dp % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the data-parallel size dp={dp} (= world {world} / pp {pp})")
    if n_routed_experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide model.n_routed_experts={n_routed_experts}")
    return MeshShape(world, pp, dp, ep)


@dataclass
class ProcessMesh:
    """The run's DeviceMesh ("pp", "dp_rep", "ep") with dp = dp_rep x ep flattened as "dp", and the
    groups the trainer reduces over: non-expert gradients over `dp`, expert gradients over `dp_rep`
    (the replicas of one expert shard), expert-parallel all-to-alls over `ep`, pipeline P2P over `pp`.
    Ranks are laid out pp-major, then dp_rep, then ep: an EP group is `ep` consecutive ranks."""

    device_mesh: object
    dp_mesh: object  # the flattened ("dp_rep", "ep") dim
    shape: MeshShape

    def _dim(self, name: str):
        return self.dp_mesh if name == "dp" else self.device_mesh[name]

    def group(self, name: str):
        return self._dim(name).get_group()

    def local_rank(self, name: str) -> int:
        return self._dim(name).get_local_rank()


def build_mesh(shape: MeshShape, device_type: str = "cpu") -> ProcessMesh:
    """The process group must already be initialised."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (shape.pp, shape.dp // shape.ep, shape.ep),
                            mesh_dim_names=("pp", "dp_rep", "ep"))
    dp_mesh = mesh["dp_rep", "ep"]._flatten("dp")  # torch's way to name a product of dims (private-named API)
    return ProcessMesh(mesh, dp_mesh, shape)
