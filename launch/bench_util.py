"""Timing helpers shared by launch/bench_*.py: compared runs alternate in one process, and each comparison
is reported as the median of per-round ratios with its spread.

A machine's speed drifts (other jobs, frequency scaling, thermal limits, the page cache). Timing variant
A in one block and variant B in a later block folds that drift into the A/B ratio; alternating them
round by round (A B, B A, A B, ...: the order flips every round, so neither side always runs first)
puts both sides of a round under nearly the same conditions, and the spread of the per-round ratios
shows how much to trust the median.

    times = alternate({"ours": step_a, "baseline": step_b}, rounds=5, warmup=1)
    summary = ratio_summary(times["ours"], times["baseline"])   # per-round ours / baseline
    print(format_ratio(summary))   # 0.53 (min 0.49, max 0.58, IQR 0.51-0.55; 5 rounds)

Every timed call is bracketed by `sync` (CUDA: `torch.cuda.synchronize()`, so queued kernels are
counted), measured with `time.perf_counter`; a garbage collection runs before each call, untimed.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from typing import Callable, Sequence


def cuda_sync() -> Callable[[], None] | None:
    """`torch.cuda.synchronize` when CUDA is in use in this process, else None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.synchronize
    return None


def alternate(runs: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
              sync: Callable[[], None] | None = None, flip: bool = True,
              cpu_times: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Call every run once per round, in the order of `runs` (reversed in every other round when `flip`),
    `warmup` untimed-for-the-result rounds first. Returns {name: [seconds of round 0, 1, ...]}: the
    measured rounds only, round i of every run side by side, so per-round ratios pair up.

    `sync` is called right before the clock starts and right before it stops (None: `cuda_sync()`,
    looked up at each round, so CUDA initialised by the first run is seen; pass e.g. `dist.barrier`
    to line ranks up). `cpu_times`: a dict to fill, the same way, with the CPU time this process spent in
    each call (`time.process_time`: user + system time of all its threads)."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"alternate: rounds={rounds} must be >= 1 and warmup={warmup} >= 0")
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names[::-1] if flip and r % 2 else names
        for name in order:
            s = sync or cuda_sync() or _nothing
            gc.collect()
            s()
            c0 = time.process_time()
            t0 = time.perf_counter()
            runs[name]()
            s()
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            if r >= warmup:
                times[name].append(dt)
                if cpu_times is not None:
                    cpu_times.setdefault(name, []).append(dc)
    return times


def _nothing() -> None:
    return None


def quartiles(xs: Sequence[float]) -> tuple[float, float]:
    """(Q1, Q3), linear interpolation between the sorted values (one value: both are that value)."""
    if len(xs) == 1:
        return float(xs[0]), float(xs[0])
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q3


def ratio_summary(a_times: Sequence[float], b_times: Sequence[float]) -> dict:
    """Per-round ratios a[i] / b[i] of two alternated runs: their median, min, max, quartiles and IQR,
    the number of rounds, and each side's median time (seconds)."""
    if len(a_times) != len(b_times) or not a_times:
        raise ValueError(f"ratio_summary needs two equally long, non-empty lists ({len(a_times)} and {len(b_times)})")
    ratios = [a / b for a, b in zip(a_times, b_times)]
    q1, q3 = quartiles(ratios)
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "q1": q1, "q3": q3,
            "iqr": q3 - q1, "rounds": len(ratios), "ratios": ratios,
            "a_median_s": statistics.median(a_times), "b_median_s": statistics.median(b_times)}


def format_ratio(s: dict) -> str:
    """`0.53 (min 0.49, max 0.58, IQR 0.51-0.55; 5 rounds)`."""
    return (f"{s['median']:.2f} (min {s['min']:.2f}, max {s['max']:.2f}, IQR {s['q1']:.2f}-{s['q3']:.2f}; "
            f"{s['rounds']} round{'s' if s['rounds'] != 1 else ''})")


def take_int(argv: list[str], names: str | tuple[str, ...], default):
    """`--name N` out of argv (any of `names`): (N, argv without it)."""
    value, argv = take_str(argv, names, None)
    return (default if value is None else int(value)), argv


def take_str(argv: list[str], names: str | tuple[str, ...], default):
    """`--name VALUE` out of argv (any of `names`): (VALUE, argv without it)."""
    for name in (names,) if isinstance(names, str) else names:
        if name in argv:
            i = argv.index(name)
            if i + 1 >= len(argv):
                raise SystemExit(f"error: {name} needs a value")
            return argv[i + 1], argv[:i] + argv[i + 2:]
    return default, argv


def _running() -> int | None:
    """Tasks running or runnable right now, machine-wide, this one included (/proc/stat `procs_running`)."""
    try:
        with open("/proc/stat") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
    except (OSError, StopIteration, ValueError):
        return None


class MachineLoad:
    """What else the machine does while a section runs, printed with its figures: the load averages (1, 5,
    15 minutes: runnable + uninterruptible tasks) at the start and the end, the CPUs (and those this process
    may use), and the tasks running or runnable (this one included), sampled every `every_s` seconds by a
    thread that sleeps in between -- the 1-minute average lags a load that changes within the section.

        with MachineLoad() as load:
            times = alternate(...)
        load.summary()   # {"loadavg_start", "loadavg_end", "cpus", "cpus_usable", "running_mean", "running_max"}
    """

    def __init__(self, every_s: float = 0.5):
        import os
        import threading

        self.every_s, self.samples, self._stop = every_s, [], threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.cpus = os.cpu_count()
        self.cpus_usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else self.cpus

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            n = _running()
            if n is not None:
                self.samples.append(n)

    def __enter__(self) -> MachineLoad:
        import os

        self.start = [round(x, 2) for x in os.getloadavg()]
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import os

        self._stop.set()
        self._thread.join()
        self.end = [round(x, 2) for x in os.getloadavg()]

    def summary(self) -> dict:
        return {"loadavg_start": self.start, "loadavg_end": self.end, "cpus": self.cpus,
                "cpus_usable": self.cpus_usable,
                "running_mean": round(statistics.mean(self.samples), 2) if self.samples else None,
                "running_max": max(self.samples) if self.samples else None, "running_samples": len(self.samples)}


def format_load(load: dict) -> str:
    """`2 CPUs; 2.6 tasks running on average (max 4; this one included), load average 1.9 -> 2.4`."""
    running = (f"{load['running_mean']:.1f} tasks running on average (max {load['running_max']}; this one included)"
               if load.get("running_mean") is not None else "tasks running: not sampled")
    return (f"{load['cpus_usable']} CPUs; {running}, load average (1 min) {load['loadavg_start'][0]:.2f} -> "
            f"{load['loadavg_end'][0]:.2f}")


if __name__ == "__main__":
    from flashtrain.config.cli import exit_with_help

    exit_with_help(__doc__ + "\nThis is the bench_*.py tools' helper module, imported by them; it takes no arguments "
                   "and runs nothing by itself.", sys.argv[1:], overrides=False)
    print("error: launch/bench_util.py is the timing helper of the bench_*.py tools, not a command (--help: what "
          "it holds)", file=sys.stderr)
    raise SystemExit(2)
