"""Context-parallel layout and exchanges (model/sequence_split.py, parallel/context.py).

Layout, by hand: zigzag gives rank r chunks r and 2C - 1 - r of 2C as-even-as-possible chunks; the
halo and compressed-entry tables point at the positions they claim. Exchanges on 2 gloo processes
against the unsplit sequence: a causal window from local rows + halo equals the whole sequence's and
each rank's gradient equals the whole-sequence gradient at its positions (the halo's gradient reached
its owner), both by point-to-point with the previous chunk's owner and, for a halo longer than a chunk,
by the all-gather of every chunk's tail; the gathered compressed entries equal the whole sequence's
group pooling and their gradients, summed over ranks, reach the owners; rows gathered by rank come back
in rank order."""

import os
import sys
from pathlib import Path

import pytest
import warm_launch

from flashtrain.config.errors import ConfigError
from flashtrain.model.sequence_split import SequenceSplit, _entry_rows, _halo_rows, causal_cost, chunk_ranges

ROOT = Path(__file__).resolve().parent.parent


def test_zigzag_and_contiguous_chunks_by_hand():
    assert chunk_ranges(10, 2, "zigzag") == (((0, 3), (8, 10)), ((3, 6), (6, 8)))
    assert chunk_ranges(10, 2, "contiguous") == (((0, 5),), ((5, 10),))
    assert chunk_ranges(7, 1, "zigzag") == (((0, 7),),)
    s = SequenceSplit(10, 2, 0, "zigzag")
    assert s.positions().tolist() == [0, 1, 2, 8, 9] and s.offsets == [0, 3] and s.length == 5
    with pytest.raises(ConfigError, match="parallel.cp"):
        chunk_ranges(3, 2, "zigzag")
    with pytest.raises(ConfigError, match="cp_balance"):
        chunk_ranges(8, 2, "diagonal")


def test_point_to_point_halo_plan_by_hand():
    from flashtrain.model.sequence_split import halo_plan

    # zigzag, 2 ranks, 40 positions: chunks (0,10) (30,40) | (10,20) (20,30); width 4
    assert halo_plan(40, 2, "zigzag", 4, 0).sources == (("none", 0, 0, -1), ("peer", 0, 4, 1))
    assert halo_plan(40, 2, "zigzag", 4, 0).sends == ((6, 10, 1),)  # tail of chunk (0,10) to rank 1
    assert halo_plan(40, 2, "zigzag", 4, 1).sources == (("peer", 0, 4, 0), ("local", 6, 10, -1))
    assert halo_plan(40, 2, "zigzag", 4, 1).sends == ((16, 20, 0),)  # tail of chunk (20,30) to rank 0
    assert halo_plan(40, 2, "zigzag", 11, 0) is None  # a chunk of 10 cannot hold a halo of 11


def test_halo_and_entry_tables_point_at_the_right_positions():
    # chunks (0,3) (8,10) | (3,6) (6,8); tails of width 2 in rank-major, chunk order, left-padded:
    # rows 0-1: positions 1,2; rows 2-3: 8,9; rows 4-5: 4,5; rows 6-7: 6,7
    assert _halo_rows(10, 2, "zigzag", 2, 0) == [[], [6, 7]]  # chunk at 8 needs 6, 7
    assert _halo_rows(10, 2, "zigzag", 2, 1) == [[0, 1], [4, 5]]  # chunk at 3 needs 1, 2; at 6 needs 4, 5
    # a chunk shorter than the width: positions 0..2 of width 4 -> row 1 holds position 0
    assert _halo_rows(10, 2, "zigzag", 4, 1)[0] == [1, 2, 3]
    # groups of 3: 0 [0,3) owned by chunk (0,3); 1 [3,6) by (3,6); 2 [6,9) by (8,10); entries per part <= 1
    width, index = _entry_rows(10, 2, "zigzag", 3)
    assert width == 1 and index == [0, 2, 1]


def test_zigzag_evens_out_the_causal_cost():
    S, C = 65536, 4
    for balance, bound in (("contiguous", 1.7), ("zigzag", 1.01)):
        costs = [causal_cost(chunks, S) for chunks in chunk_ranges(S, C, balance)]
        imbalance = max(costs) / (sum(costs) / C)
        assert imbalance > 1.7 if balance == "contiguous" else imbalance < bound  # 7/4 before, ~1 after


