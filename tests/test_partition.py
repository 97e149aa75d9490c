"""Pipeline partitioning (parallel/partition.py): the DP is optimal (against brute force), pinned stage
layers are honoured, costs add up, and plan.py reports the partition."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.config import ConfigError
from parallel.partition import _stage_cost, in_flight_microbatches, partition

ROOT = Path(__file__).resolve().parent.parent


def _units(seed, n):
    g = torch.Generator().manual_seed(seed)
    vals = torch.randint(1, 100, (n, 2), generator=g).tolist()
    return [{"state_bytes": a * 10, "activation_bytes": b, "flops_per_token": a + b} for a, b in vals]


@pytest.mark.parametrize("seed, n, pp, flight", [(0, 8, 3, None), (1, 9, 4, None), (2, 7, 2, None),
                                                 (3, 10, 5, None), (4, 10, 4, [3, 2, 1, 2])])
def test_dp_matches_brute_force(seed, n, pp, flight):
    units = _units(seed, n)
    flight = flight or [pp - s for s in range(pp)]
    best = min(max(_stage_cost(units, a, b, flight[s]) for s, (a, b) in enumerate(zip((0,) + cuts, cuts + (n,))))
               for cuts in itertools.combinations(range(1, n), pp - 1))
    bounds = partition(units, pp, in_flight=flight)
    assert bounds[0][0] == 0 and bounds[-1][1] == n and all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
    assert max(_stage_cost(units, a, b, flight[s]) for s, (a, b) in enumerate(bounds)) == best


def test_in_flight_counts_from_the_schedules_warm_up():
    assert in_flight_microbatches(4) == [4, 3, 2, 1]
    # V-shaped, pp=2: rank 0 runs 3 forwards of stage 0 and 2 of stage 3 before its first backward
    assert in_flight_microbatches(2, "dualpipev") == [3, 2, 2, 2]
    assert in_flight_microbatches(2, "interleaved_1f1b") == [2, 1, 2, 1]


def test_pinned_stage_layers_and_validation():
    units = _units(0, 6)
    assert partition(units, 3, [1, 2, 3]) == [(0, 1), (1, 3), (3, 6)]
    with pytest.raises(ConfigError, match="stage_layers"):
        partition(units, 3, [1, 2, 2])
    with pytest.raises(ConfigError, match="parallel.pp=7"):
        partition(units, 7)


def test_report_totals_and_plan_pipeline_section():
    out = subprocess.run([sys.executable, "launch/plan.py", "+exp=flash", "parallel.pp=8", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    pipe = r["pipeline"]
    assert pipe["pp"] == 8 and len(pipe["stages"]) == 8
    ranges = [st["layers"] for st in pipe["stages"]]
    assert ranges[0][0] == 0 and ranges[-1][1] == 39 and all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))
    # state bytes: 4 bytes x (param + grad + buffers), Muon/Sinkhorn 1 buffer, AdamW 2 -- from the routing totals
    o = r["optimizers"]
    want = 4 * (3 * (o["muon"]["params"] + o["sinkhorn"]["params"]) + 4 * o["adamw"]["params"])
    assert sum(st["state_bytes"] for st in pipe["stages"]) == want
    # the two Engram layers (98B-parameter tables) never share a stage with many other layers
    for st in pipe["stages"]:
        if st["layers"][0] <= 1 <= st["layers"][1] or st["layers"][0] <= 14 <= st["layers"][1]:
            assert st["n_layers"] <= 3
    assert 1.0 <= pipe["imbalance_bytes"] < 1.3
