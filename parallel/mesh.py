"""The process mesh (DESIGN.md "Parallelism"): pp x dp x cp ranks, pp-major, cp innermost (a context-
parallel group is `cp` consecutive ranks). The dp x cp ranks of a stage hold the same parameters (their
gradients are reduced together: "dp_cp"); they read dp distinct batches, the cp ranks of one group the
same sequences. Expert parallelism `ep` folds over dp x cp (experts are sharded over ep consecutive
ranks and replicated over dp x cp / ep): tokens are tokens, whichever rank's slice they come from.
As one DeviceMesh ("pp", "dp_rep", "ep") with dp_rep x ep = dp x cp flattened as "dp_cp", plus the cp
groups. Degrees are checked against the world size and the model before anything is built, with
messages that name the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtrain.config.errors import ConfigError


@dataclass(frozen=True)
class MeshShape:
    world: int
    pp: int
    dp: int
    ep: int
    cp: int = 1

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp


def mesh_shape(world: int, pp: int, ep: int, n_layers: int, n_routed_experts: int, cp: int = 1) -> MeshShape:
    if world < 1:
        raise ConfigError(f"world size {world}: must be >= 1")
    if pp < 1 or world % pp:
        raise ConfigError(f"parallel.pp={pp} does not divide the world size {world}; use a pp that divides the "
                          f"number of processes (--nproc_per_node x nodes)")
    if pp > n_layers:
        raise ConfigError(f"parallel.pp={pp} exceeds the {n_layers} layers: every stage needs a block")
    if cp < 1 or (world // pp) % cp:
        raise ConfigError(f"parallel.cp={cp} does not divide the {world // pp} ranks of a pipeline stage (world "
                          f"{world} / pp {pp}); use a cp that divides it")
    dp = world // (pp * cp)
    if ep < 1 or (dp * cp) % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the dp x cp = {dp * cp} ranks of a stage (= world {world} "
                          f"/ pp {pp})")
    if n_routed_experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide model.n_routed_experts={n_routed_experts}")
    return MeshShape(world, pp, dp, ep, cp)


@dataclass
class ProcessMesh:
    """The run's DeviceMesh ("pp", "dp_rep", "ep") with dp_rep x ep = dp x cp flattened as "dp_cp", and
    the groups the trainer reduces over: non-expert gradients over `dp_cp`, expert gradients over
    `dp_rep` (the replicas of one expert shard), expert-parallel all-to-alls over `ep`, pipeline P2P
    over `pp`, context-parallel exchanges over `cp`. Ranks are laid out pp-major, then dp_rep, then
    ep: an EP group is `ep` consecutive ranks, a CP group `cp` consecutive ranks."""

    device_mesh: object
    dp_cp_mesh: object  # the flattened ("dp_rep", "ep") dim
    shape: MeshShape
    cp_group: object = None

    def _dim(self, name: str):
        return self.dp_cp_mesh if name == "dp_cp" else self.device_mesh[name]

    def group(self, name: str):
        return self.cp_group if name == "cp" else self._dim(name).get_group()

    def local_rank(self, name: str) -> int:
        if name == "cp":
            return self._dim("dp_cp").get_local_rank() % self.shape.cp
        return self._dim(name).get_local_rank()


def build_mesh(shape: MeshShape, device_type: str = "cpu") -> ProcessMesh:
    """The process group must already be initialised."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (shape.pp, shape.dp_cp // shape.ep, shape.ep),
                            mesh_dim_names=("pp", "dp_rep", "ep"))
    dp_cp_mesh = mesh["dp_rep", "ep"]._flatten("dp_cp")  # torch's way to name a product of dims (private-named API)
    cp_group = None
    if shape.cp > 1:  # the same rank order, cp innermost: a cp group is cp consecutive ranks
        cp_mesh = init_device_mesh(device_type, (shape.pp, shape.dp, shape.cp), mesh_dim_names=("pp", "dp", "cp"))
        cp_group = cp_mesh["cp"].get_group()
    return ProcessMesh(mesh, dp_cp_mesh, shape, cp_group)
