"""Gradient buckets (parallel/grad_reduce.py): every gradient is divided by the dp size, including the
buckets that have no replica group to all-reduce over (routed experts with ep = dp, row-sharded Engram
tables), whose owner already holds the whole group's sum."""

import copy

import pytest
import torch

from flashtrain.parallel.grad_reduce import GradReducer


@pytest.mark.parametrize("overlap", [True, False])
def test_buckets_without_a_group_are_divided_by_dp(overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    x = torch.randn(7, 5)
    dp = 4
    # small buckets, so that the parameters spread over several
    red = GradReducer(list(model.named_parameters()), lambda name: None, dp, bucket_bytes=64)
    red.zero_grad()
    if overlap:
        red.mark_final()
    model(x).square().sum().backward()
    red.finish()
    ref(x).square().sum().backward()
    assert len(red.buckets) > 1
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad / dp, rtol=1e-6, atol=0, msg=name)
    assert red.launches == (len(red.buckets) if overlap else 0)
