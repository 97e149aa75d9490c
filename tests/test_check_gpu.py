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
