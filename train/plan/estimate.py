"""Per-GPU memory of a real training step, simulated on the CPU (launch/estimate.py; DESIGN.md "Memory").

One chosen rank of a `world`-rank layout, built by the trainer's own construction (train/build.py
`build_module`), runs its train module's own `step` (train/module.py: every micro-batch's forward and backward
through the step runner -- the configured pipeline schedule and expert all-to-alls --, gradient reduction,
clipping, the optimizer step, the MoE bias update, the step values' all-reduce) with
- fake tensors (`FakeTensorMode`): shapes, dtypes and storage sizes, no data, no arithmetic;
- a fake process group (torch's `fake` backend): every collective and point-to-point "succeeds";
- torch's `MemTracker` (torch.distributed._tools.mem_tracker) counting every tensor's storage by kind
  (parameters, buffers, gradients, optimizer state, activations, temporaries) and the peak.
The model is the rank's own share, built exactly as the trainer builds it (meta template, pruned to
its stages and expert shard, materialised), the batch is text of the configured shape.

The measured step is a steady-state one: the optimizer state exists before it starts (created by one
optimizer step on zero gradients, as the first real step creates it), as in every step after the first.
It runs as many micro-batches as the peak needs (`_peak_preserving_microbatches`: 2 without a pipeline,
pp + 1 on stage 0 and pp elsewhere with 1F1B, 2 pp with the V-shaped and (pp dividing the round) interleaved
schedules; later micro-batches repeat the same state), not the whole
accumulation; the one thing that grows with the micro-batches left out, a pipeline round's inputs
concatenated on the device (tokens, token types, labels), is added by its size. The step's batches
come from the loader, in host memory on a GPU: they are read before the tracking starts.

Estimator-only behaviour sits at one seam: `build_module(tensor_mode=...)` builds the rank under the
FakeTensorMode, without the stability guard (its verdict reads values on the host); `_static_stages` stands
in for the pipeline schedule's warm-up vote (torch's private `_warmup_p2p`, which reads a tensor on the
host); and the code paths that read tensor values on the host ask `flashtrain.model.simulation.simulated`
(which lists them) for the shape-only path.

Whatever stage the run is in, its module says what the rank holds that does not train (`frozen()`: counted with
the parameters, its no-grad forward's temporaries with the step) and which pipeline stages it runs (`stages()`).

What a simulation cannot know, it assumes: routing is balanced (each expert receives its even share
of the (token, expert) pairs -- what the bias update steers towards); `device='cuda'` simulates bf16
autocast with the CPU's autocast lists; the CUDA caching allocator's fragmentation and the
communication library's buffers are not counted (keep headroom: the figure is live tensor bytes).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed._tools.mod_tracker as mod_tracker
from omegaconf import DictConfig, open_dict
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed.pipelining.schedules import InferenceMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from flashtrain.config.errors import ConfigError
from flashtrain.model.transformer import Block
from flashtrain.parallel.construct import model_template
from flashtrain.parallel.pipeline import RoundStats, StageModule, StageRange, boundary_specs, prune_to_stages
from flashtrain.train.build import bring_up, build_module, read_configs
from flashtrain.train.config import BatchPlan, model_config
from flashtrain.train.optim.memory import PeakTensorBytes
from flashtrain.train.runtime.collectives import Operation
from flashtrain.train.step_runner import StepBatches


@dataclass
class RankEstimate:
    rank: int
    stages: list[int]
    peak_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    temporaries_bytes: int
    buffers_bytes: int
    phases: list[dict] | None = None  # `estimate_rank(phases=True)`: the step phase by phase (`_step_tracker`)

    def as_dict(self) -> dict:
        out = asdict(self)
        if out["phases"] is None:
            del out["phases"]
        return out


class SyntheticBatches:
    """Endless text micro-batches of the configured shape (values are irrelevant: tensors are fake)."""

    def __init__(self, batch_size: int, seq_len: int, vocab_size: int):
        self.shape, self.vocab = (batch_size, seq_len), vocab_size

    def __next__(self) -> dict:
        tokens = torch.randint(0, self.vocab, self.shape)
        return {"tokens": tokens, "labels": tokens.clone(), "token_types": torch.full(self.shape, -1),
                "images": [[] for _ in range(self.shape[0])], "pad_tokens": 0}

    def counters(self) -> dict:
        return {}


def _any_token_map(m) -> list[int] | None:
    """The Engram tokenizer map is data (prepare_data writes it); any map of the right size will do for
    memory: the tables are sized by the config's primes."""
    if not m.engram_layer_ids:
        return None
    vocab = m.engram_compressed_vocab_size or m.vocab_size
    return [i % vocab for i in range(m.vocab_size)]


