"""The offline compile gate (DESIGN.md "Testing"; `launch/check_kernels.py --compile-only`): every Triton
kernel of the project compiled for Hopper (sm_90a: H100 / H200) and Blackwell (sm_100a: B200) on a
machine without a GPU, through the Triton wheel's bundled ptxas, with each configuration's registers,
spills, shared memory and the occupancy they allow.

1. Trace (`trace_launches`): one training step of the exp, simulated on fake tensors by the trainer's own
   construction and step (train/plan/estimate.py `SimulatedRank`), under model/kernels/select.py `recording()`:
   the Triton path is taken as on CUDA and every launch is recorded with the arguments the host code
   passed (dtypes, strides, scalars) instead of running. As on CUDA: bf16 autocast (the CPU's autocast
   lists, as the estimator simulates it) and Muon's Newton-Schulz in bf16 (`optim.muon.ns_dtype`'s CUDA
   default). The kernels an exp may switch on are traced switched on (SWITCHED_ON: the FP8 GEMMs,
   `model.fp8.enabled`, whose op records its Triton launch while recording, model/fp8_linear.py).
   Shortcuts that leave every launch's specialisation as it is (TRACE_SHORTCUTS): the layer
   roles in 8 layers (one of each role the exp's 40 use: the kernels' variants are per role, not per
   layer), 8 routed experts (they run through grouped GEMM, not Triton; Muon orthogonalises each expert
   matrix alone, so fewer of them means fewer equal launches), no ViT (text batches; it has no Triton
   kernel), one process.
2. Specialise (`compile_units`): for every launch, every autotune config the CUDA autotuner would try
   (its own `prune_configs` on that launch's arguments), specialised as Triton's JIT specialises a launch
   (its binder: integers equal to 1 or divisible by 16, 16-byte aligned pointers), for each target
   architecture; identical specialisations are compiled once (Triton's own compile-cache identity).
3. Compile (`compile_all`): `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90 | 100, 32))` to
   cubin in worker processes, in a fresh temporary TRITON_CACHE_DIR (nothing is reused between runs: a
   cached kernel would not run ptxas and report nothing); registers and spill stores / loads from
   ptxas -v, shared memory from the compiled kernel's metadata.
4. Check (`failures`): compile errors, configs that could not launch on the device (shared memory over
   the per-block limit, more registers than the SM has for one block), and spills not declared in the
   kernel module's `SPILLS_MEASURED` (a spilling config must be removed or kept there with its measured
   size and the reason).

Occupancy (`occupancy`) follows the CUDA occupancy calculator's rules with the per-SM limits in DEVICES.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import multiprocessing
import os
import re
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from flashtrain.model.kernels.select import HAS_TRITON, recording
from flashtrain.train.config import compose
from flashtrain.train.plan.estimate import SimulatedRank

if HAS_TRITON:  # the gate compiles Triton kernels; without Triton (macOS) it cannot run, but the module still imports
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import create_function_from_signature

# every module holding Triton kernels (tests/test_compile_gate.py checks that no other module autotunes one)
KERNEL_MODULES = ("flashtrain.model.kernels.sparse_attention", "flashtrain.model.kernels.index_topk",
                  "flashtrain.model.kernels.mhc", "flashtrain.model.kernels.fp8_gemm",
                  "flashtrain.train.optim.newton_schulz",
                  "flashtrain.train.optim.sinkhorn")

# one of each CSA2 role of the 40-layer pattern, both Engram modules (tests/layer_plans.py EIGHT_LAYERS):
# 0 SWA | 1 SWA + Engram | 2 Full (ratio 2) | 3 Reuse | 4 Reuse + Engram | 5 Full (ratio 1, candidate source)
# | 6 Reindex | 7 Reuse of the reindexed top-k
ROLE_LAYERS = ("model.n_layers=8", "model.compress_ratios=[0,0,2,2,2,1,1,1]", "model.kv_source_layers=[2,5]",
               "model.index_source_layers=[2,5,6]", "model.candidate_source_layer=5",
               "model.engram_layer_ids=[1,4]")
TRACE_SHORTCUTS = (*ROLE_LAYERS, "model.n_routed_experts=8", "model.vision_n_layers=0", "parallel.ep=1",
                   "parallel.pp=1", "parallel.cp=1", "parallel.world=null")
CUDA_PATH = ("optim.muon.ns_dtype=bfloat16",)  # the CUDA default of ns_dtype=null (train/optim/newton_schulz.py)
# kernels an exp switches on, traced switched on whatever the exp says, so that they are compiled at its shapes:
# the FP8 Linears' GEMMs (model/fp8_linear.py; they change no other launch: a Linear's output is autocast's
# dtype either way)
SWITCHED_ON = ("model.fp8.enabled=true",)

ARCHS = {"sm_90a": 90, "sm_100a": 100}


@dataclass(frozen=True)
class DeviceLimits:
    """Per-SM and per-block limits of one GPU (CUDA C++ Programming Guide, "Technical Specifications per
    Compute Capability", columns 9.0 and 10.0; allocation granularities from the CUDA Occupancy
    Calculator: registers per warp in units of 256, shared memory per block in units of 128 bytes plus
    1 KiB the system reserves per block on compute capability >= 8.0)."""
    name: str
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    max_threads_per_block: int = 1024
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 228 * 1024
    smem_per_block: int = 227 * 1024  # the opt-in maximum of one block (Triton opts in)
    smem_reserved_per_block: int = 1024
    reg_unit: int = 256
    smem_unit: int = 128
    tmem_columns: int = 0  # tensor memory (Blackwell): 512 columns of 32-bit cells per SM


DEVICES = {"sm_90a": DeviceLimits("H100/H200"), "sm_100a": DeviceLimits("B200", tmem_columns=512)}


def occupancy(registers: int, num_warps: int, shared_bytes: int, dev: DeviceLimits) -> dict:
    """Resident blocks per SM and the occupancy (resident warps / the SM's maximum) of a kernel using
    `registers` per thread, `num_warps` per block and `shared_bytes` of shared memory, and what limits
    them; `launchable` is False (0 blocks) when one block does not fit at all."""
    regs_per_warp = math.ceil(max(registers, 1) * 32 / dev.reg_unit) * dev.reg_unit
    by_regs = (dev.regs_per_sm // regs_per_warp) // num_warps
    smem = math.ceil((shared_bytes + dev.smem_reserved_per_block) / dev.smem_unit) * dev.smem_unit
    by_smem = dev.smem_per_sm // smem if shared_bytes <= dev.smem_per_block else 0
    by_warps = dev.max_warps_per_sm // num_warps if num_warps * 32 <= dev.max_threads_per_block else 0
    limits = {"registers": by_regs, "shared memory": by_smem, "warps": by_warps, "blocks": dev.max_blocks_per_sm}
    blocks = min(limits.values())
    if registers > dev.max_regs_per_thread:
        blocks = 0
    return {"blocks_per_sm": blocks, "occupancy": blocks * num_warps / dev.max_warps_per_sm,
            "limited_by": min(limits, key=limits.get), "launchable": blocks > 0}


_PTXAS = {"registers": re.compile(r"Used (\d+) registers"),
          "spill": re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads"),
          "stack": re.compile(r"(\d+) bytes stack frame")}


def parse_ptxas(log: str) -> dict:
    """registers, spill stores / loads and stack frame bytes from ptxas -v output (one kernel)."""
    regs = _PTXAS["registers"].search(log)
    spill = _PTXAS["spill"].search(log)
    stack = _PTXAS["stack"].search(log)
    if regs is None:
        raise ValueError(f"no register count in the ptxas log: {log[-500:]!r}")
    return {"registers": int(regs.group(1)), "spill_bytes": int(spill.group(1)) if spill else 0,
            "spill_load_bytes": int(spill.group(2)) if spill else 0, "stack_bytes": int(stack.group(1)) if stack else 0}


# ---------------------------------------------------------------------------------------------- trace
def project_kernels() -> dict[str, object]:
    """name -> autotuned kernel (triton Autotuner) of every module in KERNEL_MODULES."""
    out = {}
    for mod in KERNEL_MODULES:
        for name, obj in vars(importlib.import_module(mod)).items():
            if isinstance(obj, Autotuner):
                out[name] = obj
    return out


def trace_launches(overrides: list[str]) -> list:
    """Every kernel launch of one simulated training step of `overrides` (an exp), as the CUDA path makes
    them (module docstring, step 1)."""
    cfg = compose([*overrides, *TRACE_SHORTCUTS, *CUDA_PATH, *SWITCHED_ON])
    if dist.is_initialized():
        raise RuntimeError("trace_launches needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with recording() as launches:
            sim = SimulatedRank(cfg, 1, 0, "cuda", fake)
            with fake:
                sim.module.step(next(sim.batches), None, sim.step)
        return launches
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- specialise
@dataclass
class Unit:
    """One compilation: a kernel specialised for one launch's arguments, one config, one architecture."""
    kernel: str
    file: str
    arch: str
    config: str
    variant: str  # the launch's dtypes and kernel-selecting constexprs (what else distinguishes two units)
    fn: object = field(repr=False)
    signature: dict = field(repr=False)
    constexprs: dict = field(repr=False)
    attrs: dict = field(repr=False)
    options: dict = field(repr=False)
    num_warps: int = 4
    exps: list = field(default_factory=list)


def _config_text(c) -> str:
    return ", ".join([f"{k}={v}" for k, v in c.kwargs.items()] + [f"num_warps={c.num_warps}",
                                                                   f"num_stages={c.num_stages}"])


class _Mock:
    """A tensor argument as Triton's binder sees it: a dtype and a 16-byte aligned address."""

    def __init__(self, dtype):
        self.dtype = dtype

    @staticmethod
    def data_ptr():
        return 0


def compile_units(launches: list, archs=tuple(ARCHS), exp: str = "", units: dict | None = None) -> dict:
    """{identity: Unit} for every (launch, config the autotuner would try, arch); equal specialisations
    merge (their `exps` lists the exps that need them). Pass `units` to add to an existing map."""
    units = {} if units is None else units
    names = {id(k): n for n, k in project_kernels().items()}
    distinct = {}  # launches with equal dtypes, scalars and flags specialise alike (Newton-Schulz repeats many)
    for ln in launches:
        key = (id(ln.kernel), tuple(str(a.dtype) if isinstance(a, torch.Tensor) else a for a in ln.args),
               tuple(sorted(ln.kwargs.items())))
        distinct.setdefault(key, ln)
    launches = list(distinct.values())
    for arch in archs:
        backend = make_backend(GPUTarget("cuda", ARCHS[arch], 32))
        binders = {}
        for ln in launches:
            tuner = ln.kernel
            jf = tuner.fn
            name = names.get(id(tuner), jf.__name__)
            args = [_Mock(a.dtype) if isinstance(a, torch.Tensor) else a for a in ln.args]
            tuner.nargs = dict(zip(tuner.arg_names, ln.args))
            try:
                configs = tuner.prune_configs(ln.kwargs)
            finally:
                tuner.nargs = None
            if id(jf) not in binders:
                binders[id(jf)] = create_function_from_signature(jf.signature, jf.params, backend)
            for c in configs:
                kw = {**ln.kwargs, **c.all_kwargs()}
                bound, spec, opts = binders[id(jf)](*args, **kw)
                options, signature, constexprs, attrs = jf._pack_args(backend, kw, bound, spec, opts)
                key = (arch, jf.__qualname__, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
                       repr(sorted(attrs.items())), options.hash())
                if key not in units:
                    dtypes = ",".join(str(a.dtype).replace("torch.", "") for a in ln.args
                                      if isinstance(a, torch.Tensor))
                    flags = " ".join(f"{k}={v}" for k, v in ln.kwargs.items() if k not in c.kwargs)
                    units[key] = Unit(name, jf.__module__.replace("flashtrain.", "").replace(".", "/") + ".py", arch,
                                      _config_text(c), f"{dtypes}; {flags}".strip("; "), jf, signature, constexprs,
                                      attrs, options.__dict__, c.num_warps)
                if exp and exp not in units[key].exps:
                    units[key].exps.append(exp)
    return units


# ---------------------------------------------------------------------------------------------- compile
_UNITS: list[Unit] = []  # the units of the running compile_all, inherited by its forked workers


def _compile_one(i: int) -> dict:

    u = _UNITS[i]
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v: registers and spills
    out = {"kernel": u.kernel, "config": u.config, "arch": u.arch, "variant": u.variant, "file": u.file,
           "num_warps": u.num_warps, "exps": u.exps}
    buf = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(buf), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            k = compile(ASTSource(u.fn, u.signature, u.constexprs, u.attrs),
                        target=GPUTarget("cuda", ARCHS[u.arch], 32), options=u.options)
        out.update(parse_ptxas(buf.getvalue()))
        out["shared_bytes"] = int(k.metadata.shared)
        out["tmem_columns"] = int(getattr(k.metadata, "tmem_size", 0) or 0)
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile is a result, reported and failed
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500]
    out["compile_s"] = round(time.perf_counter() - t0, 3)
    if "error" not in out:
        dev = DEVICES[u.arch]
        occ = occupancy(out["registers"], u.num_warps, out["shared_bytes"], dev)
        if out["tmem_columns"] > dev.tmem_columns:
            occ["launchable"] = False
        out.update(device=dev.name, **occ)
    return out


