"""Profiling of chosen training steps (`train.profile`, conf/train/default.yaml).

- `steps: [a, b]` (1-based optimizer steps, inclusive; null or [] = off): a `torch.profiler` trace of
  steps a..b (CPU activity, plus CUDA on a GPU) written as a Chrome trace to
  `<run dir>/profile/trace_steps_a-b.json` (`..._rank<R>.json` when the run has more than one process),
  readable in Perfetto (ui.perfetto.dev) or chrome://tracing. Every module's forward runs inside a
  `record_function` named by its module path (`layers.3.attn`, `layers.3.ffn.experts`, ...), and every
  step inside `train_step#<n>`: eager PyTorch's profiler names no modules by path by itself
  (`with_modules` is TorchScript-only, `with_stack` gives class names). A module the model drives through
  other methods than `forward` (the compressor's project / pool, the indexer's scoring) shows through the
  submodules it calls (`layers.2.attn.compressor.norm`) inside its caller's span. The backward's operators are
  linked to their forward by the autograd sequence numbers in the trace; a forward recomputed in the
  backward (`train.recompute`) shows its module names again. Steps outside a..b run without hooks.
- `memory_snapshot: true` (CUDA only): the caching allocator's history
  (`torch.cuda.memory._record_memory_history`) over `memory_steps` -- an int n: the first n steps this
  process runs (from the resumed step on a restart), or [a, b] like `steps` -- dumped as
  `<run dir>/profile/memory_snapshot_steps_a-b.pickle` (rank-suffixed likewise) for
  https://pytorch.org/memory_viz. On a CPU run it logs once that it is CUDA-only and records nothing.

The trainer calls `step_begin(n)` before optimizer step n, `step_end(n)` after it and `close()` when it
stops early; files are written when the last step of a range ends (or the run's last step, or `close()`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flashtrain.config.errors import ConfigError

log = logging.getLogger(__name__)


def _step_range(value, name: str) -> tuple[int, int] | None:
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2 or
            not all(isinstance(v, int) and not isinstance(v, bool) for v in value) or not 1 <= value[0] <= value[1]):
        raise ConfigError(f"{name}={value!r}: use [first, last] 1-based optimizer steps with first <= last "
                          f"(e.g. [5, 6]), or null to switch it off")
    return int(value[0]), int(value[1])


@dataclass
class ProfileConfig:
    steps: list[int] | None = None  # [first, last] 1-based inclusive; None / [] = no trace
    memory_snapshot: bool = False  # CUDA allocator history (pickle for PyTorch's memory viz)
    memory_steps: int | list[int] = 3  # n: the first n steps run by this process; or [first, last]

    def validate(self) -> None:
        _step_range(self.steps, "train.profile.steps")
        m = self.memory_steps
        if isinstance(m, (list, tuple)):
            _step_range(list(m), "train.profile.memory_steps")
        elif isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"train.profile.memory_steps={m!r}: a positive number of steps, or [first, last]")


class StepProfiler:
    """Per-step hooks of `train.profile` for one process (the module docstring)."""

    def __init__(self, cfg: ProfileConfig, run_dir: str | Path, device: torch.device, model: nn.Module,
                 rank: int = 0, world: int = 1, first_step: int = 1, last_step: int | None = None):
        self.cfg, self.device, self.model = cfg, device, model
        self.out_dir = Path(run_dir) / "profile"
        self.suffix = f"_rank{rank}" if world > 1 else ""
        self.trace_range = _step_range(cfg.steps, "train.profile.steps")
        self.memory_range = None
        if cfg.memory_snapshot:
            m = cfg.memory_steps
            self.memory_range = (_step_range(list(m), "train.profile.memory_steps") if isinstance(m, (list, tuple))
                                 else (first_step, first_step + m - 1))
            if device.type != "cuda":
                log.warning("train.profile.memory_snapshot=true: the allocator history is CUDA-only; this run is on "
                            "%s, so no memory snapshot is recorded", device.type)
                self.memory_range = None
        self.last_step = last_step
        if self.trace_range and (last_step is not None and self.trace_range[0] > last_step
                                 or self.trace_range[1] < first_step):
            log.warning("train.profile.steps=%s lies outside this run's steps %s..%s: no trace",
                        list(self.trace_range), first_step, last_step)
        self._current = None  # the step begun last
        self._prof = None  # the active torch.profiler.profile
        self._trace_first = None  # the first step of the open trace
        self._hooks: list = []
        self._open: dict[int, list] = {}  # module id -> its open record_functions (re-entrant calls)
        self._step_rf = None
        self._memory_first = None  # the first step of the open allocator history

    @classmethod
    def for_trainer(cls, trainer) -> "StepProfiler":
        """The trainer's profiler, made on first use (the first step this process runs) and kept on it."""
        prof = trainer.__dict__.get("_step_profiler")
        if prof is None:
            prof = trainer._step_profiler = cls(trainer.cfg.train.profile, trainer.run_dir, trainer.device,
                                                trainer.module.model, trainer.rank, trainer.dims.world,
                                                trainer.step + 1, trainer.max_steps)
        return prof

    @property
    def active(self) -> bool:
        return self._prof is not None or self._memory_first is not None

    # -------------------------------------------------------------------------------- per step
    def step_begin(self, step: int) -> None:
        self._current = step
        if self.trace_range and self._prof is None and self.trace_range[0] <= step <= self.trace_range[1]:
            self._start_trace(step)
        if self.memory_range and self._memory_first is None and self.memory_range[0] <= step <= self.memory_range[1]:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._memory_first = step
        if self._prof is not None:
            self._step_rf = torch.profiler.record_function(f"train_step#{step}")
            self._step_rf.__enter__()

    def step_end(self, step: int) -> None:
        if self._step_rf is not None:
            self._step_rf.__exit__(None, None, None)
            self._step_rf = None
        last = self.last_step if self.last_step is not None else step
        if self._prof is not None and step >= min(self.trace_range[1], last):
            self._finish_trace(step)
        if self._memory_first is not None and step >= min(self.memory_range[1], last):
            self._finish_memory(step)

    @contextlib.contextmanager
    def step(self, step: int):
        """`step_begin(step)`, the body, `step_end(step)`; on an exception `close()` (what was recorded is
        written) and re-raise."""
        self.step_begin(step)
        try:
            yield
        except BaseException:
            self.close()
            raise
        self.step_end(step)

    def close(self) -> None:
        """Write whatever is open (a run stopping inside a range: the files are named up to the step begun
        last); a no-op otherwise."""
        if self._step_rf is not None:
            with contextlib.suppress(Exception):
                self._step_rf.__exit__(None, None, None)
            self._step_rf = None
        if self._prof is not None:
            self._finish_trace(self._current)
        if self._memory_first is not None:
            self._finish_memory(self._current)

    # ----------------------------------------------------------------------------------- trace
    def _start_trace(self, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._add_module_hooks()
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        self._trace_first = step

    def _finish_trace(self, last: int) -> None:
        prof, self._prof = self._prof, None
        try:
            prof.__exit__(None, None, None)
            path = self.out_dir / f"trace_steps_{self._trace_first}-{last}{self.suffix}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            log.info("profile: steps %s-%s traced to %s", self._trace_first, last, path)
        except Exception as e:  # noqa: BLE001 - a failed trace must never stop training
            log.warning("profile: writing the trace of steps %s.. failed: %s", self._trace_first, e)
        finally:
            self._remove_module_hooks()

    def _add_module_hooks(self) -> None:
        def pre(name):
            def hook(module, args):
                rf = torch.profiler.record_function(name)
                rf.__enter__()
                self._open.setdefault(id(module), []).append(rf)
            return hook

        def post(module, args, output):
            stack = self._open.get(id(module))
            if stack:
                stack.pop().__exit__(None, None, None)

        for name, module in self.model.named_modules():
            if name:  # the root runs through its own methods (`run`), not __call__
                self._hooks.append(module.register_forward_pre_hook(pre(name)))
                self._hooks.append(module.register_forward_hook(post, always_call=True))

    def _remove_module_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._open = {}

    # ---------------------------------------------------------------------------------- memory
    def _finish_memory(self, last: int) -> None:
        first, self._memory_first = self._memory_first, None
        try:
            path = self.out_dir / f"memory_snapshot_steps_{first}-{last}{self.suffix}.pickle"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            log.info("profile: allocator history of steps %s-%s dumped to %s (https://pytorch.org/memory_viz)",
                     first, last, path)
        except Exception as e:  # noqa: BLE001
            log.warning("profile: dumping the memory snapshot of steps %s.. failed: %s", first, e)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