def _peak_preserving_microbatches(layout: BatchPlan, schedule: str, pp_rank: int) -> dict:
    """Fewer micro-batches with the same peak, to keep the simulation short. Without a pipeline the
    peak is reached in the second micro-batch (the first one's gradients held while the second's
    activations build up), and every later one repeats it. With 1F1B, stage s warms up with
    min(pp - s, M) forwards (its peak in flight) and micro-batch pp - s + 1 runs after the first
    backward (gradients held), so pp - s + 1 micro-batches show stage s's peak; the schedule needs at
    least pp: min(M, max(pp, pp - s + 1)). The V-shaped schedules (`zbv`, `dualpipev`) warm up by counts
    of pp and the rank alone (torch.distributed.pipelining's action lists) and need 2 pp micro-batches,
    in which every rank already runs a steady-state forward-backward pair: min(M, 2 pp). Interleaved 1F1B
    runs M in rounds of M / max(1, M // pp) micro-batches, whose warm-up grows with the round: when pp
    divides M the rounds are of pp, and two of them (min(M, 2 pp)) show the peak; other M are simulated in
    full, as are steps of several rounds. The pipeline stages hold receive buffers only for micro-batches
    in use (parallel/lean_stage.py), so nothing else scales with M (the round's inputs, added by
    `SimulatedRank.unsimulated_round_input_bytes`)."""
    pp, m = layout.dims.pp, layout.round_microbatches
    if pp == 1:
        return {"accumulation": min(layout.accumulation, 2), "round_microbatches": 1}
    if layout.rounds != 1:
        return {}
    m = shortened_round(pp, schedule, m, pp_rank)
    return {"accumulation": m, "round_microbatches": m} if m < layout.round_microbatches else {}


def shortened_round(pp: int, schedule: str, round_microbatches: int, pp_rank: int) -> int:
    """The micro-batches of a one-round pipeline step that show its peak (`_peak_preserving_microbatches`)."""
    m = round_microbatches
    if schedule == "1f1b":
        return min(m, max(pp, pp - pp_rank + 1))
    if schedule in ("zbv", "dualpipev") or (schedule == "interleaved_1f1b" and m % pp == 0):
        return min(m, 2 * pp)
    return m


def _static_stages(stages, has_backward, p2p_done) -> None:
    """Stand-in for the pipeline schedule's first-step warm-up, which lets the stages vote on the host
    whether every stage has static shapes: ours always do (parallel/pipeline.py builds them static),
    and a fake process group carries no vote."""
    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


