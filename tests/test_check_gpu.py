"""launch/check_gpu.py, the one prepared device check, in its reduced CPU form (TRITON_INTERPRET=1,
flash_tiny on the 4-layer plan): every section's code runs and reports, so the script is known to work
when a GPU comes; and a section that fails is reported without losing the others."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm_launch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_reduced_form_runs_every_section(tmp_path):
    """Slow: the kernels under the interpreter, a 2-step training run, two benchmarks and an estimate
    (a few minutes on 2 cores)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = warm_launch.run([sys.executable, str(ROOT / "launch" / "check_gpu.py"), "--cpu", "--out", str(tmp_path)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads((tmp_path / "check_gpu.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["kernels", "train", "bench_small", "bench_optim", "bench_node", "estimator"]
    assert sections["bench_node"]["status"] == "skipped"  # the flash_node-width bench is for the GPU only
    assert all(sections[s]["status"] == "ok" for s in ("kernels", "train", "bench_small", "bench_optim",
                                                       "estimator")), sections
    optim = sections["bench_optim"]["result"]
    assert optim["device"] == "cpu" and optim["rounds"] == 1 and optim["threads"] == 1
    assert optim["muon_bf16_time_ratio"] == optim["comparisons"]["muon_bf16_vs_torch_muon"]["median"] > 0
    assert optim["sinkhorn_time_ratio"] == optim["comparisons"]["sinkhorn_vs_adamw"]["median"] > 0
    kernels = sections["kernels"]["result"]["flash_tiny/float32"]["report"]
    assert set(kernels) == {"sparse_attention", "index_topk", "hc_mixes", "hc_collapse", "hc_expand", "experts",
                            "newton_schulz", "sinkhorn"}
    for name, part in kernels.items():
        for what, diff in part["differences"].items():
            assert diff <= (1e-4 if name != "newton_schulz" else 1e-3), (name, what, diff)
        assert part["seconds"]["kernel"] > 0 and part["seconds"]["reference"] > 0
    train = sections["train"]["result"]
    assert train["steps"] == 2 and train["process_group"] == "gloo" and len(train["loss"]) == 2
    assert train["memory_peak_bytes"] is None  # on the CPU: no device peak
    bench = sections["bench_small"]["result"]
    assert {"reference", "default"} <= set(bench["variants"])
    est = sections["estimator"]["result"]
    assert est["estimate_peak_bytes"] > 0 and est["estimate_over_real"] is None
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.splitlines()[0].startswith("check_gpu on CPU") and "estimator" in summary
    assert (f"Muon {optim['muon_bf16_time_ratio']:.2f}x torch.optim.Muon (NS in bf16), Sinkhorn-balanced "
            f"{optim['sinkhorn_time_ratio']:.2f}x AdamW (cpu)") in summary
    assert summary.strip() in out.stdout


def test_a_failing_section_is_reported_and_the_others_run(tmp_path, monkeypatch):
    """The guard: one section raising leaves an error entry with its message; the next sections still run
    (the kernels and training sections replaced here by stand-ins, one of them failing)."""
    sys.path.insert(0, str(ROOT / "launch"))
    import check_gpu

    calls = []

    def boom(*a):
        calls.append("kernels")
        raise ValueError("kernel 7 differs")

    monkeypatch.setattr(check_gpu, "kernels", boom)
    monkeypatch.setattr(check_gpu, "train", lambda *a: calls.append("train") or {"steps": 0})
    monkeypatch.setattr(check_gpu, "bench", lambda *a: calls.append("bench") or {})
    monkeypatch.setattr(check_gpu, "estimator", lambda *a: calls.append("estimator") or {})
    monkeypatch.setattr(check_gpu, "summary", lambda report: "summary")
    monkeypatch.setattr(check_gpu.subprocess, "Popen", lambda *a, **k: type("P", (), {"poll": lambda s: 0})())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check_gpu.main(["--cpu", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "check_gpu.json").read_text())
    assert report["sections"]["kernels"]["status"] == "error"
    assert "kernel 7 differs" in report["sections"]["kernels"]["error"]
    assert calls == ["kernels", "train", "bench", "estimator"]
    assert report["sections"]["train"]["status"] == "ok"


def test_the_time_budget_skips_what_is_left(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "launch"))
    import check_gpu

    monkeypatch.setattr(check_gpu, "kernels", lambda *a: {})
    monkeypatch.setattr(check_gpu, "estimator", lambda *a: {})
    monkeypatch.setattr(check_gpu, "summary", lambda report: "summary")
    monkeypatch.setattr(check_gpu.subprocess, "Popen", lambda *a, **k: type("P", (), {"poll": lambda s: 0})())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check_gpu.main(["--cpu", "--out", str(tmp_path), "--budget-s", "0"]) == 0
    sections = json.loads((tmp_path / "check_gpu.json").read_text())["sections"]
    assert sections["kernels"]["status"] == "skipped" and sections["train"]["status"] == "skipped"
    assert sections["estimator"]["status"] == "ok"  # it only collects what was started


def test_options_only_shares_and_user_errors(monkeypatch):
    """--only picks sections, the rest are reported as skipped; unknown arguments and sections are one-line
    user errors; on a GPU a section's deadline is its share of the budget, never past the budget's end."""
    sys.path.insert(0, str(ROOT / "launch"))
    import check_gpu

    from flashtrain.config.errors import FlashtrainError

    cpu, out, budget, only = check_gpu.parse(["--cpu", "--only", "train,estimator", "--budget-s", "90"])
    assert (cpu, budget, only) == (True, 90.0, ("train", "estimator"))
    assert check_gpu.parse([])[2:] == (480.0, check_gpu.SECTIONS)
    for bad in (["--only", "train,bogus"], ["--frobnicate"], ["--budget-s", "soon"]):
        with pytest.raises(FlashtrainError):
            check_gpu.parse(bad)
    b = check_gpu.Budget(100.0, {"kernels": 30.0})
    b.start("kernels")
    assert 29.0 < b.section_left() <= 30.0 and b.left() > 99.0
    b.start("train")  # no share: the budget's end
    assert b.section_left() > 99.0
    b = check_gpu.Budget(10.0, {"kernels": 30.0})
    b.start("kernels")
    assert b.section_left() <= 10.0


def test_only_runs_the_named_sections(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "launch"))
    import check_gpu

    calls = []
    monkeypatch.setattr(check_gpu, "kernels", lambda *a: calls.append("kernels") or {})
    monkeypatch.setattr(check_gpu, "train", lambda *a: calls.append("train") or {})
    monkeypatch.setattr(check_gpu, "summary", lambda report: "summary")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check_gpu.main(["--cpu", "--out", str(tmp_path), "--only", "train"]) == 0
    sections = json.loads((tmp_path / "check_gpu.json").read_text())["sections"]
    assert calls == ["train"] and sections["train"]["status"] == "ok"
    assert all(sections[s] == {"status": "skipped", "reason": "not in --only"} for s in sections if s != "train")


def test_kernels_killed_at_the_end_of_the_share_keep_what_finished(tmp_path, monkeypatch):
    """The kernel worker writes each exp x dtype as it ends; killed mid-way, the finished one is kept, the
    running one is an error that says so, the rest are skipped."""
    sys.path.insert(0, str(ROOT / "launch"))
    import check_gpu

    def killed(cmd, budget, env=None):
        lines = Path(cmd[-1])
        lines.write_text(json.dumps({"key": "a/float32", "started": True}) + "\n"
                         + json.dumps({"key": "a/float32", "status": "ok", "seconds": 1.0, "report": {}}) + "\n"
                         + json.dumps({"key": "b/bfloat16", "started": True}) + "\n")
        raise subprocess.TimeoutExpired(cmd, 150)

    monkeypatch.setattr(check_gpu, "_run", killed)
    plan = {"kernel_runs": [("a", "float32"), ("b", "bfloat16"), ("c", "float32")], "kernel_seq": 64,
            "kernel_rounds": 1, "kernel_warmup": 0, "kernel_env": {}}
    out = check_gpu.kernels(plan, check_gpu.Budget(100.0), tmp_path)
    assert out["a/float32"]["status"] == "ok"
    assert out["b/bfloat16"]["status"] == "error" and "not finished" in out["b/bfloat16"]["error"]
    assert out["c/float32"]["status"] == "skipped"


def test_bench_node_falls_back_to_fewer_experts(monkeypatch):
    sys.path.insert(0, str(ROOT / "launch"))
    import check_gpu

    tried = []

    def bench(args, budget, env):
        tried.append(args[-1])
        if args[-1].endswith("=32"):
            raise RuntimeError("CUDA out of memory")
        return {"variants": {}}

    monkeypatch.setattr(check_gpu, "bench", bench)
    plan = {"node": ["+exp=flash_node"], "node_experts": (32, 16), "env": {}}
    res = check_gpu.bench_node(plan, check_gpu.Budget(100.0))
    assert tried == ["model.n_routed_experts=32", "model.n_routed_experts=16"] and res["n_routed_experts"] == 16
    monkeypatch.setattr(check_gpu, "bench", lambda *a: (_ for _ in ()).throw(RuntimeError("CUDA out of memory")))
    with pytest.raises(RuntimeError, match="32 experts.*16 experts"):
        check_gpu.bench_node(plan, check_gpu.Budget(100.0))


def test_the_training_sections_figures_by_hand():
    """Five step records among an eval event and a record without a loss: 5 steps and their losses; tokens/s and
    MFU the medians of steps 3-5 (300, 500, 400 -> 400; 0.3, 0.5, 0.4 -> 0.4); the peak the largest of steps 3-5
    (4, 6 and none -> 6, not step 2's 7); the process group from the start-up line. Two steps: medians of both,
    no peak, and no MFU when a step has none."""
    sys.path.insert(0, str(ROOT / "launch"))
    import check_gpu

    def step(i, loss, tps, mfu, peak):
        return {"step": i, "loss": loss, "tokens_per_s": tps, "mfu": mfu, "memory_peak_bytes": peak}

    records = [step(1, 9.0, 100.0, 0.1, 5), {"event": "eval", "step": 1, "loss": 8.9, "tokens": 512},
               step(2, 8.5, 200.0, 0.2, 7), {"step": 2, "checkpoint": "step_00000002"}, step(3, 8.2, 300.0, 0.3, 4),
               step(4, 8.0, 500.0, 0.5, 6), step(5, 7.9, 400.0, 0.4, None)]
    log = "run directory r: 1 process(es) on cuda, pp=1 dp=1 ep=1 cp=1, 5 steps, process group nccl\nstep 1\n"
    got = check_gpu.train_result(records, log, ["train/profile/memory_snapshot_5.pickle"], ["x=1"])
    assert got == {"steps": 5, "loss": [9.0, 8.5, 8.2, 8.0, 7.9], "process_group": "nccl",
                   "tokens_per_s_median": 400.0, "mfu_median": 0.4, "memory_peak_bytes": 6,
                   "memory_snapshots": ["train/profile/memory_snapshot_5.pickle"], "overrides": ["x=1"]}
    two = check_gpu.train_result([step(1, 9.0, 100.0, 0.1, None), step(2, 8.5, 200.0, None, None)], "", [], [])
    assert (two["steps"], two["tokens_per_s_median"], two["mfu_median"], two["memory_peak_bytes"],
            two["process_group"]) == (2, 150.0, None, None, None)


def test_the_summary_lines_by_hand():
    """Every kind of line summary.txt prints, from a hand-built report: the header; a kernel run's largest
    relative difference (a count of differing entries left out) and a skipped one; the training line (peak in
    GiB); a benchmark without and with compilation; the optimizer ratios; the estimate against the real peak
    (GiB, ratio) and without one; a failed section."""
    sys.path.insert(0, str(ROOT / "launch"))
    import check_gpu

    kernels = {"flash_tiny/float32": {"status": "ok", "report": {
        "a": {"differences": {"out0": 1e-5, "grad0": 3e-4, "differing blocks": 5}},
        "b": {"differences": {"out0": 2e-6}}}}, "flash/bfloat16": {"status": "skipped", "reason": "out of time"}}
    report = {"device": "cpu", "seconds": 123.4, "budget_s": 1800.0, "sections": {
        "kernels": {"status": "ok", "seconds": 10.0, "result": kernels},
        "train": {"status": "ok", "seconds": 20.5, "result": {
            "steps": 2, "loss": [9.5, 9.25], "tokens_per_s_median": 1234.4, "process_group": "gloo",
            "memory_peak_bytes": 3 * 2**30, "memory_snapshots": ["a", "b"]}},
        "bench_small": {"status": "ok", "seconds": 5.0, "result": {"variants": {
            "reference": {"fwd_bwd_tokens_per_s": 1000.0}, "default": {"fwd_bwd_tokens_per_s": 2500.4, "mfu": 0.123}},
            "compile_s": None}},
        "bench_optim": {"status": "ok", "seconds": 7.0, "result": {
            "muon_bf16_time_ratio": 0.404, "sinkhorn_time_ratio": 0.957, "device": "cpu"}},
        "bench_node": {"status": "ok", "seconds": 100.0, "result": {
            "variants": {"kernels": {"fwd_bwd_tokens_per_s": 9876.0, "mfu": 0.4}}, "compile_s": 42.4}},
        "estimator": {"status": "ok", "seconds": 0.5, "result": {
            "estimate_peak_bytes": 1.5 * 2**30, "real_peak_bytes": 2**31, "estimate_over_real": 0.75}}}}
    assert check_gpu.summary(report).splitlines() == [
        "check_gpu on cpu (123 s of a 1800 s budget)",
        "kernels      ok         10.0 s  flash_tiny/float32: largest relative difference 3.00e-04",
        "kernels      ok         10.0 s  flash/bfloat16: skipped out of time",
        "train        ok         20.5 s  2 steps, loss 9.500 -> 9.250, 1,234 tokens/s, process group gloo, "
        "peak 3.00 GiB, 2 snapshot(s)",
        "bench_small  ok          5.0 s  reference: 1,000 tokens/s; default: 2,500 tokens/s (MFU 12.3%)",
        "bench_optim  ok          7.0 s  Muon 0.40x torch.optim.Muon (NS in bf16), Sinkhorn-balanced 0.96x AdamW (cpu)",
        "bench_node   ok        100.0 s  kernels: 9,876 tokens/s (MFU 40.0%); compile 42 s",
        "estimator    ok          0.5 s  estimate 1.50 GiB vs real 2.00 GiB (0.750x)"]
    report["sections"] = {
        "train": {"status": "error", "seconds": 1.0, "error": "RuntimeError: boom"},
        "bench_node": {"status": "skipped", "reason": "not in --only"},
        "estimator": {"status": "ok", "seconds": 0.5, "result": {
            "estimate_peak_bytes": 2**29, "real_peak_bytes": None, "estimate_over_real": None, "note": "no peak"}}}
    assert check_gpu.summary(report).splitlines()[1:] == [
        "train        error       1.0 s  RuntimeError: boom",
        "bench_node   skipped     0.0 s  not in --only",
        "estimator    ok          0.5 s  estimate 0.50 GiB (no peak)"]


def test_kernel_differences_are_relative_to_the_reference_by_hand():
    """check_kernels.rel is max |a - b| / max |b|: 2x against x -> 1, 0 against x -> 1, equal empties -> 0.
    compare: a kernel side adding 0.25 to x = (1, -2, 4) differs by 0.25 / 4 in its output and not at all in
    its input gradient; a kernel side scaling by 1.5 by 0.5 in both."""
    sys.path.insert(0, str(ROOT / "launch"))
    import check_kernels
    import torch

    x = torch.tensor([1.0, -2.0, 4.0])
    assert check_kernels.rel(2 * x, x) == 1.0 and check_kernels.rel(torch.zeros(3), x) == 1.0
    assert check_kernels.rel(x, 0.5 * x) == 1.0 and check_kernels.rel(torch.zeros(0), torch.zeros(0)) == 0.0
    diffs, seconds = check_kernels.compare(lambda kernel, v: (v + 0.25 if kernel else v * 1.0,), [x], 1, warmup=0)
    assert diffs == {"out0": 0.0625, "grad0": 0.0} and set(seconds) == {"kernel", "reference"}
    diffs, _ = check_kernels.compare(lambda kernel, v: (v * 1.5 if kernel else v * 1.0,), [x], 1, warmup=0)
    assert diffs == {"out0": 0.5, "grad0": 0.5}
