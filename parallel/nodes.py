"""The job's nodes: which rank runs where, and what a rank may assume about the others (issue 49 item 1;
docs/parallelism.md "Many nodes").

torchrun starts one launcher per node (one `srun` task per node under Slurm, launch/slurm/pretrain.sbatch);
each gives its workers `RANK` (global), `LOCAL_RANK` (on this node), `LOCAL_WORLD_SIZE` and `GROUP_RANK`
(the node's number, assigned by the rendezvous). What this module keeps straight:

- `startup_turn`: who builds what is cached (the default corpus, its tokenizer, the Engram token map) --
  global rank 0 first (once per job, where the cache is shared), then the first rank of each other node
  (a node whose cache is node-local builds its own copy, once), then everyone else, who find it built;
- `NodeTable`: every rank's node, host and pid, gathered once at start-up, to name a rank's node in a
  message (a lost peer, parallel/liveness.py) and to log the job's shape;
- `check_shared_run_dir`: every rank writes its checkpoint files into one run directory and rank 0 renames
  it complete, so every node must see the same directory: a start whose nodes do not is refused, in one
  line, before any step;
- `cuda_device_index`: the GPU of a rank is its `LOCAL_RANK`, which must name a GPU of its node.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from flashtrain.config.errors import ConfigError

PROBE_PREFIX = ".node-probe-"  # the file rank 0 writes into the run directory for the other nodes to find


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs."""

    node: int  # torchrun's GROUP_RANK
    host: str
    local_rank: int
    pid: int


def here() -> RankPlace:
    """This process's place, from torchrun's environment (one node, local rank 0 without torchrun)."""
    return RankPlace(int(os.environ.get("GROUP_RANK", "0")), socket.gethostname(),
                     int(os.environ.get("LOCAL_RANK", "0")), os.getpid())


def startup_turn(rank: int, local_rank: int) -> int:
    """The turn (0, 1, 2) in which a rank builds or finds the start-up caches: global rank 0, then each other
    node's first rank, then the rest (module docstring)."""
    if rank == 0:
        return 0
    return 1 if local_rank == 0 else 2


STARTUP_TURNS = 3


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


class NodeTable:
    """Every rank's `RankPlace`, by global rank."""

    def __init__(self, places: list[RankPlace]):
        self.places = places

    @classmethod
    def gather(cls) -> NodeTable:
        """Collective over every rank (one entry without a process group)."""
        mine = here()
        if not dist.is_initialized():
            return cls([mine])
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return cls(out)

    def nodes(self) -> dict[int, list[int]]:
        """{node: its ranks}, nodes in order."""
        out: dict[int, list[int]] = {}
        for rank, p in enumerate(self.places):
            out.setdefault(p.node, []).append(rank)
        return dict(sorted(out.items()))

    def describe(self, ranks) -> str:
        """`node 1 on host-b (ranks 8-15)`, one such phrase per node the ranks are on, joined by '; '."""
        by_node: dict[int, list[int]] = {}
        for r in sorted(ranks):
            by_node.setdefault(self.places[r].node, []).append(r)
        return "; ".join(f"node {n} on {self.places[rs[0]].host} ({_ranks_text(rs)})" for n, rs in by_node.items())

    def summary(self) -> str:
        """The start-up line's account of the job's nodes."""
        nodes = self.nodes()
        return f"{len(nodes)} node(s): " + self.describe(range(len(self.places)))


def check_shared_run_dir(run_dir: str | Path, table: NodeTable, rank: int) -> None:
    """Collective: refuse (ConfigError on every rank) a start whose ranks do not all see what rank 0 writes
    into the run directory. Rank 0 writes a probe file with a fresh name, every rank looks for it, rank 0
    removes it; nothing stays behind."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    name = [PROBE_PREFIX + secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    probe = Path(run_dir) / name[0]
    if rank == 0:
        probe.write_text(f"written by rank 0 on {socket.gethostname()}\n")
    dist.barrier()
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, probe.is_file())
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(f"run directory {Path(run_dir).absolute()} is not shared by every node: "
                          f"{table.describe(blind)} cannot see what rank 0 ({table.describe([0])}) writes there; "
                          f"every rank writes checkpoints into it: give hydra.run.dir a path on a filesystem every "
                          f"node mounts at the same place (NFS, Lustre, ...)")


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """The GPU of a rank: its LOCAL_RANK, which must be one of the node's `device_count` GPUs."""
    if not 0 <= local_rank < device_count:
        raise ConfigError(f"LOCAL_RANK={local_rank} but this node ({socket.gethostname()}) has {device_count} "
                          f"GPU(s): start one process per GPU (torchrun --nproc_per_node={device_count}, or fewer), "
                          f"and let torchrun set LOCAL_RANK (do not export it in the job script)")
    return local_rank
