"""Model FLOPs / MFU (train/flops.py) and step profiling (train/profile.py): a hand count of the FLOPs of a
small made-up config, the MFU of the trainer's records, a Chrome trace of steps 2-3 of a flash_tiny run
with the model's module names in it, and the CUDA-only memory snapshot switch on the CPU."""

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
import warm_launch
from layer_plans import EIGHT_LAYERS
from torch import nn

from flashtrain.config.errors import ConfigError
from flashtrain.config.typed import typed_config
from flashtrain.model.config import ModelConfig
from flashtrain.train.flops import PeakTflops, flop_accounting, flops_per_token, gpu_peak, mfu, peak_flops
from flashtrain.train.profile import ProfileConfig, StepProfiler

pytestmark = pytest.mark.xdist_group("profile")  # its module-scoped reference runs are shared

ROOT = Path(__file__).resolve().parent.parent
CPU_PEAK_TFLOPS = 0.5


# ------------------------------------------------------------------------------------------------ flops
def hand_config() -> ModelConfig:
    """4 layers: SWA, FULL (ratio 4, the candidate source), REUSE, REINDEX (scores inside the pool);
    Engram at layer 2; no vision tower."""
    return ModelConfig(
        vocab_size=64, dim=16, n_layers=4, n_heads=2, head_dim=8, rope_head_dim=4, q_lora_rank=8, o_groups=2,
        o_lora_rank=4, window_size=4, compress_ratios=[0, 4, 4, 4], kv_source_layers=[1],
        index_source_layers=[1, 3], candidate_source_layer=1, candidate_topk_blocks=1, candidate_block_size=2,
        candidate_restriction=True, index_n_heads=2, index_head_dim=4, index_topk=3, n_routed_experts=4,
        n_shared_experts=1, n_activated_experts=2, moe_inter_dim=8, engram_layer_ids=[2], engram_max_ngram_size=3,
        engram_vocab_size=32, engram_n_heads=2, engram_head_dim=4, engram_compressed_vocab_size=None,
        vision_n_layers=0, image_token_id=60, attn_chunk_size=4)


