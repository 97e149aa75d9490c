"""The offline compile gate (train/plan/compile_gate.py, `launch/check_kernels.py --compile-only`): every Triton
kernel of the project compiles to cubin for sm_90a and sm_100a with the Triton wheel's ptxas, no GPU, for
every autotune config the CUDA autotuner would try at exp=flash's shapes (the largest) and dtypes; the
gate fails on a kernel that does not compile, on a config that cannot launch and on an undeclared spill.

The gate's own rules are checked against hand-computed cases (occupancy from the CUDA occupancy
calculator's rules, a ptxas log) and against two synthetic kernels compiled for real: one whose config
needs more shared memory than a block may have, one that does not compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtrain.train.plan import compile_gate as gate

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"kernel", "config", "arch", "registers", "spill_bytes", "shared_bytes"}


def test_occupancy_by_the_calculators_rules():
    h100 = gate.DEVICES["sm_90a"]
    # 128 registers x 32 threads = 4096 per warp; 65536 / 4096 = 16 warps -> 4 blocks of 4 warps; shared
    # (16 KiB + 1 KiB reserved) -> 228 KiB / 17 KiB = 13 blocks; warps 64 / 4 = 16: registers limit, 4 blocks
    occ = gate.occupancy(128, 4, 16384, h100)
    assert (occ["blocks_per_sm"], occ["occupancy"], occ["limited_by"]) == (4, 0.25, "registers")
    # 255 registers round up to 8192 per warp (256-register units): 8 warps -> one block of 8 warps
    occ = gate.occupancy(255, 8, 1000, h100)
    assert (occ["blocks_per_sm"], occ["occupancy"]) == (1, 0.125)
    # 100 KiB of shared memory: 101 KiB per block with the reserve -> 2 blocks of 228 KiB
    occ = gate.occupancy(32, 4, 100 * 1024, h100)
    assert (occ["blocks_per_sm"], occ["limited_by"]) == (2, "shared memory")
    # 113.5 KiB: with the 1 KiB reserve 114.5 KiB per block, one fits in 228 KiB (two would without it)
    occ = gate.occupancy(32, 4, 116224, h100)
    assert (occ["blocks_per_sm"], occ["limited_by"]) == (1, "shared memory")
    # one byte over 227 KiB, or 16 warps of 255 registers, does not launch at all
    assert not gate.occupancy(32, 4, 227 * 1024 + 1, h100)["launchable"]
    assert gate.occupancy(32, 4, 227 * 1024, h100)["launchable"]
    assert not gate.occupancy(255, 16, 0, h100)["launchable"]


def test_ptxas_log_parsed():
    log = ("ptxas info    : Compiling entry function '_k' for 'sm_90a'\nptxas info    : Function properties for _k\n"
           "    48 bytes stack frame, 44 bytes spill stores, 52 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 48 bytes cumulative stack size\n")
    assert gate.parse_ptxas(log) == {"registers": 255, "spill_bytes": 44, "spill_load_bytes": 52, "stack_bytes": 48}


def test_failures_name_what_is_wrong():
    ok = {"kernel": "_k", "config": "A=1", "arch": "sm_90a", "variant": "", "registers": 64, "spill_bytes": 0,
          "shared_bytes": 0, "num_warps": 4, "launchable": True, "device": "H100/H200"}
    assert gate.failures([ok], spills={}) == []
    assert "spills 8 bytes" in gate.failures([{**ok, "spill_bytes": 8}], spills={})[0]
    assert gate.failures([{**ok, "spill_bytes": 8}], spills={("_k", "A=1", "sm_90a"): 8}) == []
    assert "cannot launch" in gate.failures([{**ok, "launchable": False}], spills={})[0]
    assert "does not compile" in gate.failures([{**ok, "error": "CompilationError: x"}], spills={})[0]


def test_markdown_table_puts_the_architectures_side_by_side():
    e = {"kernel": "_k", "config": "A=1", "variant": "bfloat16; X=2", "file": "model/kernels/k.py", "registers": 128,
         "spill_bytes": 0, "shared_bytes": 16384, "num_warps": 4, "blocks_per_sm": 4, "occupancy": 0.25,
         "launchable": True, "exps": ["flash", "flash_node"]}
    table = gate.markdown_table([{**e, "arch": "sm_100a", "registers": 96}, {**e, "arch": "sm_90a", "spill_bytes": 8},
                                 {**e, "config": "A=2", "arch": "sm_90a", "error": "CompilationError: x"}])
    lines = table.splitlines()
    assert "sm_90a (H100/H200)" in lines[0] and lines[0].index("sm_90a") < lines[0].index("sm_100a")
    assert lines[2] == ("| `_k` | bfloat16; X=2 | A=1 | flash, flash_node | 128 (+8 spill) / 16.0 KiB / 4 x 4w = 25% "
                        "| 96 / 16.0 KiB / 4 x 4w = 25% |")
    assert lines[3] == "| `_k` | bfloat16; X=2 | A=2 | flash, flash_node | does not compile | - |"


def test_every_module_with_an_autotuned_kernel_is_gated():
    """A kernel module the gate does not know would never be compiled: every file that autotunes is listed."""
    found = set()
    for pkg in ("model", "parallel", "train", "data"):
        for path in (ROOT / pkg).rglob("*.py"):
            if "@triton.autotune" in path.read_text():
                found.add("flashtrain." + path.relative_to(ROOT).with_suffix("").as_posix().replace("/", "."))
    assert found == set(gate.KERNEL_MODULES)
    assert len(gate.project_kernels()) == 16


def test_fp8_linear_records_its_three_gemm_launches():
    """While the gate records, an FP8 Linear (model/fp8_linear.py) takes the CUDA path on fake tensors: its
    forward, dgrad and wgrad each record one launch of the FP8 GEMM kernel with the host code's arguments.
    in = 48 (zero-padded to 64: 2 blocks of 32), out = 80 (96: 3 blocks), 40 tokens (64: 2 blocks), bf16
    autocast: forward x [40, 64] . W [80, 64] -> bf16 [40, 80]; dgrad dy [40, 96] . W^T [48, 96] -> x's fp32
    [40, 48]; wgrad dy^T [80, 64] . x^T [48, 64] -> fp32 [80, 48]; the scales fp32, one per block."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashtrain.model.fp8_linear import fp8_linear
    from flashtrain.model.kernels.fp8_gemm import _fp8_block_gemm_kernel
    from flashtrain.model.kernels.select import recording

    with recording() as launches, FakeTensorMode():
        x = torch.randn(40, 48, requires_grad=True)
        w = torch.randn(80, 48, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fp8_linear(x, w)
        y.float().sum().backward()
    e4m3, f32, bf16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16
    want = [  # (a, a_scale, b, b_scale, c) as (shape, dtype), then M, N, K, n_blocks
        ([((40, 64), e4m3), ((40, 2), f32), ((80, 64), e4m3), ((80, 2), f32), ((40, 80), bf16)], [40, 80, 64, 2]),
        ([((40, 96), e4m3), ((40, 3), f32), ((48, 96), e4m3), ((48, 3), f32), ((40, 48), f32)], [40, 48, 96, 3]),
        ([((80, 64), e4m3), ((80, 2), f32), ((48, 64), e4m3), ((48, 2), f32), ((80, 48), f32)], [80, 48, 64, 2])]
    got = [([(tuple(t.shape), t.dtype) for t in ln.args[:5]], list(ln.args[5:])) for ln in launches]
    assert got == want
    assert all(ln.kernel is _fp8_block_gemm_kernel and ln.kwargs == {"SB": 32} for ln in launches)
    # every config of the kernel, for both architectures, for each launch (it has no prune)
    configs = {gate._config_text(c) for c in _fp8_block_gemm_kernel.configs}
    units = gate.compile_units(launches).values()
    assert len(configs) == 4
    for variant in ("float8_e4m3fn,float32,float8_e4m3fn,float32,bfloat16; SB=32",
                    "float8_e4m3fn,float32,float8_e4m3fn,float32,float32; SB=32"):
        assert {(u.config, u.arch) for u in units if u.variant == variant} == {
            (c, a) for c in configs for a in gate.ARCHS}, variant


@pytest.mark.slow
def test_the_trace_records_every_fp8_linears_three_gemms_at_the_exps_shapes():
    """Slow (~10 s: a simulated step of flash_tiny). The gate traces with the FP8 GEMMs on (exp flash_tiny
    leaves them off), and records the forward (T, out, in), dgrad (T, in, out) and wgrad (out, in, T) GEMM
    of every FP8 Linear, K padded to a multiple of 32, T = 2 sequences x 128 tokens = 256. The FP8 Linears
    at conf/model/flash_tiny.yaml's widths, (in, out): attention wq_a (dim 64, q_lora_rank 32), wq_b (32,
    n_heads 2 x head_dim 32 = 64), wkv (64, head_dim 32), wo_b (o_groups 2 x o_lora_rank 16 = 32, 64);
    the indexer's wq_b (32, index_n_heads 2 x index_head_dim 16 = 32); the shared expert's w1 / w3 (64,
    moe_inter_dim 32) and w2 (32, 64); Engram's wkv ((ngram 4 - 1) x 2 heads x head_dim 8 = 48, dim 64 x
    (hc_mult 4 + 1) = 320)."""
    T = 256
    linears = [(64, 32), (32, 64), (64, 32), (32, 64), (32, 32), (64, 32), (32, 64), (48, 320)]

    def pad(n):
        return -(-n // 32) * 32

    forward = {(T, o, pad(i)) for i, o in linears}
    want = forward | {(T, i, pad(o)) for i, o in linears} | {(o, i, T) for i, o in linears}
    launches = [ln for ln in gate.trace_launches(["+exp=flash_tiny"])
                if ln.kernel.fn.__name__ == "_fp8_block_gemm_kernel"]
    shapes = {tuple(ln.args[5:8]) for ln in launches}
    assert shapes == want
    for ln in launches:
        a, a_scale, b, b_scale, c, M, N, K, n_blocks = ln.args
        assert (a.shape, b.shape, c.shape, n_blocks) == ((M, K), (N, K), (M, N), K // 32)
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a_scale.dtype == b_scale.dtype == torch.float32
        assert K != T or c.dtype == torch.float32  # the wgrad accumulates the weight's gradient in fp32
    for shape in forward:  # the forward's output in autocast's bf16
        assert any(tuple(ln.args[5:8]) == shape and ln.args[4].dtype == torch.bfloat16 for ln in launches), shape


@pytest.mark.slow
def test_synthetic_kernels_over_shared_memory_and_not_compiling_fail():
    """Slow: two real compilations per architecture (~10 s). A K loop of [128, 128] fp16 tiles staged 6 deep
    needs 6 x 2 x 32 KiB of shared memory: more than a block may have on either GPU."""
    import triton
    import triton.language as tl

    from flashtrain.model.kernels.select import Launch

    @triton.autotune(configs=[triton.Config({"B": 128}, num_warps=8, num_stages=6)], key=["K"])
    @triton.jit
    def _big(X, Y, OUT, K, B: tl.constexpr):
        r = tl.arange(0, B)
        acc = tl.zeros((B, B), tl.float32)
        for k in range(0, K, B):
            a = tl.load(X + r[:, None] * K + k + r[None, :])
            b = tl.load(Y + (k + r[:, None]) * B + r[None, :])
            acc = tl.dot(a, b, acc)
        tl.store(OUT + r[:, None] * B + r[None, :], acc)

    @triton.autotune(configs=[triton.Config({"B": 16})], key=["K"])
    @triton.jit
    def _broken(X, OUT, K, B: tl.constexpr):
        r = tl.arange(0, B)
        x = tl.load(X + r)
        tl.store(OUT + r, tl.dot(x, x))  # a dot of 1-D operands does not compile

    x = torch.empty(8, dtype=torch.float16)
    launches = [Launch(_big, (x, x, x.float(), 4096), {}), Launch(_broken, (x, x, 4096), {})]
    entries = gate.compile_all(sorted(gate.compile_units(launches).values(), key=lambda u: (u.kernel, u.arch)))
    assert [(e["kernel"], e["arch"]) for e in entries] == [("_big", "sm_100a"), ("_big", "sm_90a"),
                                                           ("_broken", "sm_100a"), ("_broken", "sm_90a")]
    big = entries[:2]
    assert all(e["shared_bytes"] > 227 * 1024 and not e["launchable"] for e in big), big
    assert all("error" in e for e in entries[2:]), entries[2:]
    bad = gate.failures(entries, spills={})
    assert sum("cannot launch" in b for b in bad) == 2 and sum("does not compile" in b for b in bad) == 2


@pytest.mark.slow
@pytest.mark.gate
def test_every_kernel_and_config_compiles_for_hopper_and_blackwell_at_flash_shapes(tmp_path):
    """The whole gate at exp=flash (see docs/kernels.md for its time: a trace of one simulated step, then
    every compilation in a pool of 2 worker processes). Marked `gate`: scheduled first in the suite
    (tests/conftest.py), `python -m pytest -q -m gate tests` runs it alone."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "check_kernels.py"), "--compile-only", "--json",
                          "+exp=flash", "--jobs", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["failures"] == [] and report["exps"] == ["flash"]
    entries = report["entries"]
    assert all(KEYS <= set(e) and "error" not in e for e in entries)
    # every kernel of the project, for both architectures
    kernels = gate.project_kernels()
    assert {(e["kernel"], e["arch"]) for e in entries} == {(k, a) for k in kernels for a in ("sm_90a", "sm_100a")}
    for e in entries:
        dev = gate.DEVICES[e["arch"]]
        assert 0 < e["registers"] <= dev.max_regs_per_thread and e["shared_bytes"] <= dev.smem_per_block, e
        assert e["blocks_per_sm"] >= 1 and 0 < e["occupancy"] <= 1, e
    # every config the autotuner would try: all of them, except what the sparse-attention prune drops at
    # D = 512 (its register-footprint rule, written out here: head blocks up to 32, key tiles up to 64 rows,
    # 8 warps; the backward query kernel's head block x key tile up to 512)
    for name, tuner in kernels.items():
        configs = {gate._config_text(c) for c in tuner.configs}
        if name.startswith("_sparse_attn"):
            configs = {gate._config_text(c) for c in tuner.configs
                       if c.kwargs["BLOCK_H"] <= 32 and c.kwargs["BLOCK_N"] <= 64 and c.num_warps == 8
                       and (name != "_sparse_attn_bwd_q" or c.kwargs["BLOCK_H"] * c.kwargs["BLOCK_N"] <= 512)}
        for arch in ("sm_90a", "sm_100a"):
            variants = {e["variant"] for e in entries if e["kernel"] == name and e["arch"] == arch}
            for v in variants:
                got = {e["config"] for e in entries if e["kernel"] == name and e["arch"] == arch and e["variant"] == v}
                assert got == configs, (name, arch, v, configs - got)
    # bf16 where the CUDA path runs bf16: the attention and indexer operands, Newton-Schulz
    assert all(e["variant"].startswith("bfloat16") for e in entries
               if e["kernel"] in ("_sparse_attn_fwd", "_index_topk_kernel", "_syrk_kernel"))
