"""launch/check_gpu.py, the one prepared device check, in its reduced CPU form (TRITON_INTERPRET=1,
flash_tiny on the 4-layer plan): every section's code runs and reports, so the script is known to work
when a GPU comes; and a section that fails is reported without losing the others."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_reduced_form_runs_every_section(tmp_path):
    """Slow: the kernels under the interpreter, a 2-step training run, two benchmarks and an estimate
    (a few minutes on 2 cores)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "check_gpu.py"), "--cpu", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads((tmp_path / "check_gpu.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["kernels", "train", "bench_small", "bench_node", "estimator"]
    assert sections["bench_node"]["status"] == "skipped"  # the flash_node-width bench is for the GPU only
    assert all(sections[s]["status"] == "ok" for s in ("kernels", "train", "bench_small", "estimator")), sections
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
