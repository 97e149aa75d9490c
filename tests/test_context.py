"""Context-parallel sequence exchanges (parallel/context.py) on 2 gloo processes against the unsplit
sequence: a causal window computed from a slice and its halo equals the whole sequence's, and each
slice's gradient equals the whole-sequence gradient (the halo's gradient reached its owner); the
gathered sequence equals the whole one and each owner receives every rank's gradient summed."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r'''
import torch
import torch.distributed as dist
from parallel.context import gather_sequence, halo_from_previous

dist.init_process_group("gloo")
c, C = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(0)
B, S, D, w = 2, 8, 3, 3
x = torch.randn(B, S, D, generator=g, dtype=torch.float64)
wgt = torch.randn(w, D, generator=g, dtype=torch.float64)
r = torch.randn(B, S, D, generator=g, dtype=torch.float64)
n = S // C
mine = slice(c * n, (c + 1) * n)

def window(seq, pad):  # y_t = sum_j wgt_j * seq_{t-j}, a causal window of w positions; pad: the w - 1 before
    padded = torch.cat([pad, seq], 1)
    return sum(wgt[j] * padded[:, w - 1 - j: w - 1 - j + seq.shape[1]] for j in range(w))

# the literal whole-sequence computation
xw = x.clone().requires_grad_()
(window(xw, torch.zeros(B, w - 1, D, dtype=x.dtype)) * r).sum().backward()
# the same from this rank's slice and its halo
xl = x[:, mine].clone().requires_grad_()
halo = halo_from_previous(xl, w - 1, dist.group.WORLD)
assert torch.equal(halo, x[:, c * n - (w - 1): c * n] if c else torch.zeros(B, w - 1, D, dtype=x.dtype))
yl = window(xl, halo)
torch.testing.assert_close(yl, window(x, torch.zeros(B, w - 1, D, dtype=x.dtype))[:, mine])
(yl * r[:, mine]).sum().backward()
torch.testing.assert_close(xl.grad, xw.grad[:, mine])

# gathered sequence: equal to the whole; the owner's gradient is every rank's summed
xl2 = x[:, mine].clone().requires_grad_()
whole = gather_sequence(xl2, dist.group.WORLD)
assert torch.equal(whole, x)
per_rank = [torch.randn(B, S, D, generator=torch.Generator().manual_seed(10 + k), dtype=x.dtype) for k in range(C)]
(whole * per_rank[c]).sum().backward()
torch.testing.assert_close(xl2.grad, sum(per_rank)[:, mine])
try:
    halo_from_previous(xl, n + 1, dist.group.WORLD)
    raise AssertionError("a halo longer than the slice was accepted")
except ValueError as e:
    assert "parallel.cp" in str(e)
print(f"rank {c}: context ok", flush=True)
dist.barrier()
dist.destroy_process_group()
'''


def test_halo_and_gathered_sequence_match_the_unsplit_sequence_two_processes():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "--no-python", sys.executable, "-c", SCRIPT], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "rank 0: context ok" in out.stdout and "rank 1: context ok" in out.stdout