class SimulatedRank:
    """Rank `rank` of a `world`-rank layout: its train module (train/module.py), built by the trainer's own
    `build_module` on fake tensors and a fake process group (which the caller has initialised), without a
    stability guard. The estimator runs the module's own `step`."""

    def __init__(self, cfg: DictConfig, world: int, rank: int, device_type: str, fake_mode):
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.pop("hydra", None)
            cfg.run_name = "simulated"  # the default interpolates the Hydra runtime, which is not running
        self.cfg = c = read_configs(cfg)
        self.step = c.schedule.vit_unfreeze_step  # the step simulated: the first with the ViT unfrozen (all train)
        run = bring_up(c, world, rank=rank, checks=False)  # the caller's fake process group, on the CPU
        self.rank, self.device, self.dims = rank, run.device, run.dims
        # the batch plan simulated (fewer micro-batches, the same peak)
        self.layout = run.plan = replace(run.plan, **_peak_preserving_microbatches(
            run.plan, c.parallel.pipeline_schedule, self.dims.pp_rank), input_microbatches=run.plan.round_microbatches)
        m = c.model
        self.module = build_module(run, model_template(m, _any_token_map(m)), Operation(), device_type == "cuda",
                                   tensor_mode=fake_mode)
        self.model, self.pipe, self.optim, self.runner = (self.module.model, self.module.pipe, self.module.optim,
                                                          self.module.runner)
        if self.pipe is not None:
            self.pipe.schedule._warmup_p2p = _static_stages  # the library's vote reads a tensor on the host
        with fake_mode:
            self.loader = SyntheticBatches(c.data.batch_size, c.data.seq_len, m.vocab_size)
        self.batches = StepBatches(self.loader, self.layout.accumulation)

    def prime_optimizer_state(self) -> None:
        """Create every optimizer state tensor as a first step would (zero gradients, one optimizer
        step), so the measured step is the steady state without simulating a whole extra step (of `self.step`:
        every parameter trains, the largest state)."""
        self.module.begin_step(self.step)
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def unsimulated_round_input_bytes(self, batch: dict) -> int:
        """A pipeline step concatenates its round's micro-batches (tokens, token types, labels) on the
        device for the whole round: the bytes of the round's micro-batches the shortened step leaves out."""
        if self.pipe is None:
            return 0
        skipped = self.layout.round_inputs - self.layout.round_microbatches
        return skipped * sum(batch[k].numel() * batch[k].element_size() for k in ("tokens", "token_types", "labels"))


def _acyclic_multi_grad_hook(register):
    """torch's `register_multi_grad_hook` in mode "all" keeps the autograd nodes of the tensors it
    watches in the hook's closure, and the hook is stored on those nodes: a reference cycle through
    C++ that the garbage collector cannot see, so the node and the graph below it -- down to the
    leaves' accumulators and the leaves themselves -- live as long as the process. ModTracker
    registers one on every module's inputs, which made the simulated step keep every micro-batch's
    received carry (and, on the last stage, every output and its gradient) where the real step frees
    them after the micro-batch's backward: 80 GiB of the last stage of exp=flash. Mode "any" keeps no
    node: ModTracker then leaves a module when its first input gradient arrives instead of its last,
    which only changes the per-module attribution, not read here."""

    def register_multi_grad_hook(tensors, fn, *, mode="all"):
        return register(tensors, fn, mode="any")

    return register_multi_grad_hook


_BLOCK_OF = re.compile(r"^(.*\.blocks\.\d+)\.")  # a module inside a block: the block's name


_DEVICE_QUERY = torch.ops.prim.device.default


