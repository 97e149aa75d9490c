"""The Triton kernels under torch.compile (train/compile.py): their host code is a torch.library custom op
(model/kernels/select.py `kernel_op`), so a compiled function that calls them traces as ONE graph
(`fullgraph=True`: no graph break, dynamo never enters Triton) -- AOTAutograd runs the ops' fake
implementations (the host code, launches skipped on fake tensors) for the shapes -- and the compiled
function's outputs and gradients equal the eager kernel path's, under TRITON_INTERPRET=1 (fp32, CPU)."""

import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"

from flashtrain.model.kernels.index_topk import index_topk_op  # noqa: E402
from flashtrain.model.mhc import hc_collapse, hc_expand, hc_mixes  # noqa: E402
from flashtrain.model.sparse_attention import sparse_attention_lean  # noqa: E402


def _block(q, kv, comp, sink, topk, h, fn, scale, base):
    """Attention core and one mHC site, kernels forced on: what a compiled block calls."""
    out, _ = sparse_attention_lean(q, kv, comp, topk, sink, 8, q.shape[-1] ** -0.5, 16, 0, True)
    pre, post, comb = hc_mixes(h, fn, scale, base, 1e-6, 1e-6, 3, True)
    y = hc_collapse(h, pre, True) + out.sum(2)
    return hc_expand(y, h, post, comb, True)


def test_kernels_compile_as_one_graph_and_equal_eager():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    B, S, H, D, N, k, Dm = 1, 24, 2, 16, 12, 4, 16
    q, kv, comp, sink = (torch.randn(*s, generator=g) for s in ((B, S, H, D), (B, S, D), (B, N, D), (H,)))
    topk = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(S)])[None]
    topk[0, :3] = -1  # empty slots
    h = torch.randn(B, S, 4, Dm, generator=g)
    fn = torch.randn(24, 4 * Dm, generator=g) * 0.1
    scale, base = torch.ones(3), torch.randn(24, generator=g) * 0.5
    leaves = [q, kv, comp, sink, h, fn, scale, base]
    grad = torch.randn(B, S, 4, Dm, generator=g)

    def run(f):
        xs = [x.clone().requires_grad_() for x in leaves]
        out = f(*xs[:4], topk, *xs[4:])
        out.backward(grad)
        return out.detach(), [x.grad for x in xs]

    want, want_g = run(_block)
    got, got_g = run(torch.compile(_block, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    # the indexer's selection (no gradient) as one opaque op as well
    qi, wi = torch.randn(B, S, 2, 8, generator=g), torch.randn(B, S, 2, generator=g)
    ki = torch.randn(B, N, 8, generator=g)
    n_vis = (torch.arange(S) + 1) // 2
    args = (qi, wi, ki, n_vis, 4, 8, None, 2, 3)
    eager = index_topk_op(*args)
    compiled = torch.compile(lambda *a: index_topk_op(*a), fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
