"""The run's parallel dimensions and every collective the training loop needs (DESIGN.md
"Parallelism"; torchtitan's ParallelDims is the model).

`ParallelDims` always exists: degree 1 where a dimension is unused (its group is then None and
nothing is exchanged over it). It is the one source of the run's degrees (world, pp, dp, ep, cp:
`ParallelDims.plan`, checked before anything is built) and owns
- the ("pp", "dp_rep", "ep") DeviceMesh and the cp groups (parallel/mesh.py) and this rank's coordinates;
- which group each parameter's gradient is reduced over (`replica_group`) and which group holds other
  pieces of it (`shard_group`), by the parameter's kind (model/param_kinds.py): routed experts are
  sharded over ep and replicated over dp_rep; row-sharded Engram tables are sharded over dp x cp and not
  replicated; everything else is replicated over dp x cp. Gradients are summed over the group and
  divided by dp: the cp ranks of one group hold partial sums of the same sequences' loss
  (model/sequence_split.py), the dp ranks distinct batches;
- the bucketed, backward-overlapped gradient reduction (parallel/grad_reduce.py);
- clipping by the norm over every stage and shard (parallel/clipping.py);
- ZeRO-1 ownership of optimizer state (parallel/zero.py): which rank of a replica group updates which
  piece of each parameter (for Muon whole matrices, so this plan is also its Newton-Schulz split);
- the global shape and offset of every parameter for sharded checkpoints (parallel/sharded_state.py).
The optimizers' own exchanges are not here: over the groups this object names, each optimizer step
runs its collectives itself (train/optim/: Muon and SinkhornBalanced broadcast every ZeRO piece from
its owner, ShardedAdamW all-gathers its chunks, SinkhornBalanced all-reduces the column statistics of
a row-sharded table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from flashtrain.config.errors import ConfigError
from flashtrain.model.param_kinds import ParamKind, parameter_kinds
from flashtrain.parallel.clipping import clip_grad_norm_
from flashtrain.parallel.grad_reduce import GradReducer
from flashtrain.parallel.mesh import ProcessMesh, build_mesh
from flashtrain.parallel.zero import Ownership, balance_matrices, flat_pieces, row_pieces, whole


def _forward_position(name: str, kind: ParamKind) -> int:
    """Where a parameter's gradient is completed, in forward order: the head first (the tiled loss
    accumulates its gradient tile by tile in the last micro-batch's forward, train/loss.py; the step
    runner marks it final before that forward), then the input path, the blocks by index, the final
    norm (a stable sort keeps registration order within each)."""
    if kind is ParamKind.HEAD:
        return -1
    if name.startswith("layers."):
        return 1 + int(name.split(".")[1])
    return 1 << 30 if name.startswith("norm.") else 0


@dataclass
class ParallelDims:
    world: int
    pp: int
    dp: int  # distinct batches per stage
    ep: int
    rank: int = 0
    mesh: ProcessMesh | None = None
    zero: bool = False
    engram_shard: bool = False
    bucket_bytes: int = 25 << 20
    cp: int = 1

    @classmethod
    def plan(cls, world: int, pp: int, ep: int, n_layers: int, n_routed_experts: int, cp: int = 1) -> "ParallelDims":
        """The degrees, checked against the world size and the model before anything is built (dp = world /
        (pp x cp) is derived); no groups yet (`connect`)."""
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
            raise ConfigError(f"parallel.ep={ep} does not divide the dp x cp = {dp * cp} ranks of a stage (= world "
                              f"{world} / pp {pp})")
        if n_routed_experts % ep:
            raise ConfigError(f"parallel.ep={ep} does not divide model.n_routed_experts={n_routed_experts}")
        return cls(world, pp, dp, ep, cp=cp)

    def connect(self, rank: int, device_type: str = "cpu", zero: bool = False, engram_shard: bool = False,
                bucket_bytes: int = 25 << 20) -> "ParallelDims":
        """This rank's mesh and groups, once the process group exists (none for one process), and what is
        exchanged over them; in place."""
        self.rank, self.bucket_bytes = rank, bucket_bytes
        self.mesh = build_mesh(self, device_type) if self.world > 1 and dist.is_initialized() else None
        self.zero, self.engram_shard = zero and self.dp_cp > 1, engram_shard and self.dp_cp > 1
        return self

    @classmethod
    def build(cls, world: int, rank: int, pp: int, ep: int, n_layers: int, n_routed_experts: int,
              device_type: str = "cpu", zero: bool = False, engram_shard: bool = False,
              bucket_bytes: int = 25 << 20, cp: int = 1) -> "ParallelDims":
        return cls.plan(world, pp, ep, n_layers, n_routed_experts, cp).connect(rank, device_type, zero, engram_shard,
                                                                             bucket_bytes)

    @property
    def dp_cp(self) -> int:
        """The ranks of a stage that hold the same parameters."""
        return self.dp * self.cp

    # --- groups and coordinates --------------------------------------------------------------
    def _group(self, name: str, degree: int):
        return self.mesh.group(name) if self.mesh is not None and degree > 1 else None

    @property
    def pp_group(self):
        return self._group("pp", self.pp)

    @property
    def dp_cp_group(self):
        return self._group("dp_cp", self.dp_cp)

    @property
    def cp_group(self):
        return self._group("cp", self.cp)

    @property
    def ep_group(self):
        return self._group("ep", self.ep)

    @property
    def rep_group(self):
        """The replicas of this rank's expert shard (dp / ep ranks)."""
        return self._group("dp_rep", self.dp_cp // self.ep)

    def _local(self, name: str) -> int:
        return self.mesh.local_rank(name) if self.mesh is not None else 0

    @property
    def pp_rank(self) -> int:
        return self._local("pp")

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place among the dp x cp ranks of its stage (that hold the same parameters)."""
        return self._local("dp_cp")

    @property
    def dp_rank(self) -> int:
        """Which of the dp distinct batches this rank reads."""
        return self._local("dp_cp") // self.cp if self.mesh is not None else 0

    @property
    def cp_rank(self) -> int:
        return self._local("dp_cp") % self.cp if self.mesh is not None else 0

    @property
    def ep_rank(self) -> int:
        return self._local("ep")

    def replica_group(self, kind: ParamKind):
        """The group a parameter of `kind` has its gradient averaged over (None: no other rank holds it)."""
        if kind is ParamKind.ROUTED_EXPERT:
            return self.rep_group
        if self.engram_shard and kind is ParamKind.ENGRAM_TABLE:
            return None
        return self.dp_cp_group

    def shard_group(self, kind: ParamKind):
        """The group whose ranks hold the other pieces of a parameter of `kind` (None: this rank holds all
        of it)."""
        if kind is ParamKind.ROUTED_EXPERT:
            return self.ep_group
        if self.engram_shard and kind is ParamKind.ENGRAM_TABLE:
            return self.dp_cp_group
        return None

    def replica_group_of(self, model: nn.Module):
        """name -> `replica_group` of that parameter of `model` (its kind: model/param_kinds.py)."""
        kinds = parameter_kinds(model)
        return lambda name: self.replica_group(kinds[name])

    def shard_group_of(self, model: nn.Module):
        """name -> `shard_group` of that parameter of `model`."""
        kinds = parameter_kinds(model)
        return lambda name: self.shard_group(kinds[name])

    # --- gradients ---------------------------------------------------------------------------
    def grad_reducer(self, model: nn.Module) -> GradReducer:
        """Parameters in forward order (the reducer buckets them in reverse: the order backward completes
        them, and starts buckets in that order only), so that the parameters a backward may not reach --
        the vision tower, aligner and image embeddings in a step without images -- and the head (whose
        gradient completes in the forward) come last and do not hold back the buckets before them."""
        kinds = parameter_kinds(model)
        named = sorted(model.named_parameters(), key=lambda np: _forward_position(np[0], kinds[np[0]]))
        return GradReducer(named, self.replica_group_of(model), self.dp, self.bucket_bytes)

    def clip(self, model: nn.Module, max_norm: float, device: torch.device) -> torch.Tensor:
        """Clip to `max_norm` by the norm of the whole model's gradient; returns the norm before clipping."""
        named = [(n, p.grad) for n, p in model.named_parameters() if p.requires_grad]
        return clip_grad_norm_(named, max_norm, device, self.shard_group_of(model), self.pp_group)

    # --- optimizer state ---------------------------------------------------------------------
    def zero_plan(self, model: nn.Module, split_of: dict[str, str], matrices: dict[str, tuple[int, int, int]]):
        """ZeRO-1 ownership of every parameter: {id(param): Ownership}. split_of[name] is how its optimizer
        splits it (parallel/zero.py): "matrices" (whole matrices, balanced by their orthogonalisation cost over
        the group; matrices[name] = (n, rows, cols)), "rows" (row blocks) or "flat" (equal chunks)."""
        plan: dict[int, Ownership] = {}
        by_group: dict[int, list] = {}  # the parameters split by matrices, per replica group
        kinds = parameter_kinds(model)
        for name, p in model.named_parameters():
            group = self.replica_group(kinds[name])
            if not self.zero or group is None:
                plan[id(p)] = whole(p.numel())
                continue
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            split = split_of[name]
            if split == "matrices":
                by_group.setdefault(id(group), []).append((name, p, group))
            elif split == "rows":
                plan[id(p)] = Ownership(row_pieces(p.shape[0], p[0].numel(), size), rank, group)
            else:
                plan[id(p)] = Ownership(flat_pieces(p.numel(), size), rank, group)
        for members in by_group.values():
            group = members[0][2]
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            pieces = balance_matrices([(name, *matrices[name]) for name, *_ in members], size)
            for name, p, *_ in members:
                plan[id(p)] = Ownership(pieces[name], rank, group)
        return plan

    # --- checkpoints -------------------------------------------------------------------------
    def global_layout(self, model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """{name: (global shape, offset of the local tensor)} for parameters this rank holds a piece of
        (experts under EP, row-sharded Engram tables); the others are whole here."""
        out, kinds = {}, parameter_kinds(model)
        for module_name, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                name = f"{module_name}.{pname}" if module_name else pname
                rows = getattr(module, "global_rows", None)  # a module that holds a row block of its tables
                if kinds.get(name) is ParamKind.ROUTED_EXPERT and self.ep > 1:
                    out[name] = ((module.n_global,) + tuple(p.shape[1:]), (module.offset,) + (0,) * (p.dim() - 1))
                elif rows is not None and kinds.get(name) is ParamKind.ENGRAM_TABLE and self.engram_shard:
                    out[name] = ((rows,) + tuple(p.shape[1:]), (module.row_offset,) + (0,) * (p.dim() - 1))
        return out