def _step_tracker(phases: list[dict] | None = None):
    """torch's MemTracker reduced to what is read here, the whole rank's figures by kind and their peak:
    - a module may run once per micro-batch (MemTracker refuses a second top-level call of a module in
      one tracked region, as its per-module statistics would mix);
    - no per-module peaks (MemTracker walks every module it has seen on every operator, which makes a
      40-block step quadratic);
    - module inputs are watched without keeping their graphs alive (`_acyclic_multi_grad_hook`);
    - a frozen module's parameters get no gradient hooks.
    With `phases` (a list; pipeline layouts), the live bytes are also followed phase by phase, in the order
    the schedule runs them: `forward k` from the k-th forward of the rank's pipeline stage, `backward k` from
    the k-th backward (recomputation included), and
    `optimizer` (operators before the rank's model first runs: `before the first forward`); each entry
    {"phase", "peak_bytes", "end_bytes"} (the largest live total in the phase and the
    total at its last operator) -- what a micro-batch in flight holds, and the transients of its forward
    and backward, which the partitioner's cost model prices (parallel/partition.py)."""
    class StepMemTracker(MemTracker):
        def __enter__(self):
            self._register_multi_grad_hook = mod_tracker.register_multi_grad_hook
            mod_tracker.register_multi_grad_hook = _acyclic_multi_grad_hook(self._register_multi_grad_hook)
            return super().__enter__()

        def __exit__(self, *args):
            try:
                return super().__exit__(*args)
            finally:
                mod_tracker.register_multi_grad_hook = self._register_multi_grad_hook

        _forwards = _backwards = 0
        _phase: dict | None = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # a fake tensor's device query (`prim.device`: the autograd engine asks it of every gradient)
            # allocates nothing: straight to the fake mode, untracked. Six of ten operators a simulated step
            # dispatches are these (39,691 of 64,983 in a 4-layer flash_tiny step); passing them by takes an
            # eighth of the simulation's Python calls away (docs/performance.md)
            if func is _DEVICE_QUERY:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
                if phases is not None:
                    self._follow(snap[_TOTAL_KEY])

        def _follow(self, total: int) -> None:
            name = "optimizer" if self._in_opt else self._phase["phase"] if self._phase else "before the first forward"
            if name != (self._phase or {}).get("phase"):
                self._begin(name)
            self._phase["peak_bytes"] = max(self._phase["peak_bytes"], total)
            self._phase["end_bytes"] = total
            if self._block is not None:
                self._block["peak"] = max(self._block["peak"], total)

        def _begin(self, name: str) -> None:
            if self._block is not None:  # a block's backward runs to the end of its phase
                self._block_end(self._phase["end_bytes"])
            self._phase = {"phase": name, "peak_bytes": 0, "end_bytes": 0}
            phases.append(self._phase)

        @staticmethod
        def _top_level(module) -> bool:
            """A pipeline stage of the rank (what runs once per micro-batch and pass)."""
            return isinstance(module, StageModule)

        def _pre_bw_hook(self, module, args) -> None:
            if phases is not None and self._top_level(module):
                self._backwards += 1
                self._begin(f"backward {self._backwards}")
            super()._pre_bw_hook(module, args)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # a frozen module (a train module's `frozen()`) has no gradient to watch (nor can it be hooked)
            trains = any(p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks and trains)

        _block: dict | None = None  # the block whose forward or backward runs: {"block", "start", "peak"}

        def _total(self) -> int:
            return next(iter(self._curr_mem_snap.values()))[_TOTAL_KEY] if self._curr_mem_snap else 0

        def _is_block(self, module) -> bool:
            return phases is not None and self._phase is not None and not self._in_opt and isinstance(module, Block)

        def _block_begin(self, name: str) -> None:
            total = self._total()
            self._block = {"block": name, "start": total, "peak": total}

        def _block_end(self, end: int | None = None) -> None:
            """The block's record in its phase: live bytes at its start and end and its peak. In a forward phase
            end - start is what its forward leaves (kept + output carry) and peak - end its transient. In a
            backward phase a record runs from the block's rebuild (its forward run again under recomputation)
            to the next block's rebuild or the phase's end: peak - start is what its rebuild and backward add
            at their highest. (Backward records need recomputation: a block's backward alone takes and returns
            a `Carry`, which the module tracker's gradient hooks do not see.)"""
            if self._block is not None:
                self._block["end"] = self._total() if end is None else end
                self._phase.setdefault("blocks", []).append(self._block)
                self._block = None

        def _post_fw_hook(self, module, inputs, outputs) -> None:
            super()._post_fw_hook(module, inputs, outputs)
            if self._is_block(module) and not self._mod_tracker.is_bw:
                self._block_end()

        def _pre_fw_hook(self, module, inputs):
            if not self._mod_tracker.is_bw and module in self.memory_tracking:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]  # a new micro-batch: start this module's record afresh
            if phases is not None and not self._mod_tracker.is_bw and not self._in_opt and self._top_level(module):
                self._forwards += 1
                self._begin(f"forward {self._forwards}")
            super()._pre_fw_hook(module, inputs)
            if self._is_block(module) and not self._mod_tracker.is_bw:
                self._block_begin(self._mod_tracker.get_known_fqn(module))
            elif self._mod_tracker.is_bw and phases is not None and self._phase is not None:
                self._rebuild(module)

        def _rebuild(self, module) -> None:
            """A block's rebuild under recomputation runs its inner forward (the checkpointed function), not
            the Block module: its first module opens the block's backward record, ending the previous one."""
            name = _BLOCK_OF.match(self._mod_tracker.get_known_fqn(module) or "")
            if name and (self._block is None or self._block["block"] != name[1]):
                self._block_end()
                self._block_begin(name[1])

    return StepMemTracker()


def _bytes(snapshot: dict, kind: str) -> int:
    return int(sum(v for k, v in snapshot.items() if str(getattr(k, "value", k)) == kind))