def compile_all(units: list[Unit], jobs: int = 1) -> list[dict]:
    """Compile every unit (module docstring, step 3) in `jobs` forked worker processes; one report entry each,
    in the order given."""
    global _UNITS
    with tempfile.TemporaryDirectory(prefix="flashtrain-compile-gate-") as cache:
        previous = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache  # fresh: every unit runs ptxas
        _UNITS = list(units)
        try:
            if jobs <= 1:
                return [_compile_one(i) for i in range(len(_UNITS))]

            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                return list(pool.map(_compile_one, range(len(_UNITS)), chunksize=1))
        finally:
            _UNITS = []
            if previous is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = previous


# ---------------------------------------------------------------------------------------------- check
def declared_spills() -> dict[tuple[str, str, str], int]:
    """(kernel, config, arch) -> the spill bytes its module declares as measured and accepted
    (`SPILLS_MEASURED` beside the configs, each with its reason in a comment)."""
    out = {}
    for mod in KERNEL_MODULES:
        for key, size in getattr(importlib.import_module(mod), "SPILLS_MEASURED", {}).items():
            out[key] = size
    return out


def failures(entries: list[dict], spills: dict | None = None) -> list[str]:
    """What makes the gate fail: a compile error, a config that cannot launch on its device, a spill larger
    than its declared size (or not declared)."""
    spills = declared_spills() if spills is None else spills
    bad = []
    for e in entries:
        where = f"{e['kernel']} [{e['config']}] {e['arch']} ({e['variant']})"
        if "error" in e:
            bad.append(f"{where}: does not compile: {e['error']}")
            continue
        if not e["launchable"]:
            bad.append(f"{where}: cannot launch on {e['device']} ({e['registers']} registers x {e['num_warps']} "
                       f"warps, {e['shared_bytes']} bytes of shared memory, limit "
                       f"{DEVICES[e['arch']].smem_per_block})")
        allowed = spills.get((e["kernel"], e["config"], e["arch"]), 0)
        if e["spill_bytes"] > allowed:
            bad.append(f"{where}: spills {e['spill_bytes']} bytes (declared: {allowed}); remove the config or "
                       f"declare it in SPILLS_MEASURED with its reason")
    return bad


