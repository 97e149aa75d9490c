"""Which layout fits N GPUs of M GB (`launch/plan.py +exp=NAME --gpus N --gpu-memory GB`; docs/parallelism.md
"Choosing a layout"): a search over pipeline x context x expert x data parallelism, pipeline schedule and
recompute mode, priced by the partitioner's cost model (parallel/partition.py: the per-stage bytes and
the partition the trainer itself builds, train/plan/stages.py) and ranked by a step-time estimate
(parallel/step_time.py).

For every pp (a divisor of N) and cp (a divisor of N / pp), dp = N / (pp x cp) readers share the global
batch of G = train.global_batch_tokens / data.seq_len sequences: M = G / dp micro-batches of one sequence
per pipeline, in one round. For each pp, recompute mode and schedule (`plan.recompute`, `plan.schedules`),
the smallest cp and, at it, the smallest ep (a divisor of dp x cp and of the routed experts) whose
layout fits: every rank's cost-model bytes (the sum of its two stages for the interleaved and V-shaped
schedules) within the budget (`budget_bytes`: --gpu-memory less `plan.headroom`, less the cost model's
largest stated under-estimate, `plan.cost_model_error`: 80 GB -> 72 -> 64.8), under the partition the
trainer builds with parallel.gpu_memory_gb set to that budget (the fastest slowest stage among the splits that fit). The
smallest cp and ep because memory falls as they grow while their exchanges grow, and smaller pieces of
work per rank run less efficiently (which the step-time estimate does not model). These layouts are then
ranked by the step-time estimate.

Micro-batching: data.batch_size=1 and parallel.microbatches=null (one round) in every proposal. In the
cost model a larger micro-batch only adds activation memory, and fewer micro-batches per round only add
pipeline bubble, so a layout that fits with more sequences per micro-batch or more rounds fits, and is
not slower, with one and one round (the estimate does not model kernel efficiency, which favours larger
micro-batches on short sequences).

What rules a layout out, at the largest ep (the least memory):
- `divisibility`: it cannot be built -- cp does not divide N / pp, dp does not divide the global batch,
  fewer micro-batches than the schedule needs, more stages than layers, a sequence too short for cp chunks;
- `state`: on the rank that sets the peak of the memory-first partition, parameters, gradients and
  optimizer state alone exceed the budget;
- `engram`: that rank holds an Engram layer (its table's state, and the table gradient's working set)
  and every rank without one fits;
- `activations`: otherwise -- what the micro-batches in flight keep for backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from omegaconf import DictConfig, OmegaConf

from flashtrain.config.errors import ConfigError
from flashtrain.config.typed import typed_config
from flashtrain.model.sequence_split import chunk_ranges
from flashtrain.parallel.config import SCHEDULES, ParallelConfig, splits_backward
from flashtrain.parallel.construct import model_template
from flashtrain.parallel.dims import ParallelDims
from flashtrain.parallel.partition import UnitInventory, in_flight_microbatches, in_flight_states, partition, rank_costs
from flashtrain.parallel.pipeline import stage_ids
from flashtrain.parallel.step_time import Hardware, StepTime, step_time
from flashtrain.train.config import global_sequences, model_config, optim_config
from flashtrain.train.plan.stages import optimizer_state_of, partition_costs

RECOMPUTE_MODES = ("none", "selective", "full")
REASONS = {  # why a layout is ruled out, as the summary names it
    "divisibility": "world-size / batch divisibility",
    "state": "state (parameters, gradients, optimizer state)",
    "engram": "the Engram stage",
    "activations": "activations",
}
TOL = 1 + 1e-9  # the partitioner's tolerance on a budget


@dataclass
class PlanConfig:
    """The `plan` group (conf/plan/default.yaml documents every key)."""
    headroom: float = 0.10
    show: int = 5
    recompute: list = field(default_factory=lambda: list(RECOMPUTE_MODES))
    schedules: list = field(default_factory=lambda: list(SCHEDULES))
    cost_model_error: list = field(default_factory=lambda: [-0.10, 0.05])
    gpu_tflops: float = 400.0
    gpus_per_node: int = 8
    intra_node_gb_s: float = 400.0
    inter_node_gb_s: float = 50.0

    def validate(self) -> None:
        if not 0 <= self.headroom < 1:
            raise ConfigError(f"plan.headroom={self.headroom}: the share of GPU memory kept free, in [0, 1)")
        if self.show < 1:
            raise ConfigError(f"plan.show={self.show}: the number of layouts printed, >= 1")
        if not self.recompute or set(self.recompute) - set(RECOMPUTE_MODES):
            raise ConfigError(f"plan.recompute={self.recompute}: a non-empty list of {', '.join(RECOMPUTE_MODES)}")
        if not self.schedules or set(self.schedules) - set(SCHEDULES):
            raise ConfigError(f"plan.schedules={self.schedules}: a non-empty list of {', '.join(SCHEDULES)}")
        if len(self.cost_model_error) != 2 or not self.cost_model_error[0] <= 0 <= self.cost_model_error[1]:
            raise ConfigError(f"plan.cost_model_error={self.cost_model_error}: [below, above] as fractions, e.g. "
                              f"[-0.10, 0.08]")
        if min(self.gpu_tflops, self.gpus_per_node, self.intra_node_gb_s, self.inter_node_gb_s) <= 0:
            raise ConfigError("plan.gpu_tflops, plan.gpus_per_node, plan.intra_node_gb_s and plan.inter_node_gb_s "
                              "must be positive")

    @property
    def hardware(self) -> Hardware:
        return Hardware(self.gpu_tflops, self.gpus_per_node, self.intra_node_gb_s, self.inter_node_gb_s)


def plan_config(conf: DictConfig) -> PlanConfig:
    return typed_config(PlanConfig, OmegaConf.to_container(conf.get("plan") or {}, resolve=True), "plan")


@dataclass
class Layout:
    """One point of the search: degrees, schedule, recompute; with its partition and cost-model memory
    (`rank_bytes` / `rank_state`: per pipeline position) once evaluated, its step time if it fits, else
    why not (`reason`)."""
    pp: int
    cp: int
    ep: int
    dp: int
    schedule: str
    recompute: str
    microbatches: int
    stage_layers: list[int] = field(default_factory=list)
    bounds: list[tuple[int, int]] = field(default_factory=list)  # each stage's [start, end) blocks
    stages_of_rank: list[list[int]] = field(default_factory=list)
    rank_bytes: list[int] = field(default_factory=list)
    rank_state: list[int] = field(default_factory=list)
    rank_flops: list[float] = field(default_factory=list)
    time: StepTime | None = None
    reason: str | None = None
    detail: str = ""
    memory_first: bool = False  # the partition minimises memory (parallel.gpu_memory_gb=null) rather than time

    @property
    def fits(self) -> bool:
        return self.reason is None and self.time is not None

    @property
    def peak_bytes(self) -> int:
        return max(self.rank_bytes) if self.rank_bytes else 0

    @property
    def worst_position(self) -> int:
        """The pipeline position whose ranks need the most memory."""
        return max(range(len(self.rank_bytes)), key=lambda r: self.rank_bytes[r]) if self.rank_bytes else 0

    def worst_rank(self, world: int) -> int:
        """The first global rank of the worst pipeline position (the mesh is pp-major)."""
        return self.worst_position * (world // self.pp)

    @property
    def imbalance(self) -> float:
        """Pipeline compute imbalance: the slowest rank's FLOPs over the mean rank's."""
        if not self.rank_flops:
            return 1.0
        return max(self.rank_flops) / (sum(self.rank_flops) / len(self.rank_flops))

    def label(self) -> str:
        return (f"pp={self.pp} cp={self.cp} ep={self.ep} dp={self.dp}" +
                (f" {self.schedule}" if self.pp > 1 else "") + f" recompute={self.recompute}")

    def overrides(self, world: int, seq_len: int, budget_gb: float) -> list[str]:
        """Hydra overrides that build this layout, ready to paste after +exp=NAME."""
        return [f"parallel.world={world}", f"parallel.pp={self.pp}", f"parallel.cp={self.cp}",
                f"parallel.ep={self.ep}", f"parallel.pipeline_schedule={self.schedule}",
                "parallel.microbatches=null", "parallel.stage_layers=null",
                *(["parallel.gpu_memory_gb=null", "parallel.partition_memory_slack=0"] if self.memory_first
                  else [f"parallel.gpu_memory_gb={budget_gb:g}"]),
                f"train.recompute={self.recompute}", f"data.seq_len={seq_len}", "data.batch_size=1"]

    def as_dict(self, world: int, seq_len: int, budget_gb: float) -> dict:
        out = {"pp": self.pp, "cp": self.cp, "ep": self.ep, "dp": self.dp, "pipeline_schedule": self.schedule,
               "recompute": self.recompute, "microbatches": self.microbatches, "fits": self.fits,
               "reason": self.reason, "detail": self.detail, "peak_bytes": self.peak_bytes,
               "rank_bytes": self.rank_bytes, "rank_state_bytes": self.rank_state, "stage_layers": self.stage_layers,
               "stages_of_rank": self.stages_of_rank, "worst_rank": self.worst_rank(world),
               "imbalance_compute": self.imbalance}
        if self.time is not None:
            out.update(step_s=self.time.step_s, bubble_fraction=self.time.bubble, compute_s=self.time.compute_s,
                       comm_s=self.time.comm_s, overrides=self.overrides(world, seq_len, budget_gb))
        return out


def round_sig(x: float, how=round, digits: int = 3) -> float:
    """`x` to `digits` significant digits, rounded by `how` (round, math.floor, math.ceil)."""
    if x <= 0:
        return x
    unit = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return float(f"{how(x / unit) * unit:.{digits}g}")


def budget_bytes(gpu_memory_gb: float, plan: PlanConfig) -> float:
    """The cost-model bytes a rank may use on a GPU of `gpu_memory_gb`: the GPU less `plan.headroom` (the
    allocator, communication buffers) is what its real peak may reach, and the cost model may lie as far
    below the estimator's simulation as its stated error says (`plan.cost_model_error`, the first: -10%),
    so its figure must stay that much lower: 80 GB -> 72 GB -> 64.8 GB. Rounded down to 3 significant
    digits: the parallel.gpu_memory_gb a proposal pastes, in GB."""
    return round_sig(gpu_memory_gb * 1e9 * (1 - plan.headroom) * (1 + plan.cost_model_error[0]), math.floor)


def gb(n: float) -> str:
    """Bytes as GB: one decimal, or three significant digits below 1 GB."""
    return f"{n / 1e9:.1f}" if n >= 1e9 else f"{n / 1e9:.3g}"


def _ranges(ids: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x > start else f"{x}")
            start = None
    return ", ".join(out)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class LayoutSearch:
    """The search of the module docstring for one configuration (`conf`, composed with the user's
    overrides), built once and run for any GPU count (`run`)."""

    def __init__(self, conf: DictConfig, gpu_memory_gb: float, plan: PlanConfig | None = None):
        self.conf, self.plan = conf, plan or plan_config(conf)
        self.model_cfg, self.optim_cfg = model_config(conf), optim_config(conf)
        self.parallel = typed_config(ParallelConfig, OmegaConf.to_container(conf.parallel, resolve=True), "parallel")
        self.seq_len = int(conf.data.seq_len)
        self.global_sequences = global_sequences(float(conf.train.global_batch_tokens), self.seq_len)
        self.gpu_memory_gb = gpu_memory_gb
        self.usable = gpu_memory_gb * 1e9 * (1 - self.plan.headroom)  # what a rank's real peak may reach
        self.budget = budget_bytes(gpu_memory_gb, self.plan)  # what its cost-model peak may reach
        template = model_template(self.model_cfg)
        self.inventory = UnitInventory(template, self.model_cfg, optimizer_state_of(template, self.model_cfg,
                                                                               self.optim_cfg))
        self.engram_layers = set(self.model_cfg.engram_layer_ids)
        self._units: dict = {}

    @property
    def budget_gb(self) -> float:
        return round_sig(self.budget / 1e9)

    def units(self, world: int, pp: int, cp: int, ep: int, recompute: str) -> list[dict]:
        key = (world // pp, cp, ep, recompute, pp > 1)
        if key not in self._units:
            par = replace(self.parallel, pp=pp, cp=cp, ep=ep)
            dp = world // (pp * cp)  # one round of one sequence per micro-batch (the module docstring)
            costs = partition_costs(self.model_cfg, self.optim_cfg, par, recompute, True, world // pp,
                                    self.global_sequences // dp)
            self._units[key] = self.inventory.costs(self.seq_len, 1, costs, -(-self.seq_len // cp))
        return self._units[key]

    # --- one layout ------------------------------------------------------------------------------
    def _why_not_buildable(self, world: int, pp: int, cp: int, schedule: str) -> str | None:
        n_layers = self.model_cfg.n_layers
        if pp > n_layers:
            return f"pp={pp} exceeds the {n_layers} layers"
        dp = world // (pp * cp)
        g = self.global_sequences
        if g % dp:
            return f"dp={dp} does not divide the global batch of {g} sequences"
        par = ParallelConfig(pp=pp, pipeline_schedule=schedule)
        if par.n_stages > n_layers:
            return f"{par.n_stages} stages ({schedule}) exceed the {n_layers} layers"
        try:
            par.round_microbatches(g // dp)
        except ConfigError:
            return f"{g // dp} micro-batches per pipeline are too few for {schedule} with {par.n_stages} stages"
        if cp > 1:
            try:
                chunk_ranges(self.seq_len, cp, self.parallel.cp_balance)
            except ConfigError:
                return f"a sequence of {self.seq_len} tokens is too short for cp={cp}"
        return None

    def evaluate(self, layout: Layout, world: int, budget: float | None) -> bool:
        """Partition `layout` and fill its per-rank bytes; True when every rank fits `budget`. The
        trainer's partition within `budget` (parallel.gpu_memory_gb) first; where that leaves a rank
        over it (a rank holding two stages: its local search is not exact), the memory-first one
        (parallel.gpu_memory_gb=null; `layout.memory_first`). `budget` None: memory-first."""
        if budget is not None and self._partition(layout, world, budget) and layout.peak_bytes <= budget * TOL:
            layout.memory_first = False
            return True
        layout.memory_first = True
        return self._partition(layout, world, None) and (budget is None or layout.peak_bytes <= budget * TOL)

    def _partition(self, layout: Layout, world: int, budget: float | None) -> bool:
        par = ParallelConfig(pp=layout.pp, ep=layout.ep, cp=layout.cp, pipeline_schedule=layout.schedule)
        units = self.units(world, layout.pp, layout.cp, layout.ep, layout.recompute)
        flight = in_flight_microbatches(layout.pp, layout.schedule, layout.microbatches)
        states = in_flight_states(layout.pp, layout.schedule, layout.microbatches)
        ranks = [stage_ids(par, r) for r in range(layout.pp)]
        try:
            bounds = partition(units, par.n_stages, None, flight, 0.0, budget, ranks, states)
        except ConfigError:  # no split fits the budget
            return False
        layout.stage_layers = [b - a for a, b in bounds]
        layout.stages_of_rank = ranks
        layout.rank_bytes = [int(b) for b in rank_costs(units, bounds, ranks, states)]
        layout.rank_state = [sum(u["state_bytes"] for s in r for u in units[bounds[s][0]:bounds[s][1]])
                             for r in ranks]
        layout.rank_flops = [sum(u["flops_per_token"] for s in r for u in units[bounds[s][0]:bounds[s][1]])
                             for r in ranks]
        layout.bounds = bounds
        return True

    def _time(self, layout: Layout, world: int) -> None:
        units = self.units(world, layout.pp, layout.cp, layout.ep, layout.recompute)
        dims = ParallelDims(world, layout.pp, world // (layout.pp * layout.cp), layout.ep, cp=layout.cp)  # (checked)
        layout.time = step_time(self.model_cfg, units, layout.bounds, layout.stages_of_rank, layout.schedule, dims,
                                micro_batch=1, seq_len=self.seq_len, microbatches=layout.microbatches,
                                recompute=layout.recompute, hw=self.plan.hardware)

    @staticmethod
    def _layers(layout: Layout, position: int) -> list[int]:
        """The layers pipeline position `position` holds."""
        at, layers = 0, []
        for s, n in enumerate(layout.stage_layers):
            if s in layout.stages_of_rank[position]:
                layers += list(range(at, at + n))
            at += n
        return layers

    def _rule_out(self, layout: Layout, world: int) -> None:
        """Why `layout` (at its largest ep) cannot fit: what its memory-first partition's worst rank holds."""
        self.evaluate(layout, world, None)
        r = layout.worst_position
        peak, state = layout.rank_bytes[r], layout.rank_state[r]
        layers = self._layers(layout, r)
        where = f"pipeline rank {r} (layers {_ranges(layers)})" if layout.pp > 1 else "each rank"
        others = [b for p, b in enumerate(layout.rank_bytes) if not self.engram_layers & set(self._layers(layout, p))]
        if state > self.budget:
            layout.reason = "state"
            layout.detail = f"{where}: {gb(state)} GB of state alone, over the {gb(self.budget)} GB budget"
        elif self.engram_layers & set(layers) and others and max(others) <= self.budget * TOL:
            layout.reason = "engram"
            engram = sorted(self.engram_layers & set(layers))
            layout.detail = (f"{where}, with Engram layer {', '.join(map(str, engram))}: {gb(peak)} GB "
                             f"(state {gb(state)})")
        else:
            layout.reason = "activations"
            layout.detail = f"{where}: {gb(peak)} GB, of which state {gb(state)}"

    # --- the search --------------------------------------------------------------------------------
    def groups(self, world: int):
        """(pp, recompute, schedule) of the search, each with its cp degrees in increasing order."""
        for pp in divisors(world):
            for recompute in self.plan.recompute:
                for schedule in (self.plan.schedules if pp > 1 else ["1f1b"]):
                    if recompute != "none" and splits_backward(schedule, pp):
                        continue  # selective: refused (parallel.config.check_recompute_with_schedule); full: unpriced
                        # (the split backward keeps the rebuilt blocks between its two passes: on flash_tiny at
                        # pp=2 ZBV, 40.3 MB simulated with full recomputation, 14.5 MB without)
                    yield pp, recompute, schedule, divisors(world // pp)

    def expert_degrees(self, world: int, pp: int) -> list[int]:
        """ep values of a stage's dp x cp ranks: divisors of dp x cp and of the routed experts."""
        return [e for e in divisors(world // pp) if self.model_cfg.n_routed_experts % e == 0]

    def run(self, world: int, first_fit: bool = False) -> "SearchResult":
        """The search for `world` GPUs: per (pp, recompute, schedule) the smallest cp, and at it the smallest
        ep, that fit (module docstring); the smaller cp that do not fit are ruled out, by reason. `first_fit`:
        stop at the first layout that fits (and rule nothing out in detail)."""
        result = SearchResult(world, self.gpu_memory_gb, self.budget, self.seq_len, self.global_sequences)
        for pp, recompute, schedule, cps in self.groups(world):
            for cp in cps:
                dp = world // (pp * cp)
                why = self._why_not_buildable(world, pp, cp, schedule)
                layout = Layout(pp, cp, 0, dp, schedule, recompute, 0 if why else self.global_sequences // dp)
                result.considered += 1
                if why:
                    layout.reason, layout.detail = "divisibility", why
                    result.ruled_out.append(layout)
                    continue
                eps = self.expert_degrees(world, pp)
                layout.ep = eps[-1]
                if not self.evaluate(layout, world, self.budget):
                    if not first_fit:
                        self._rule_out(layout, world)
                        result.ruled_out.append(layout)
                    continue
                lo, hi = 0, len(eps) - 1  # the smallest ep that fits (memory falls as ep grows)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if self.evaluate(replace(layout, ep=eps[mid]), world, self.budget):
                        hi = mid
                    else:
                        lo = mid + 1
                layout.ep = eps[lo]
                self.evaluate(layout, world, self.budget)
                self._time(layout, world)
                result.fitting.append(layout)
                if first_fit:
                    return result
                break  # a larger cp fits too, with more communication
        order = {m: i for i, m in enumerate(RECOMPUTE_MODES)}
        result.fitting.sort(key=lambda x: (round(x.time.step_s, 9), x.ep, x.cp, x.pp, order[x.recompute]))
        return result

    def smallest_world(self, world: int, max_factor: int = 1024) -> int | None:
        """The smallest power-of-two multiple of `world` (up to `max_factor` x) with a layout that fits."""
        factor = 2
        while factor <= max_factor:
            if self.run(world * factor, first_fit=True).fitting:
                return world * factor
            factor *= 2
        return None

    def configured_layout(self, world: int) -> Layout | None:
        """The configuration's own layout (its parallel.pp / cp / ep / schedule and train.recompute) for
        `world` GPUs, evaluated like the search's (None if it cannot be built on `world`)."""
        p = self.parallel
        if world % (p.pp * p.cp) or (world // p.pp) % p.ep or self.model_cfg.n_routed_experts % p.ep:
            return None
        dp = world // (p.pp * p.cp)
        why = self._why_not_buildable(world, p.pp, p.cp, p.pipeline_schedule)
        layout = Layout(p.pp, p.cp, p.ep, dp, p.pipeline_schedule, str(self.conf.train.recompute),
                        0 if why else self.global_sequences // dp)
        if why:
            layout.reason, layout.detail = "divisibility", why
            return layout
        if self.evaluate(layout, world, self.budget):
            self._time(layout, world)
        else:
            self._rule_out(layout, world)
        return layout


@dataclass
class SearchResult:
    world: int
    gpu_memory_gb: float
    budget: float
    seq_len: int
    global_sequences: int
    considered: int = 0
    fitting: list[Layout] = field(default_factory=list)
    ruled_out: list[Layout] = field(default_factory=list)

    def by_reason(self) -> dict[str, list[Layout]]:
        out: dict[str, list[Layout]] = {}
        for layout in self.ruled_out:
            out.setdefault(layout.reason, []).append(layout)
        return out

    def smallest_memory_gb(self, plan: PlanConfig) -> float | None:
        """The GPU memory (GB) at which the least demanding buildable layout would fit."""
        peaks = [x.peak_bytes for x in self.ruled_out if x.reason != "divisibility" and x.rank_bytes]
        peaks += [x.peak_bytes for x in self.fitting]
        if not peaks:
            return None
        need = min(peaks)
        gb_ = round_sig(need / (1 - plan.headroom) / (1 + plan.cost_model_error[0]) / 1e9, math.ceil)
        while budget_bytes(gb_, plan) < need:  # the budget is rounded down
            gb_ = round_sig(gb_ * 1.001, math.ceil)
        return gb_