def estimate_rank(cfg: DictConfig, world: int, rank: int, device_type: str = "cuda", phases: bool = False
                  ) -> RankEstimate:
    """Simulate one steady-state training step of rank `rank` and measure its memory; with `phases`, also
    phase by phase (`_step_tracker`)."""
    if dist.is_initialized():
        raise RuntimeError("estimate_rank needs a process without a process group (it creates a fake one)")
    if phases and int(cfg.parallel.pp) == 1:
        raise ConfigError("--phases follows a pipeline stage's micro-batches: give a layout with parallel.pp > 1")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        sim = SimulatedRank(cfg, world, rank, device_type, fake_mode)
        with fake_mode:
            sim.prime_optimizer_state()
            followed: list[dict] | None = [] if phases else None
            tracker = _step_tracker(followed)
            # ShardedAdamW (ZeRO-1) holds its state in an inner torch AdamW (None on a rank owning no chunk)
            optims = [getattr(o, "inner", o) for o in sim.optim.optimizers.values()]
            tracker.track_external(sim.model, *sim.module.frozen(), *[o for o in optims if o is not None])
            batches = next(sim.batches)  # read before tracking: the loader's batches are host memory
            with tracker:
                sim.module.step(batches, None, sim.step, sim.loader.counters)
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        unsimulated = sim.unsimulated_round_input_bytes(batches[0])
        return RankEstimate(rank=rank, stages=sim.module.stages(), peak_bytes=_bytes(peak, "Total") + unsimulated,
                            params_bytes=_bytes(peak, "Parameter"), grads_bytes=_bytes(peak, "Gradient"),
                            optimizer_bytes=_bytes(peak, "Optstate"),
                            activations_bytes=_bytes(peak, "Activation") + unsimulated,
                            temporaries_bytes=_bytes(peak, "Temp"), buffers_bytes=_bytes(peak, "Buffer"),
                            phases=followed)
    finally:
        dist.destroy_process_group()


def probe_block(cfg: DictConfig, layer: int, recompute: str, device_type: str = "cuda") -> dict:
    """The activation memory of block `layer` alone, for one micro-batch of the configured shape
    (`data.batch_size` x `data.seq_len`), simulated on fake tensors with its experts unsharded (ep=1):
    - `carry_bytes`: the block's input carry (the boundary tensors before it, parallel/pipeline.py);
    - `kept_bytes`: what its forward leaves for backward beyond its input and output carries (the
      output carry, shared KV fields included, is the next block's input);
    - `work_bytes`: the further peak while its backward runs (recomputation included; the parameters'
      gradients exist already, as in every micro-batch after the first: they are state, not work).
    The partitioner's cost model (parallel/partition.py) is calibrated against these figures."""
    m = model_config(cfg)
    b, S = int(cfg.data.batch_size), int(cfg.data.seq_len)
    template = model_template(m, _any_token_map(m))
    rng = StageRange(1, layer, layer + 1, 3)  # a middle stage: no embedding, no head
    prune_to_stages(template, [rng])
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = template.materialize("cpu", int(cfg.train.seed))
    model.set_recompute(recompute)
    in_specs = boundary_specs(m, model.plan, layer, b, S)
    out_specs = boundary_specs(m, model.plan, layer + 1, b, S)
    module = StageModule(model, rng, in_specs, out_specs, RoundStats())
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=device_type == "cuda")
    with fake:
        inputs = [s.example("cpu") for s in in_specs]
        for p in model.parameters():  # the steady state: gradients exist and are accumulated into
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        counter = PeakTensorBytes()
        with amp, counter:
            outs = module(*inputs)
            made = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in outs}  # by the block:
            out_bytes = sum(n for key, n in made.items() if key in counter._seen)  # the next block's carry
            kept = counter.live - out_bytes
            counter.peak = counter.live
            pairs = [(t, torch.ones_like(t)) for t, s in zip(outs, out_specs) if s.differentiable and t.requires_grad]
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            work = counter.peak - (kept + out_bytes)
    carry = sum(s.example("meta").untyped_storage().nbytes() for s in in_specs)
    return {"layer": layer, "carry_bytes": int(carry), "kept_bytes": int(kept), "work_bytes": int(work)}