def gate(exps: list[str], archs=tuple(ARCHS), jobs: int = 1, log=print,
         kernels: tuple[str, ...] = ()) -> tuple[list[dict], dict]:
    """Trace each exp, compile every unit (only those of the named `kernels` when given); (entries, timings)."""
    t0 = time.perf_counter()
    units: dict = {}
    n_launches = {}
    names = {id(k): n for n, k in project_kernels().items()}
    for exp in exps:
        launches = trace_launches([f"+exp={exp}"])
        if kernels:
            launches = [ln for ln in launches if names.get(id(ln.kernel)) in kernels]
        n_launches[exp] = len(launches)
        compile_units(launches, archs, exp, units)
        log(f"{exp}: {len(launches)} launches traced ({time.perf_counter() - t0:.1f} s)")
    t1 = time.perf_counter()
    ordered = sorted(units.values(), key=lambda u: (u.file, u.kernel, u.variant, u.config, u.arch))
    log(f"{len(ordered)} compilations ({len({(u.kernel, u.variant, u.config) for u in ordered})} kernel "
        f"specialisations x configs, {len(archs)} architectures), {jobs} worker(s)")
    entries = compile_all(ordered, jobs)
    t2 = time.perf_counter()
    return entries, {"trace_s": round(t1 - t0, 1), "compile_s": round(t2 - t1, 1), "launches": n_launches,
                     "compilations": len(ordered), "jobs": jobs}


