"""The numbers the benchmarks print (launch/bench_*.py), each checked against a hand-computed value: the per-round
ratio summary and its quartiles, the printed ratio and load lines, the machine-load sampling, the optimizer-state
bytes and the figures of bench_optim's table; bench_model's and bench_data's rates; bench_position's state sizes,
bench_convert's peaks less the baseline, bench_estimate's peak ratio and bench_dspark's acceptance lines."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))
import bench_convert  # noqa: E402
import bench_data  # noqa: E402
import bench_dspark  # noqa: E402
import bench_estimate  # noqa: E402
import bench_model  # noqa: E402
import bench_optim  # noqa: E402
import bench_position  # noqa: E402
import bench_util  # noqa: E402

from flashtrain.data.loader import relayout  # noqa: E402
from flashtrain.data.sources import Source, default_sources  # noqa: E402
from flashtrain.train.optim import SinkhornBalanced  # noqa: E402


def test_ratio_summary_of_four_rounds_by_hand():
    """a = 1, 3, 2, 6 s against b = 2 s each round: ratios 0.5, 1.5, 1.0, 3.0 (in round order); median 1.25; the
    quartiles interpolate linearly over the sorted ratios 0.5, 1.0, 1.5, 3.0 at positions 0.75 and 2.25: Q1 =
    0.5 + 0.75 x 0.5 = 0.875, Q3 = 1.5 + 0.25 x 1.5 = 1.875, IQR 1.0; each side's median time 2.5 and 2.0 s."""
    s = bench_util.ratio_summary([1.0, 3.0, 2.0, 6.0], [2.0] * 4)
    assert s == {"median": 1.25, "min": 0.5, "max": 3.0, "q1": 0.875, "q3": 1.875, "iqr": 1.0, "rounds": 4,
                 "ratios": [0.5, 1.5, 1.0, 3.0], "a_median_s": 2.5, "b_median_s": 2.0}
    assert bench_util.format_ratio(s) == "1.25 (min 0.50, max 3.00, IQR 0.88-1.88; 4 rounds)"