def hand_flops(seq: int) -> float:
    """The same config counted from the layer shapes by hand (train/flops.py's convention: 6 flops per
    activated matmul weight, 12 per head channel and attended entry, the indexers' scoring)."""
    D, H, hd, qr, og, olr, V = 16, 2, 8, 8, 2, 4, 64
    E, k, inter, iH, ihd, hc, m = 4, 2, 8, 2, 4, 4, 4
    attention = D * qr + qr * H * hd + D * hd + (H * hd // og) * (og * olr) + og * olr * D  # wq_a wq_b wkv wo_a wo_b
    compressor = 2 * D * hd  # layer 1 (FULL, ratio 4): wkv and wgate, per token
    indexer = 2 * (qr * iH * ihd + D * iH) + hd * ihd / m  # layers 1, 3: wq_b, weights_proj; layer 1's wk on S/m
    mhc = 2 * (2 + hc) * hc * hc * D  # hc_attn_fn, hc_ffn_fn: [24, 4 D] each
    moe = E * D + 3 * D * inter + k * 3 * D * inter  # gate, shared expert, 2 of the 4 routed experts
    engram = (3 - 1) * 2 * 4 * D * (hc + 1)  # layer 2's wkv: n_cols x head_dim -> D (hc + 1)
    params = 4 * (attention + mhc + moe) + compressor + indexer + engram + V * D
    core = index = 0.0
    for t in range(seq):
        window = min(4, t + 1)
        visible = (t + 1) // m
        selected = {1: min(3, visible), 2: min(3, visible), 3: min(3, visible, 1 * 2)}  # layer 3: the pool of 2
        core += 3 * 4 * H * hd * window  # layer 0: the window only
        for layer in (1, 2, 3):
            core += 3 * 4 * H * hd * (window + selected[layer])
        for layer in (1, 3):  # own indexers: score every visible entry, KL backward on the selected
            index += 2 * iH * ihd * visible + 4 * iH * ihd * selected[layer]
    return 6 * params + core / seq + index / seq


@pytest.mark.parametrize("seq", [3, 16, 37])
def test_flops_per_token_by_hand(seq):
    cfg = hand_config()
    assert flops_per_token(cfg, seq) == pytest.approx(hand_flops(seq), rel=1e-12)
    assert flop_accounting(cfg, seq)["matmul_params_by_part"]["other"] == 0


def test_flops_per_token_is_bench_models():
    """The benchmark's printed count (launch/bench_model.py --flops-only +exp=flash_small: 0.181 GFLOP at 512)."""
    from flashtrain.train.config import compose, model_config

    assert flops_per_token(model_config(compose(["+exp=flash_small"])), 512) == 180661792.0


def test_mfu_and_peaks():
    assert mfu(2e9, 100.0, 1e12, world=4) == pytest.approx(2e9 * 100 / 4e12)
    assert mfu(2e9, 100.0, None) is None
    assert gpu_peak("NVIDIA H200") == 989e12 and gpu_peak("NVIDIA H20") == 148e12
    assert gpu_peak("NVIDIA H100 80GB HBM3") == 989e12 and gpu_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak("Some Future GPU") is None
    assert peak_flops(torch.device("cpu"), PeakTflops(cpu=2.0)) == (2e12, "train.peak_tflops.cpu")
    measured, source = peak_flops(torch.device("cpu"), PeakTflops())
    assert measured > 1e8 and "measured" in source
    with pytest.raises(ConfigError, match="peak_tflops.cpu"):
        typed_config(PeakTflops, {"cpu": -1}, "train.peak_tflops")
    with pytest.raises(ConfigError, match="unknown"):
        typed_config(PeakTflops, {"tpu": 1}, "train.peak_tflops")


def test_the_measured_cpu_peak_counts_two_flops_a_multiply_add(monkeypatch):
    """measured_cpu_peak: 2 n^3 FLOPs (a multiply and an add per term) over the best of its timed matmuls, on a
    clock that advances by hand: every timed matmul takes 0.25 s except the second, 0.125 s -> 2 x 4^3 / 0.125 =
    1024 FLOP/s; with a budget of 0.3 s it stops after the first timed run: 2 x 4^3 / 0.25 = 512."""
    from flashtrain.train import flops

    def clock(ticks):
        it = iter(ticks)
        return lambda: next(it)

    # start, (t0, end) per run: 0 | 1, 1.25 | 2, 2.125 | 3, 3.25
    monkeypatch.setattr(flops.time, "perf_counter", clock([0.0, 1.0, 1.25, 2.0, 2.125, 3.0, 3.25]))
    assert flops.measured_cpu_peak(n=4, reps=3) == 1024.0
    # start, t0, end, then the budget check of run 2 (0.5 s after the start, over 0.3): one timed run
    monkeypatch.setattr(flops.time, "perf_counter", clock([0.0, 0.125, 0.375, 0.5]))
    assert flops.measured_cpu_peak(n=4, reps=3, budget_s=0.3) == 512.0


def test_profile_config():
    from flashtrain.train.config import TrainConfig

    t = typed_config(TrainConfig, {"profile": {"steps": [2, 3], "memory_snapshot": True}, "peak_tflops": {"cuda": 900}},
                     "train")
    assert t.profile.steps == [2, 3] and t.profile.memory_steps == 3 and t.peak_tflops.cuda == 900.0
    assert typed_config(TrainConfig, {}, "train").profile.steps is None
    for bad in ({"steps": [3, 2]}, {"steps": [0, 1]}, {"steps": 2}, {"memory_steps": 0}, {"step": [1, 2]}):
        with pytest.raises(ConfigError):
            typed_config(ProfileConfig, bad, "train.profile")


# ------------------------------------------------------------------------------------------ profiling
def _no_cuda_memory(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("CUDA memory history touched on a CPU run")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", refuse)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", refuse)


def test_memory_snapshot_on_cpu_is_one_log_line(tmp_path, caplog, monkeypatch):
    _no_cuda_memory(monkeypatch)
    model = nn.Sequential(nn.Linear(4, 4))
    with caplog.at_level(logging.INFO, logger="train.profile"):
        prof = StepProfiler(ProfileConfig(memory_snapshot=True, memory_steps=2), tmp_path, torch.device("cpu"), model,
                            last_step=4)
        for step in range(1, 5):
            with prof.step(step):
                model(torch.randn(2, 4)).sum().backward()
        prof.close()
    assert [r.getMessage() for r in caplog.records if "CUDA-only" in r.getMessage()] and len(caplog.records) == 1
    assert not (tmp_path / "profile").exists() and not prof.active


def test_trace_written_when_a_step_fails(tmp_path):
    """A run stopping inside the range writes what it has, and the module hooks go away."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    prof = StepProfiler(ProfileConfig(steps=[1, 3]), tmp_path, torch.device("cpu"), model, last_step=10)
    with prof.step(1):
        model(torch.randn(2, 4)).sum().backward()
    assert model[0]._forward_pre_hooks  # inside the range: hooked
    with pytest.raises(RuntimeError), prof.step(2):
        model(torch.randn(2, 5))
    trace = json.loads((tmp_path / "profile" / "trace_steps_1-2.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"0", "1", "train_step#1", "train_step#2"} <= names
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks and not prof.active


# ----------------------------------------------------------------------------------- the trainer, end to end
@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    """flash_tiny (the 8-layer plan of tests/layer_plans.py), 3 steps of one 128-token sequence, steps 2-3
    traced, the memory snapshot switched on (a CPU run: a no-op), a fixed CPU peak for the MFU."""
    run, corpus = tmp_path_factory.mktemp("profiled_run"), tmp_path_factory.mktemp("corpus")
    cmd = [sys.executable, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", *EIGHT_LAYERS,
           f"hydra.run.dir={run}", "logging.wandb.mode=disabled", "logging.progress=false", f"data.corpus_dir={corpus}",
           "data.corpus_text_bytes=300000", "data.corpus_mm_docs=100", "data.corpus_shards=2",
           "train.max_steps=3", "train.profile.steps=[2,3]", "train.profile.memory_snapshot=true",
           f"train.peak_tflops.cpu={CPU_PEAK_TFLOPS}",
           "train.global_batch_tokens=128", "data.batch_size=1"]  # one sequence per step: a smaller trace
    out = warm_launch.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return run, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_trace_of_steps_2_to_3_names_the_modules(profiled_run):
    run, _ = profiled_run
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["trace_steps_2-3.json"]  # no memory snapshot
    trace = json.load(open(run / "profile" / "trace_steps_2-3.json"))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"train_step#2", "train_step#3", "embed", "layers.3", "layers.3.attn", "layers.3.ffn.experts",
            "layers.7.attn.wq_a", "layers.2.attn.indexer.wq_b", "layers.2.attn.compressor.norm", "head"} <= names
    assert "train_step#1" not in names  # step 1 ran unprofiled
    assert any(n.startswith("aten::mm") for n in names if n)  # the operators themselves
    log_lines = (run / "pretrain.log").read_text().splitlines()
    assert len([line for line in log_lines if "memory_snapshot" in line]) == 1


def test_records_carry_flops_and_mfu(profiled_run):
    from flashtrain.train.config import compose, model_config

    _, recs = profiled_run
    expected = flops_per_token(model_config(compose(["+exp=flash_tiny", *EIGHT_LAYERS])), 128)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["flops_per_token"] == expected
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / (CPU_PEAK_TFLOPS * 1e12 * 1),
                                         rel=1e-12)