def markdown_table(entries: list[dict]) -> str:
    """The gate's report as the table in docs/kernels.md: one row per kernel x launch variant x config, the
    two architectures side by side (registers / spill stores in bytes / shared memory in KiB / resident
    blocks per SM and occupancy on H100 for sm_90a, on B200 for sm_100a), and the exps that launch it."""
    rows: dict[tuple, dict] = {}
    for e in entries:
        rows.setdefault((e["file"], e["kernel"], e["variant"], e["config"]), {})[e["arch"]] = e

    def cell(e: dict | None) -> str:
        if e is None:
            return "-"
        if "error" in e:
            return "does not compile"
        spill = f" (+{e['spill_bytes']} spill)" if e["spill_bytes"] else ""
        return (f"{e['registers']}{spill} / {e['shared_bytes'] / 1024:.1f} KiB / {e['blocks_per_sm']} x "
                f"{e['num_warps']}w = {e['occupancy']:.0%}" + ("" if e["launchable"] else " NOT LAUNCHABLE"))

    archs = sorted({e["arch"] for e in entries}, key=lambda a: ARCHS[a])
    head = " | ".join(f"{a} ({DEVICES[a].name}): regs / smem / blocks x warps = occupancy" for a in archs)
    lines = [f"| kernel | launch (dtypes; flags) | config | exps | {head} |", "|" + "---|" * (4 + len(archs))]
    for (_, kernel, variant, config), by_arch in sorted(rows.items()):
        exps = ", ".join(next(iter(by_arch.values()))["exps"])
        lines.append(f"| `{kernel}` | {variant} | {config} | {exps} | "
                     + " | ".join(cell(by_arch.get(a)) for a in archs) + " |")
    return "\n".join(lines)