def test_ratio_summary_of_one_round_and_of_uneven_lists():
    """One round: every statistic is its one ratio (2 / 8 = 0.25), the IQR 0, "1 round"; two lists of different
    lengths are refused, naming both lengths."""
    s = bench_util.ratio_summary([2.0], [8.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["iqr"], s["rounds"]) == (0.25, 0.25, 0.25, 0.25,
                                                                                          0.25, 0.0, 1)
    assert bench_util.format_ratio(s) == "0.25 (min 0.25, max 0.25, IQR 0.25-0.25; 1 round)"
    with pytest.raises(ValueError, match=r"\(3 and 2\)"):
        bench_util.ratio_summary([1.0, 2.0, 3.0], [1.0, 2.0])
    assert bench_util.quartiles([7.0, 1.0, 4.0]) == (2.5, 5.5)  # sorted 1, 4, 7 at positions 0.5 and 1.5


def test_format_load_prints_the_one_minute_averages_and_the_running_tasks():
    load = {"loadavg_start": [1.9, 1.2, 0.7], "loadavg_end": [2.4, 1.3, 0.8], "cpus": 4, "cpus_usable": 2,
            "running_mean": 2.6, "running_max": 4, "running_samples": 10}
    assert bench_util.format_load(load) == ("2 CPUs; 2.6 tasks running on average (max 4; this one included), "
                                            "load average (1 min) 1.90 -> 2.40")
    assert bench_util.format_load({**load, "running_mean": None, "running_max": None}) == (
        "2 CPUs; tasks running: not sampled, load average (1 min) 1.90 -> 2.40")


def test_running_tasks_are_read_from_proc_stat(monkeypatch):
    """`procs_running` of /proc/stat (a fake one: 3); None when the line is missing."""
    stat = "cpu  1 2 3 4\nintr 5\nprocs_running 3\nprocs_blocked 1\n"
    monkeypatch.setattr(bench_util, "open", lambda path: io.StringIO(stat), raising=False)
    assert bench_util._running() == 3
    monkeypatch.setattr(bench_util, "open", lambda path: io.StringIO("cpu  1 2 3 4\nprocs_blocked 1\n"),
                        raising=False)
    assert bench_util._running() is None


def test_machine_load_summary_averages_the_samples(monkeypatch):
    """Samples 1, 2, 2 (set by hand): mean 1.67 (two decimals), max 2, 3 samples; the load averages as read at the
    start and the end; no samples: mean and max None."""
    load = bench_util.MachineLoad()
    load.start, load.end, load.samples = [0.5, 0.25, 0.125], [1.5, 0.5, 0.25], [1, 2, 2]
    s = load.summary()
    assert (s["running_mean"], s["running_max"], s["running_samples"]) == (1.67, 2, 3)
    assert (s["loadavg_start"], s["loadavg_end"]) == ([0.5, 0.25, 0.125], [1.5, 0.5, 0.25])
    load.samples = []
    assert (load.summary()["running_mean"], load.summary()["running_max"]) == (None, None)
    # the sampling thread: a machine with 5 tasks running, sampled every 10 ms while the block runs
    monkeypatch.setattr(bench_util, "_running", lambda: 5)
    with bench_util.MachineLoad(every_s=0.01) as live:
        deadline = time.monotonic() + 30  # a busy machine may keep the sampler waiting: until its first sample
        while not live.samples and time.monotonic() < deadline:
            time.sleep(0.01)
    s = live.summary()
    assert s["running_mean"] == 5 and s["running_max"] == 5 and s["running_samples"] >= 1
    assert len(s["loadavg_start"]) == len(s["loadavg_end"]) == 3


def test_state_bytes_count_the_state_tensors_not_the_step_counter():
    """A [10, 4] fp32 table after one step: AdamW keeps exp_avg and exp_avg_sq (2 x 40 x 4 = 320 bytes; its 0-dim
    step counter is not state memory), SinkhornBalanced its momentum (160 bytes)."""
    def table():
        p = torch.nn.Parameter(torch.zeros(10, 4))
        p.grad = torch.ones(10, 4)
        return p

    aw = torch.optim.AdamW([table()], lr=1e-3)
    sk = SinkhornBalanced([table()], lr=1e-3)
    aw.step()
    sk.step()
    assert bench_optim._state_bytes(aw) == 320 and bench_optim._state_bytes(sk) == 160


def _result() -> dict:
    """bench_optim's result dict, every section filled by hand."""
    def cmp(ratios):
        return bench_util.ratio_summary(ratios, [1.0] * len(ratios))

    load = {"loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [1.5, 1.0, 1.0], "cpus": 2, "cpus_usable": 2,
            "running_mean": 1.25, "running_max": 2, "running_samples": 4}
    return {"rounds": 3, "threads": 1, "device": "cpu", "load": {"muon": load, "sinkhorn": load},
            "comparisons": {"muon_vs_torch_muon": cmp([1.5, 2.0, 2.5]),
                            "muon_bf16_vs_torch_muon": cmp([0.25, 0.5, 0.75]),
                            "sinkhorn_vs_adamw": cmp([0.5, 0.75, 1.0]), "sinkhorn_keep_grad_vs_adamw": cmp([2.0] * 3)},
            "comparisons_cpu": {"muon_vs_torch_muon": cmp([1.0] * 3), "muon_bf16_vs_torch_muon": cmp([0.5] * 3),
                                "sinkhorn_vs_adamw": cmp([0.25] * 3), "sinkhorn_keep_grad_vs_adamw": cmp([0.5] * 3)},
            "muon_step_s": 4.0, "muon_bf16_step_s": 1.0, "torch_muon_step_s": 2.0, "muon_matrices": 304,
            "ns_steps": 10, "muon_bf16_gemm": "bf16",
            "sinkhorn_step_s": 1.5, "sinkhorn_keep_grad_step_s": 4.0, "adamw_step_s": 2.0, "sinkhorn_params": 1234567,
            "sinkhorn_chunk_elems": 262144, "sinkhorn_state_bytes": 3 * 2 ** 20, "adamw_state_bytes": 6 * 2 ** 20,
            "state_bytes_ratio": 0.5,
            "peak_step_tensor_bytes_16384x2048": {"sinkhorn": 160 * 2 ** 20, "adamw": 640 * 2 ** 20,
                                                  "literal": 512 * 2 ** 20},
            "sinkhorn_workspace_beyond_momentum_bytes": 32 * 2 ** 20}


def test_bench_optim_table_prints_each_figure_of_the_result():
    """Every line of the table on a hand-filled result: times to 3 decimals, ratio medians and spreads to 2,
    the CPU-time ratio after them, the state and peak memory in MB with their ratios."""
    lines = bench_optim.table(_result()).splitlines()

    def tokens(start):
        (line,) = [ln for ln in lines if ln.startswith(start)]
        return line[len(start):].split()

    assert lines[0].startswith("times: medians of 3 alternated rounds after 1 warm-up round;")
    assert lines[1] == "device cpu, 1 torch thread(s) per side (--threads)"
    assert lines[3] == ("Muon (304 matrices), 2 CPUs; 1.2 tasks running on average (max 2; this one included), "
                        "load average (1 min) 1.00 -> 1.50")
    assert tokens("  ours, 10 NS steps in fp32 vs torch.optim.Muon (s)") == [
        "4.000", "2.000", "2.00", "min", "1.50,", "max", "2.50,", "IQR", "1.75-2.25", "1.00", "(min", "1.00,", "max",
        "1.00,", "IQR", "1.00-1.00)"]
    assert tokens("  ours, NS in bf16 (bf16)") == [
        "1.000", "2.000", "0.50", "min", "0.25,", "max", "0.75,", "IQR", "0.38-0.62", "0.50", "(min", "0.50,", "max",
        "0.50,", "IQR", "0.50-0.50)"]
    assert any(ln.startswith("Sinkhorn-balanced tables (1,234,567 parameters, chunks of 262,144 values), 2 CPUs")
               for ln in lines)
    assert tokens("  SinkhornBalanced vs AdamW step (s)")[:4] == ["1.500", "2.000", "0.75", "min"]
    assert tokens("  SinkhornBalanced vs AdamW step (s)")[9] == "0.25"
    assert tokens("  the same, gradient kept (consume_grad=False)")[:3] == ["4.000", "2.000", "2.00"]
    assert tokens("  optimizer state (MB)") == ["3.0", "6.0", "0.50"]
    assert tokens("peak step tensor memory, 16384x2048 (MB)") == ["160.0", "640.0", "0.25"]
    assert tokens("  of which beyond the momentum buffer (MB)") == ["32.0", "literal", "Algorithm", "1", "(U",
                                                                   "materialised):", "512.0", "MB"]


def _run_tiny(section: str, rounds: int = 1) -> dict:
    """bench_optim's `run` on flash_tiny, one section at one thread (the caller's thread count restored)."""
    threads = torch.get_num_threads()
    try:
        return bench_optim.run(["+exp=flash_tiny"], rounds=rounds, threads=1, device="cpu", sections=(section,))
    finally:
        torch.set_num_threads(threads)


def test_bench_optim_memory_section_subtracts_the_momentum_of_the_16384_x_2048_table(monkeypatch):
    """The memory section's "beyond the momentum" figure: Sinkhorn's peak less the fp32 momentum of the
    16384 x 2048 table (16384 x 2048 x 4 = 128 MiB); peaks given by hand (200, 400, 300 MiB)."""
    peaks = {"sinkhorn": 200 * 2 ** 20, "adamw": 400 * 2 ** 20, "literal": 300 * 2 ** 20}
    monkeypatch.setattr(bench_optim, "peak_step_bytes", lambda which, m, n, device="cpu": peaks[which])
    r = _run_tiny("memory", rounds=1)
    assert r["peak_step_tensor_bytes_16384x2048"] == peaks
    assert r["sinkhorn_workspace_beyond_momentum_bytes"] == 72 * 2 ** 20


def test_distributed_report_puts_the_one_rank_time_over_the_split_time():
    """Rounds of 4, 6, 5 s with every rank doing all the Newton-Schulz work against 2, 2, 4 s split over the
    ranks: speed-ups 2.0, 3.0, 1.25 -> median 2.0 (above 1: the split is faster); medians 5.0 and 2.0 s."""
    line, record = bench_optim.distributed_report(["+exp=flash_tiny"], 2, 3, [4.0, 6.0, 5.0], [2.0, 2.0, 4.0])
    assert line == ("Muon step on 2 ranks, +exp=flash_tiny: every rank does all NS 5.000 s, NS split over 2 ranks "
                    "2.000 s (medians of 3 alternated rounds), speed-up 2.00 (min 1.25, max 3.00, IQR 1.62-2.50; "
                    "3 rounds)")
    assert (record["speedup"], record["muon_step_one_rank_s"], record["muon_step_distributed_s"]) == (2.0, 5.0, 2.0)
    assert record["speedup_spread"]["ratios"] == [2.0, 3.0, 1.25] and record["ranks"] == 2


def _fake_alternate(wall: dict, cpu_s: dict):
    def fake(runs, rounds, cpu_times=None, **kw):
        assert set(runs) == set(wall)
        for step in runs.values():  # one real step each: the optimizers' state exists, as after the warm-up
            step()
        cpu_times.update({k: list(v) for k, v in cpu_s.items()})
        return {k: list(v) for k, v in wall.items()}
    return fake


def test_bench_optim_sinkhorn_state_is_half_of_adamws(monkeypatch):
    """flash_tiny's fp32 tables: SinkhornBalanced keeps one fp32 buffer a parameter (4 bytes each), AdamW two
    (8 bytes): ratio 0.5."""
    times = {"sinkhorn": [1.0], "sinkhorn_keep_grad": [1.0], "adamw": [1.0]}
    monkeypatch.setattr(bench_optim, "alternate", _fake_alternate(times, times))
    r = _run_tiny("sinkhorn", rounds=1)
    n = r["sinkhorn_params"]
    assert (r["sinkhorn_state_bytes"], r["adamw_state_bytes"], r["state_bytes_ratio"]) == (4 * n, 8 * n, 0.5)


def test_bench_optim_muon_section_counts_the_matrices_torch_is_given(monkeypatch):
    """The Muon section's counts: every matrix torch.optim.Muon is given (a stacked expert weight [E, out, in] as E
    matrices) is one of `muon_matrices`, their values are `muon_params`, and the NS steps are V4.1's 8 + 2; the
    ratios put ours over torch's (wall 2, 4, 3 s against 1 s: 3.0; bf16 0.5 s: 0.5)."""
    given = []

    class Recorded(torch.optim.Muon):
        def __init__(self, params, **kw):
            params = list(params)
            given.extend(params)
            super().__init__(params, **kw)

    monkeypatch.setattr(bench_optim.torch.optim, "Muon", Recorded)
    wall = {"ours": [2.0, 4.0, 3.0], "ours_bf16": [0.5] * 3, "torch": [1.0] * 3}
    monkeypatch.setattr(bench_optim, "alternate", _fake_alternate(wall, wall))
    r = _run_tiny("muon", rounds=3)
    assert given and all(p.dim() == 2 for p in given)
    assert r["muon_matrices"] == len(given) and r["muon_params"] == sum(p.numel() for p in given)
    assert r["ns_steps"] == 10
    assert (r["muon_time_ratio"], r["muon_bf16_time_ratio"]) == (3.0, 0.5)
    assert (r["muon_step_s"], r["muon_bf16_step_s"], r["torch_muon_step_s"]) == (3.0, 0.5, 1.0)


def test_bench_model_tokens_per_s_mfu_and_speed_ups_by_hand():
    """launch/bench_model.py's figures on hand-set rounds of 512 tokens, 1 GFLOP a token, peak 1 TFLOP/s:
    reference 2, 4, 3 s -> median 3 s, 170.7 tokens/s, MFU 170.67 x 1e9 / 1e12 = 17.07%; default 1, 2, 1.5 s
    -> 341.3 tokens/s, speed-up reference / default 2.0 each round; compiled 0.75, 1, 0.5 s -> speed-ups 1.33,
    2, 3 (median 2.0), compile time 10.75 - 0.75 = 10.0 s; the optimizer 0.5, 0.5, 1 s -> 0.5 s, so the trainer's
    default variant runs 512 / (1.5 + 0.5) = 256 tokens/s."""
    times = {"reference": [2.0, 4.0, 3.0], "default": [1.0, 2.0, 1.5], "compiled": [0.75, 1.0, 0.5],
             "optimizer": [0.5, 0.5, 1.0]}
    lines, r = bench_model.figures(times, ["reference", "default", "compiled"], 512, 1e9, 1e12, "default",
                                   first_compiled_s=10.75)
    assert lines[0] == ("reference  forward+backward    3.000 s (median; rounds 2.000, 4.000, 3.000)         170.7 "
                        "tokens/s  MFU 17.07%")
    assert lines[1].endswith("341.3 tokens/s  MFU 34.13%")
    assert lines[3] == ("CPU default (grouped experts) vs reference speed-up (reference time / default time): 2.00 "
                        "(min 2.00, max 2.00, IQR 2.00-2.00; 3 rounds)")
    assert lines[4] == ("compiled vs eager (default) speed-up (per round: eager time / compiled time): 2.00 (min 1.33, "
                        "max 3.00, IQR 1.67-2.50; 3 rounds); compile time 10.0 s (first compiled forward+backward "
                        "10.8 s minus its median round)")
    assert lines[5] == "optimizer step 0.500 s (median; lr 0 on the reference model's gradients)"
    assert r["variants"]["reference"]["mfu"] == pytest.approx(512 / 3 * 1e9 / 1e12)
    assert (r["fwd_bwd_s"], r["optim_s"], r["tokens_per_s"], r["default_variant"]) == (1.5, 0.5, 256.0, "default")
    assert r["compile_s"] == 10.0 and r["compiled_vs_eager_speedup"]["median"] == 2.0
    assert r["default_vs_reference_speedup"]["ratios"] == [2.0, 2.0, 2.0] and r["kernels_vs_reference_speedup"] is None
    # without a peak no MFU; without the optimizer the tokens/s are forward+backward's alone; kernels / reference
    lines, r = bench_model.figures({"reference": [3.0], "kernels": [1.0]}, ["reference", "kernels"], 300, 1e9, None,
                                   "kernels")
    assert lines[0].endswith("100.0 tokens/s  MFU n/a") and r["variants"]["reference"]["mfu"] is None
    assert lines[2] == ("kernels vs reference speed-up (per round: reference time / kernels time): 3.00 (min 3.00, "
                        "max 3.00, IQR 3.00-3.00; 1 round)")
    assert (r["tokens_per_s"], r["optim_s"], r["compile_s"]) == (300.0, None, None)


def test_bench_data_rates_shares_and_padding_by_hand():
    """launch/bench_data.py's line on hand-set counts: 6,000 tokens in 2 s wall / 3 s CPU -> 3,000 and 2,000
    tokens/s; 500 of them padding (8.333%); sources text (weight 3) and mm (weight 1) read 4,400 and 1,100 tokens
    -> shares of the sources' 5,500 tokens 80.0% / 20.0%, against weight shares 75.0% / 25.0%; a source without
    shards (weight 5) is left out of both."""
    sources = [Source("text", ("a.tar",), 3.0, "text", "data.text_shards"),
               Source("mm", ("b.tar",), 1.0, "multimodal", "data.mm_shards"),
               Source("absent", (), 5.0, "text", "data.sources")]
    line, r = bench_data.summary(10, 2, 300, 6000, 2.0, 3.0, 1.25, sources, [4400, 1100, 0],
                                 {"pad_tokens": 500, "tokens": 6000})
    assert line == ("3,000 tokens/s (2,000 per CPU second of this process; 10 batches of 2 x 300); shares text 80.0% "
                    "(weight 75.0%), mm 20.0% (weight 25.0%), padding 8.333%, corpus ready in 1.2 s")
    assert r["sources"] == {"text": {"tokens": 4400, "share": 0.8, "weight_share": 0.75},
                            "mm": {"tokens": 1100, "share": 0.2, "weight_share": 0.25}}
    assert (r["tokens_per_s"], r["tokens_per_cpu_s"]) == (3000.0, 2000.0)
    assert r["padding_fraction"] == pytest.approx(500 / 6000)


def test_bench_position_line_and_the_saved_states_by_hand():
    """1,000,000 shards over 32 groups, state() 0.0123 s, 2,500,000 bytes a group: "12.300 ms", "2.50 MB per
    group", 32 x 2.5 = "80.0 MB in a checkpoint". The saved states of 10 shards over 4 groups own 3, 3, 2, 2 shards
    (0 4 8 / 1 5 9 / 2 6 / 3 7); re-split over 1 group, that one group holds all 10 cursors."""
    assert bench_position.state_line(1_000_000, 32, 0.0123, 2_500_000) == (
        "1,000,000 shards over 32 reader group(s): one group's state() 12.300 ms (every batch), 2.50 MB per group, "
        "80.0 MB in a checkpoint")
    states = bench_position.saved_states(10, 4)
    owned = [len(st["worker_states"][0]["sources"]["text"]["cursors"]["epoch"]) for st in states]
    assert owned == [3, 3, 2, 2] and [st["rank"] for st in states] == [0, 1, 2, 3]
    assert {st["world"] for st in states} == {4}
    names = [f"web-{i}.tar" for i in range(10)]
    one = relayout(states, default_sources(names, [], [1, 0])[:1], 1, bench_position.CAPACITY, 0)
    assert len(one[0]["sources"]["text"]["cursors"]["epoch"]) == 10


def test_bench_convert_row_subtracts_the_baseline_by_hand():
    """Shard 0.05 GiB, export peak 1.75 GiB, import peak 2.5 GiB, baseline 1.25 GiB, 7 shards: 0.50 G and 1.25 G
    above the baseline, in the header's columns."""
    line = bench_convert.row(0.05, 1.75, 2.5, 1.25, 7)
    assert line == "     0.050        1.75G       0.50G        2.50G       1.25G       7"
    assert len(line) == len(bench_convert.HEADER)


def test_bench_estimate_ratio_is_the_estimate_over_the_real_peak():
    """Estimated peak 3 GB against a real 2 GB: ratio 1.5; the estimate is rank 0 of launch/estimate.py's last
    line, whatever it printed before."""
    out = "a progress line\n" + json.dumps({"ranks": [{"rank": 0, "peak_bytes": 3e9}, {"rank": 1, "peak_bytes": 1}]})
    r = bench_estimate.report(["+exp=flash_small"], {"peak_bytes": 2e9, "base_bytes": 1e9}, out)
    assert r["peak_ratio"] == 1.5 and r["estimate"] == {"rank": 0, "peak_bytes": 3e9}
    assert r["overrides"] == ["+exp=flash_small"] and r["real"]["peak_bytes"] == 2e9


def test_bench_dspark_report_by_hand():
    """Trained drafter 2.5 tokens a verification step, untrained 1.25 (quotient 2.00), a block of 1 1.5;
    acceptance 0.75, 0 (printed: no draft accepted there) and none at the third position ("-": none reached it)."""
    result = {"mean_accepted_length": 2.5, "prompts": 8, "new_tokens": 48, "block_size": 3,
              "baselines": {"untrained": {"mean_accepted_length": 1.25}, "block_1": {"mean_accepted_length": 1.5}},
              "acceptance_per_position": [0.75, 0.0, None], "confidence_ece": 0.125, "equals_greedy": True}
    summary = {"eval": result, "stage_steps": 300, "times": {"eval_s": 4.0},
               "first_record": {"step": 1}, "last_record": {"step": 300}}
    assert bench_dspark.report(summary) == [
        "mean accepted length per verification step (8 held-out prompts x 48 tokens, block 3):",
        "  trained drafter (300 stage steps): 2.500",
        "  untrained drafter:                  1.250  (trained / untrained = 2.00)",
        "  block of 1 (trained drafter):       1.500",
        "  acceptance per position: 0.750, 0.000, -",
        "  confidence ECE: 0.125; verified output equals greedy decoding: True",
        "  stage records: step 1 {'step': 1}, step 300 {'step': 300}",
        "  times: {'eval_s': 4.0}"]