SCRIPT = r'''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from flashtrain.model.sequence_split import SequenceSplit
from flashtrain.parallel.context import ContextComm

dist.init_process_group("gloo")
c, C = dist.get_rank(), dist.get_world_size()
def main():  # in a function: its tensors (whose graphs hold the group) are gone before the group is destroyed
    comm = ContextComm(dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    B, S, D, m = 2, 22, 3, 3  # chunks of 6, 6, 5, 5: boundaries inside groups of 3
    x = torch.randn(B, S, D, generator=g, dtype=torch.float64)
    r = torch.randn(B, S, D, generator=g, dtype=torch.float64)

    def window(seq, start):  # y_t = sum_j wgt_j * seq_{t-j} over the positions that exist (causal window of w)
        pad = F.pad(seq, (0, 0, w - 1, 0))
        return sum(wgt[j] * pad[:, w - 1 - j: w - 1 - j + seq.shape[1]] for j in range(w))[:, start:]

    def pool(seq):  # group j: the mean of tokens [j m, (j + 1) m)
        n = seq.shape[1] // m
        return seq[:, :n * m].unflatten(1, (n, m)).mean(2)

    # window 4: every chunk holds a whole halo (point-to-point with the previous chunk's owner); window 8:
    # a halo of 7 spans two chunks of 5 (the all-gather of every chunk's tail)
    for w, balance in ((4, "zigzag"), (4, "contiguous"), (8, "zigzag"), (8, "contiguous")):
        wgt = torch.randn(w, D, generator=torch.Generator().manual_seed(w), dtype=torch.float64)
        split = SequenceSplit(S, C, c, balance, comm)
        mine = split.positions()
        xw = x.clone().requires_grad_()
        ((window(xw, 0) * r).sum() + (pool(xw) * r[:, :S // m]).sum()).backward()

        xl = x[:, mine].clone().requires_grad_()
        halos = split.halo(xl, w - 1)
        ys, parts = [], []
        for (a, b), o, h in zip(split.chunks, split.offsets, halos):
            assert torch.equal(h, x[:, a - h.shape[1]:a]) and h.shape[1] == min(w - 1, a)
            ys.append(window(torch.cat([h, xl[:, o:o + b - a]], 1), h.shape[1]))
            j0, j1 = a // m, b // m
            rows = (torch.cat([h[:, h.shape[1] - (a - j0 * m):], xl[:, o:o + max(0, j1 * m - a)]], 1) if j1 > j0
                    else xl[:, :0])
            parts.append(pool(rows) if j1 > j0 else xl.new_zeros(B, 0, D))
        y = torch.cat(ys, 1)
        torch.testing.assert_close(y, window(x, 0)[:, mine])
        entries = split.gather_entries(parts, m)
        torch.testing.assert_close(entries, pool(x))
        ((y * r[:, mine]).sum() + (entries * r[:, :S // m]).sum() / C).backward()
        torch.testing.assert_close(xl.grad, xw.grad[:, mine])

        rows = torch.full((c + 1, 2), float(c), dtype=torch.float64, requires_grad=True)
        got = split.gather_ranks(rows, [1, 2])
        assert got.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        got.sum().backward()
        assert torch.equal(rows.grad, torch.full_like(rows, 2.0))  # both ranks' gradients summed
        assert split.sum(torch.tensor([c + 1.0])).item() == 3.0
    print(f"rank {c}: context ok", flush=True)

main()
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_halo_and_gathered_entries_match_the_unsplit_sequence_two_processes():
    out = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "--no-python", sys.executable, "-c", SCRIPT], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "rank 0: context ok" in out.stdout and "rank 1: context ok" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("pp, cp, balances", [(1, 2, ["zigzag", "contiguous"]), (2, 2, ["zigzag"])])
def test_context_parallel_model_matches_the_unsplit_sequences(pp, cp, balances):
    """flash_tiny with images, cp=2 (2 processes) and pp=2 x cp=2 (4): losses, hidden states, every
    gradient, the expert loads, the bias updates and the aux-loss values against the unsplit model, with
    chunk boundaries inside a compression group, an image span and an Engram n-gram
    (tests/dist/context_parity.py)."""
    out = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={pp * cp}", str(ROOT / "tests" / "dist" / "context_parity.py"), str(pp),
                            str(cp), *balances], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    for rank in range(pp * cp):
        for balance in balances:
            assert f"rank {rank}: context parity ok ({balance}, pp={pp}, cp={cp}" in out.stdout
