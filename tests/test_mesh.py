"""Mesh degrees (parallel/dims.py `ParallelDims.plan`): validated against world size and model, and a real 2-process
mesh (parallel/mesh.py)."""

import os
import sys
from pathlib import Path

import pytest
import warm_launch

from flashtrain.config.errors import ConfigError
from flashtrain.parallel.dims import ParallelDims


def test_degrees_by_hand():
    s = ParallelDims.plan(world=8, pp=2, ep=2, n_layers=40, n_routed_experts=384)
    assert (s.pp, s.dp, s.ep, s.cp) == (2, 4, 2, 1)
    s = ParallelDims.plan(world=16, pp=2, ep=8, n_layers=40, n_routed_experts=384, cp=4)  # ep folds over dp x cp
    assert (s.pp, s.dp, s.ep, s.cp, s.dp_cp) == (2, 2, 8, 4, 8)
    for kw, msg in ((dict(world=6, pp=4, ep=1), "parallel.pp=4 does not divide the world size 6"),
                    (dict(world=8, pp=2, ep=3), r"parallel.ep=3 does not divide the dp x cp = 4 ranks"),
                    (dict(world=8, pp=2, ep=1, cp=3), r"parallel.cp=3 does not divide the 4 ranks of a pipeline stage"),
                    (dict(world=64, pp=64, ep=1), "parallel.pp=64 exceeds the 40 layers")):
        with pytest.raises(ConfigError, match=msg):
            ParallelDims.plan(n_layers=40, n_routed_experts=384, **kw)
    with pytest.raises(ConfigError, match="n_routed_experts=384"):
        ParallelDims.plan(world=10, pp=1, ep=5, n_layers=40, n_routed_experts=384)


def test_two_process_mesh():
    script = r'''
import torch.distributed as dist
from flashtrain.parallel.dims import ParallelDims
from flashtrain.parallel.mesh import build_mesh
dist.init_process_group("gloo")
r = dist.get_rank()
for pp, ep, cp in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2)):
    mesh = build_mesh(ParallelDims.plan(dist.get_world_size(), pp, ep, 40, 8, cp))
    dm = mesh.device_mesh
    assert dm.mesh_dim_names == ("pp", "dp_rep", "ep") and tuple(dm.mesh.shape) == (pp, 2 // pp // ep, ep), dm
    assert mesh.dp_cp_mesh.size() == 2 // pp and dm["pp"].size() == pp and dm["ep"].size() == ep
    assert mesh.local_rank("dp_cp") == (r if pp == 1 else 0) and mesh.local_rank("pp") == (r if pp == 2 else 0)
    assert dist.get_world_size(mesh.group("dp_rep")) == 2 // pp // ep
    if cp == 2:  # both ranks share the sequences: one cp group of the two
        assert dist.get_world_size(mesh.group("cp")) == 2 and mesh.local_rank("cp") == r
dist.barrier()
dist.destroy_process_group()
'''
    root = Path(__file__).resolve().parent.parent
    out = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "--no-python", sys.executable, "-c", script], cwd=root,
                           env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
