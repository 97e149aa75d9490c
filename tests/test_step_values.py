"""The step's metrics through one call (train/step_values.py): every reduce on hand-built values, the record's
reported fields, the errors for a metric recorded two ways or first recorded late, and the agreement of two
gloo processes that record different metrics (as two pipeline stages do)."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtrain.train.step_values import MetricLayout, StepValues, loader_fields

CPU = torch.device("cpu")


def test_every_reduce_by_hand():
    s = StepValues(CPU, MetricLayout(micro_batches=4))
    s.record("a", 1.5)
    s.record("a", torch.tensor([0.5, 1.0]))  # a tensor is summed down to one number
    s.record("n", 2, "count")
    s.record("n", torch.tensor(3), "count")
    s.record("m", 2.0, "mean")
    s.record("m", torch.tensor([[1.0, 5.0]]), "mean")  # 8 over the global batch's 4 micro-batches
    s.record("x", 3, "max")
    s.record("x", torch.tensor([7.0, 1.0]), "max")
    s.record("x", 5, "max")
    s.record("r", (1, 4), "ratio")
    s.record("r", (torch.tensor(2.0), torch.tensor([1.0, 3.0])), "ratio")  # (1 + 2) / (4 + 4)
    s.record("none", (0, 0), "ratio")
    s.record("zero", (0, 5), "ratio")  # nothing over something: 0, not null
    s.record("v", torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), size=3)
    s.record("vr", (torch.tensor([1.0, 0.0]), torch.tensor([4.0, 0.0])), "ratio", size=2)
    s.record("vx", torch.tensor([[1.0, 9.0], [3.0, 2.0]]), "max", size=2)
    s.record("parts", 7.0, report=False)
    v = s.read(grad_norm=torch.tensor(0.25), table=torch.arange(6.0).reshape(2, 3), missing=None)
    assert v == {"a": 3.0, "n": 5, "m": 2.0, "x": 7.0, "r": 3 / 8, "none": None, "zero": 0.0, "v": [5.0, 7.0, 9.0],
                 "vr": [0.25, None], "vx": [3.0, 9.0], "parts": 7.0, "grad_norm": 0.25,
                 "table": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "missing": None}
    assert type(v["n"]) is int
    assert s.reported(v) == {k: x for k, x in v.items() if k not in ("parts", "grad_norm", "table", "missing")}


def test_a_max_nobody_recorded_reads_minus_infinity_and_nothing_reads_empty():
    assert StepValues(CPU).read() == {}
    s = StepValues(CPU)
    s.record("x", -2.0, "max")
    assert s.read()["x"] == -2.0  # the largest of one value, not of it and a 0


def test_a_metric_recorded_two_ways_or_late_is_named():
    s = StepValues(CPU)
    s.record("loss", 1.0, "mean")
    with pytest.raises(ValueError, match=r"metric 'loss' is recorded as .*reduce='sum'.* and as .*reduce='mean'"):
        s.record("loss", 1.0, "sum")
    with pytest.raises(ValueError, match=r"metric 'q': reduce='median', use one of sum, count, mean, max, ratio"):
        s.record("q", 1.0, "median")
    layout = MetricLayout()
    first = StepValues(CPU, layout)
    first.record("loss", 1.0, "mean")
    first.all_reduce()
    second = StepValues(CPU, layout)
    second.record("loss", 2.0, "mean")
    second.record("late", 1.0)
    with pytest.raises(RuntimeError, match="metric 'late' was first recorded after this process's first step"):
        second.all_reduce()


def test_the_record_takes_the_loaders_counters_as_three_fields():
    assert loader_fields({"bad_samples": 4}) == {"skipped_samples": 4, "skipped_images": 0, "corrupt_shards": 0}


def _worker(rank, store, results):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    layout = MetricLayout(micro_batches=3)
    out = []
    for step in range(2):
        s = StepValues(CPU, layout)
        s.record("balance", 1.0 + rank, "mean")  # every stage
        s.record("worst", [5.0, 9.0][rank] + step, "max")
        if rank == 0:  # the first stage counts the data
            s.record("pad", (2, 10), "ratio")
            s.record("skipped", 4, "count")
        else:  # the last stage has the loss, a vector of two sources
            s.record("loss", 6.0 + step, "mean")
            s.record("per_source", torch.tensor([1.0, 2.0]), size=2, report=False)
        spike_check = s.global_value("loss")
        s.all_reduce()
        v = s.read()
        out.append((spike_check, v, s.reported(v), list(layout.metrics)))
    results[rank] = out
    dist.destroy_process_group()


def test_two_ranks_agree_on_the_union_of_their_metrics(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(str(tmp_path / "store"), results), nprocs=2)
    assert results[0] == results[1]
    for step, (spike_check, v, reported, names) in enumerate(results[0]):
        assert spike_check == 6.0 + step  # rank 0 has no loss: it adds 0
        assert v == {"balance": 1.0, "worst": 9.0 + step, "pad": 0.2, "skipped": 4, "loss": (6.0 + step) / 3,
                     "per_source": [1.0, 2.0]}
        assert "per_source" not in reported and reported["loss"] == v["loss"]
        assert names == sorted(names) == ["balance", "loss", "pad", "per_source", "skipped", "worst"]
