"""Head + cross-entropy tiled over the sequence (train/loss.py) against the plain full-logits loss:
the same value and gradients (hidden states and head weight) for tile counts that do and do not
divide the sequence, with ignored positions and a gradient-accumulation scale; and the largest tensor
it allocates is one tile's logits, not [tokens, vocab]."""

import pytest
import torch
import torch.nn.functional as F
from conftest import Allocations

from flashtrain.data.loader import IGNORE
from flashtrain.train.loss import tiled_lm_loss


def _case(B=2, S=19, D=8, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
    x = torch.randn(B, S, D, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :4] = IGNORE
    labels[1, -3:] = IGNORE
    return head, x, labels


@pytest.mark.parametrize("tile_tokens", [38, 7, 5, 1000])
def test_tiled_loss_equals_the_full_logits_loss(tile_tokens):
    head, x, labels = _case()
    scale = 0.25
    want = F.cross_entropy(head(x).reshape(-1, 50), labels.reshape(-1), ignore_index=IGNORE) * scale
    gx_want, gw_want = torch.autograd.grad(want, (x, head.weight))
    loss = tiled_lm_loss(x, head, labels, tile_tokens, scale)
    gw_tiles = head.weight.grad.clone()  # accumulated while the tiles ran
    loss.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(x.grad, gx_want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(head.weight.grad, gw_want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gw_tiles, gw_want, atol=1e-6, rtol=1e-5)  # nothing more arrives in backward


def test_no_full_logits_tensor_is_allocated():
    head, x, labels = _case(B=2, S=64, D=8, V=500)
    with Allocations() as mem:
        tiled_lm_loss(x, head, labels, 16, 1.0).backward()
    tile_logits = 16 * 500 * 4
    assert mem.largest <= tile_logits < 2 * 64 * 500 * 4 / 4, mem.largest


@pytest.mark.parametrize("tile_tokens", [7, 1000])
def test_per_source_ce_sums_are_the_literal_sums_of_each_sources_labels(tile_tokens):
    """`sources` / `source_ce` (the per-source training loss): each source's sum of per-label CE, computed
    here one label at a time from log-softmax, while the loss and its gradients stay those of the plain
    loss (tiles crossing source boundaries, ignored labels in every source)."""
    head, x, labels = _case()
    sources = torch.tensor([[0] * 6 + [2] * 8 + [1] * 5, [1] * 10 + [0] * 9])
    logp = torch.log_softmax(head(x).double(), -1)
    want = torch.zeros(3, dtype=torch.float64)
    for b in range(2):
        for t in range(19):
            if labels[b, t] != IGNORE:
                want[sources[b, t]] -= logp[b, t, labels[b, t]]
    plain = F.cross_entropy(head(x).reshape(-1, 50), labels.reshape(-1), ignore_index=IGNORE) * 0.5
    gx_want, = torch.autograd.grad(plain, (x,))
    got = torch.zeros(3, dtype=torch.float64)
    loss = tiled_lm_loss(x, head, labels, tile_tokens, 0.5, sources=sources, source_ce=got)
    loss.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-9)
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6)
    torch.testing.assert_close(x.grad, gx_want, atol=1e-6, rtol=1e-5)
