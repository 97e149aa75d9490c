"""Per-step metrics: one strict-JSON object per optimizer step in `<run dir>/metrics.jsonl` (a non-finite
value is written as null), the same values in wandb (offline unless configured online; a wandb failure
is logged once and never stops training), an expert-load heatmap (PNG in `<run dir>/expert_load/`, and
in wandb) at the first step of every start, every `heatmap_interval` steps and at the last step, and a
progress bar on rank 0.

One wandb run per run directory: the first start stores its wandb run id in `<run dir>/wandb_run_id`;
every restart resumes that id (`resume="allow"`) and continues the same curves from its step. The
config goes to wandb once, on the first start.

Each step once: a start that resumes from step N (0: a fresh start) first removes from metrics.jsonl
what was written after step N (by a start that stopped before its next checkpoint, or whose later
checkpoints were damaged and set aside) -- every line after the last record of
step N, step records and rollback events alike (they belong to the lost steps) -- and says so in the log,
so the file holds each step once, the re-run's record. wandb's history cannot be rewritten (its steps
only increase, and rewinding a run is a private-preview server feature), so wandb receives only steps
beyond the last one it was sent (`<run dir>/wandb_step`: the run id and that step): for the steps a
resume re-runs it keeps the first values, which equal the re-run's (a resume is bit-exact; the timings
`tokens_per_s` / `step_time_s` / `mfu` differ), and each step appears in it once too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from flashtrain.config.errors import ConfigError

log = logging.getLogger(__name__)

MODALITIES = ("text", "image")
RUN_ID_FILE = "wandb_run_id"
WANDB_STEP_FILE = "wandb_step"  # "<run id> <the last step sent to wandb>"
METRICS_FILE = "metrics.jsonl"
HEATMAP_DIR = "expert_load"
_RUN_ID_CHARS = string.ascii_lowercase + string.digits
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "flashtrain"
    name: str | None = None


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    heatmap_interval: int = 50  # 0: no expert-load heatmaps at all
    # the top of the heatmaps' colour scale (load / balanced load), the same in every picture of a run;
    # a load above it is drawn in the over colour (black), the colour bar's arrow
    heatmap_max_load: float = 4.0
    progress: bool = True

    def validate(self) -> None:
        if self.wandb.mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"logging.wandb.mode={self.wandb.mode!r}: use offline, online or disabled")
        if not (math.isfinite(self.heatmap_max_load) and self.heatmap_max_load > 1.0):
            raise ConfigError(f"logging.heatmap_max_load={self.heatmap_max_load}: the colour scale's top must be a "
                              f"finite load / balanced load above 1.0 (balanced), e.g. 4.0")


def load_stats(loads: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """[3, layers, 2] on the loads' device: per layer (sorted) and modality the mean load, max / mean and the
    coefficient of variation (std / mean); read with the step's values (train/step_values.py `read`)."""
    if not loads:
        return None
    x = torch.stack([loads[layer] for layer in sorted(loads)]).double()  # [layers, 2, experts]
    mean = x.mean(-1)
    return torch.stack([mean, x.amax(-1) / mean, x.std(-1, unbiased=False) / mean])


def load_statistics(loads: dict[int, torch.Tensor], stats: list | None = None) -> dict:
    """Per layer and modality: max/mean and coefficient of variation of the expert loads
    (NaN where the modality had no token; metrics.jsonl writes it as null). `stats`: `load_stats(loads)`
    already read to the host (as nested lists); None reads it here."""
    out = {"text": {"max_over_mean": [], "cv": []}, "image": {"max_over_mean": [], "cv": []}}
    if stats is None:
        t = load_stats(loads)
        stats = [] if t is None else t.tolist()
    if not stats:
        return out
    for i in range(len(stats[0])):
        for m, name in enumerate(MODALITIES):
            ok = stats[0][i][m] > 0
            out[name]["max_over_mean"].append(stats[1][i][m] if ok else math.nan)
            out[name]["cv"].append(stats[2][i][m] if ok else math.nan)
    return out


def relative_loads(loads: dict[int, torch.Tensor]) -> tuple[list[int], np.ndarray]:
    """(sorted layer ids, [2, layers, experts] array): each expert's load over the mean load of its layer
    and modality, so 1.0 is a perfectly balanced expert; NaN for a layer and modality without tokens."""
    layers = sorted(loads)
    x = np.stack([loads[l].detach().cpu().double().numpy() for l in layers], axis=1)  # [2, L, E]
    mean = x.mean(axis=2, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(mean > 0, x / np.where(mean > 0, mean, 1.0), np.nan)
    return layers, rel


def routed_counts(loads: dict[int, torch.Tensor]) -> dict[str, int]:
    """Routed (token, expert) assignments per layer and modality (tokens x top-k; the largest layer's
    count, as every MoE layer routes the same tokens)."""
    return {name: max((int(loads[l][m].sum()) for l in loads), default=0) for m, name in enumerate(MODALITIES)}


def load_norm(max_load: float):
    """The heatmaps' colour scale: load / balanced load from 0 (starved, blue) through 1 (balanced, white)
    to `max_load` (`logging.heatmap_max_load`, red), fixed for the run so that one colour means one load in
    every picture; a load above `max_load` maps past the top (the colour map's over colour)."""
    from matplotlib.colors import TwoSlopeNorm  # matplotlib only where a heatmap is drawn: not on every rank's start

    return TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max_load)


def expert_load_figure(loads: dict[int, torch.Tensor], step: int,
                       max_load: float = LoggingConfig.heatmap_max_load):
    """The heatmap as a matplotlib Figure: one panel per modality (text, image), layers down, experts
    across, coloured by `relative_loads` on one colour scale shared by both panels and fixed for the run
    (`load_norm(max_load)`: white = balanced, red = overloaded up to `max_load`, blue = starved, grey = a
    layer without tokens of that modality, black = above `max_load`, clipped: the colour bar then ends in
    an arrow and the title gives how many and the largest), a colour bar naming the scale, and a title with
    the step and the routed assignments per modality. A modality without any token gets a "no <modality>
    tokens in this step" note instead of a picture. Built without pyplot (no global figure state, nothing
    to close; rendering uses the Agg canvas)."""
    import matplotlib as mpl
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.figure import Figure

    layers, rel = relative_loads(loads)
    counts = routed_counts(loads)
    norm = load_norm(max_load)  # one scale for both panels and every step
    cmap = mpl.colormaps["RdBu_r"].with_extremes(bad="0.85", over="black")
    above = np.nan_to_num(rel, nan=0.0) > max_load  # (NaN: a layer and modality without tokens)
    fig = Figure(figsize=(10, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    n_layers, n_experts = rel.shape[1], rel.shape[2]
    stride = max(1, math.ceil(n_layers / 20))
    for m, (ax, name) in enumerate(zip(axes, MODALITIES)):
        ax.set_title(name)
        if counts[name] == 0:
            ax.text(0.5, 0.5, f"no {name} tokens in this step", ha="center", va="center", fontsize=12,
                    transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        ax.imshow(np.ma.masked_invalid(rel[m]), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_yticks(range(0, n_layers, stride), [str(layers[i]) for i in range(0, n_layers, stride)])
        if n_experts <= 32:
            ax.set_xticks(range(n_experts))
        ax.tick_params(labelsize=7)
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=list(axes), shrink=0.9,
                       extend="max" if above.any() else "neither")
    bar.set_label(f"load / balanced load (1.0 = balanced)\nscale 0-{max_load:g} (logging.heatmap_max_load)")
    clipped = (f"\n{int(above.sum())} load(s) above {max_load:g} drawn black (clipped), the largest "
               f"{float(np.nanmax(rel)):.2f}") if above.any() else ""
    fig.suptitle(f"expert load at step {step}: text {counts['text']:,}, image {counts['image']:,} "
                 f"routed assignments per layer{clipped}")
    return fig


def write_expert_load_png(loads: dict[int, torch.Tensor], step: int, run_dir: str | Path,
                          max_load: float = LoggingConfig.heatmap_max_load) -> Path:
    """Render `expert_load_figure` (colour scale 0-`max_load`) to `<run_dir>/expert_load/step_XXXXXXXX.png`
    (atomically); returns the path."""
    out = Path(run_dir) / HEATMAP_DIR / f"step_{step:08d}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    expert_load_figure(loads, step, max_load).savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


# --- strict JSON -----------------------------------------------------------------------------------
def finite_or_none(value):
    """`value` with every non-finite float (NaN, +-inf), at any depth of dicts and lists, replaced by
    None, so that `json.dumps(..., allow_nan=False)` writes strict JSON (null)."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _flatten(prefix: str, value, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}" if prefix else k, v, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _flatten(f"{prefix}/layer_{i:02d}", v, out)
    elif value is not None:  # null (an absent modality) is simply not logged to wandb
        out[prefix] = value


# --- one wandb run per run directory ---------------------------------------------------------------
def read_run_id(run_dir: str | Path) -> str | None:
    """The wandb run id stored in `<run_dir>/wandb_run_id`, or None (no file, or not a valid id)."""
    path = Path(run_dir) / RUN_ID_FILE
    try:
        run_id = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not _RUN_ID_RE.match(run_id):
        log.warning("ignoring %s: %r is not a wandb run id", path, run_id[:80])
        return None
    return run_id


def write_run_id(run_dir: str | Path, run_id: str) -> None:
    """Store the run id atomically (a temporary file renamed over `<run_dir>/wandb_run_id`)."""
    path = Path(run_dir) / RUN_ID_FILE
    tmp = path.with_name(f".{RUN_ID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(run_id + "\n", encoding="utf-8")
    os.replace(tmp, path)


def new_run_id() -> str:
    return "".join(secrets.choice(_RUN_ID_CHARS) for _ in range(8))


def init_wandb(run_dir: str | Path, cfg: WandbConfig, config: dict):
    """wandb.init for this run directory: a fresh id (stored once wandb accepted it) and the config on
    the first start; the stored id, `resume="allow"` and no config on every restart. Raises what
    wandb raises (the caller decides)."""
    import wandb

    stored = read_run_id(run_dir)
    run_id = stored or new_run_id()
    run = wandb.init(mode=cfg.mode, project=cfg.project, name=cfg.name, dir=str(run_dir), id=run_id,
                     resume="allow", config=None if stored else config,
                     settings=wandb.Settings(silent=True, console="off"))
    if stored is None:
        write_run_id(run_dir, run.id)
    return run


def _read_json(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def resumed_lines(lines: list[str], start_step: int) -> int:
    """How many of metrics.jsonl's `lines` a start from `start_step` keeps: through the last step record of
    `start_step` (a rollback may have logged a step twice: the checkpoint was written after the last) and
    the eval events of that step right after it (the evaluation runs before the step's checkpoint); with
    no such record, the lines before the first record past it; a fresh start (0) keeps none."""
    if start_step <= 0:
        return 0
    parsed = [_read_json(line) for line in lines]
    records = [(i, r.get("step")) for i, r in enumerate(parsed) if isinstance(r, dict) and "event" not in r]
    at = [i for i, step in records if step == start_step]
    if at:
        keep = at[-1] + 1
        while keep < len(lines) and isinstance(r := parsed[keep], dict) and r.get("event") == "eval" and \
                r.get("step") == start_step:
            keep += 1
        return keep
    later = [i for i, step in records if isinstance(step, int) and step > start_step]
    return later[0] if later else len(lines)


def truncate_after(path: Path, start_step: int) -> list[str]:
    """Keep what `resumed_lines` keeps of the file (a line cut short by a kill, without its newline, is never
    kept), atomically; returns the removed lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    partial = lines.pop()  # "" after a complete last line
    keep = resumed_lines(lines, start_step)
    removed = lines[keep:] + ([partial] if partial else [])
    if removed:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in lines[:keep]), encoding="utf-8")
        os.replace(tmp, path)
    return removed


def _describe_removed(removed: list[str]) -> str:
    rows = [r for line in removed if isinstance(r := _read_json(line), dict)]
    steps = [r["step"] for r in rows if "event" not in r and isinstance(r.get("step"), int)]
    events = sum(1 for r in rows if "event" in r)
    span = "" if not steps else f" (step {steps[0]})" if min(steps) == max(steps) else \
        f" (steps {min(steps)}-{max(steps)})"
    what = f"{len(steps)} step record(s){span}"
    return what + (f", {events} event(s)" if events else "") + (
        f", {len(removed) - len(rows)} unreadable line(s)" if len(removed) > len(rows) else "")


def read_wandb_step(run_dir: str | Path, run_id: str) -> int:
    """The last step sent to wandb run `run_id` from this run directory (0: none, or another run id)."""
    try:
        stored_id, step = (Path(run_dir) / WANDB_STEP_FILE).read_text(encoding="utf-8").split()
        return int(step) if stored_id == run_id else 0
    except (FileNotFoundError, ValueError):
        return 0


def write_wandb_step(run_dir: str | Path, run_id: str, step: int) -> None:
    path = Path(run_dir) / WANDB_STEP_FILE
    tmp = path.with_name(f".{WANDB_STEP_FILE}.{os.getpid()}.tmp")
    tmp.write_text(f"{run_id} {step}\n", encoding="utf-8")
    os.replace(tmp, path)


class MetricsLogger:
    """Rank 0 writes; other ranks hold a no-op logger. `start_step`: the step the run (re)starts from;
    `total_steps`: its last step."""

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, config: dict, enabled: bool, total_steps: int,
                 start_step: int, progress_file=None):
        self.enabled, self.cfg = enabled, cfg
        self.run_dir = Path(run_dir)
        self.total_steps, self.first_step = total_steps, start_step + 1
        self._wandb = None
        self._bar = None
        self._heatmaps = cfg.heatmap_interval > 0
        if not enabled:
            return
        self.path = self.run_dir / METRICS_FILE
        removed = truncate_after(self.path, start_step)
        if removed:
            log.warning("%s: removed %s written after step %d, the step this start resumes from (a checkpoint "
                        "after it was never written, or was damaged); the re-run writes those steps again", self.path,
                        _describe_removed(removed), start_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._wandb_sent = 0  # the last step the wandb run already has: nothing at or before it is sent again
        if cfg.wandb.mode != "disabled":
            try:
                self._wandb = init_wandb(self.run_dir, cfg.wandb, config)
                self._wandb_sent = read_wandb_step(self.run_dir, self._wandb.id)
            except Exception as e:  # noqa: BLE001 - wandb must never stop training
                log.warning("wandb unavailable (%s); metrics go to %s only", e, self.path)
        if cfg.progress:
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             file=progress_file)

    def heatmap_due(self, step: int) -> bool:
        """The first step of this start (step 1 of a fresh run, the first step after a resume), every
        `heatmap_interval` steps, and the last step."""
        if not self._heatmaps:
            return False
        return step == self.first_step or step == self.total_steps or step % self.cfg.heatmap_interval == 0

    def _heatmap(self, step: int, loads: dict[int, torch.Tensor]) -> Path | None:
        try:
            return write_expert_load_png(loads, step, self.run_dir, self.cfg.heatmap_max_load)
        except Exception as e:  # noqa: BLE001 - a picture must never stop training
            log.warning("expert-load heatmap failed at step %d (%s); no more heatmaps in this run", step, e)
            self._heatmaps = False
            return None

    def log(self, step: int, record: dict, loads: dict[int, torch.Tensor] | None = None,
            wandb_step: int | None = None) -> None:
        """`wandb_step`: the x of this record in wandb (default `step`); after a spike rollback the trainer
        passes step + the steps rolled back so far, since wandb's steps must only increase."""
        if not self.enabled:
            return
        record = finite_or_none(record)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        png = self._heatmap(step, loads) if loads and self.heatmap_due(step) else None
        wandb_step = step if wandb_step is None else wandb_step
        if self._wandb is not None and wandb_step > self._wandb_sent:
            try:
                flat: dict = {}
                _flatten("", {k: v for k, v in record.items() if k != "step" and not isinstance(v, str)}, flat)
                if png is not None:
                    import wandb

                    flat["expert_load/heatmap"] = wandb.Image(str(png), caption=f"step {step}: load / balanced "
                                                              "load, layers x experts, text | image")
                self._wandb.log(flat, step=wandb_step)
                self._sent(wandb_step)
            except Exception as e:  # noqa: BLE001
                log.warning("wandb.log failed (%s); disabling wandb for this run", e)
                self._wandb = None
        if self._bar is not None:  # the step just finished: its values first, then the count that draws them
            loss, tok_s = record.get("loss"), record.get("tokens_per_s")
            self._bar.set_postfix(loss="-" if loss is None else f"{loss:.4f}",
                                  tok_s="-" if tok_s is None else f"{tok_s:.0f}", refresh=False)
            if step != self._bar.n:  # (a rollback re-runs steps: the bar goes back with them)
                self._bar.update(step - self._bar.n)
            else:
                self._bar.refresh()

    def event(self, event: dict, wandb_step: int) -> None:
        """A run event (a spike rollback): one line in metrics.jsonl with an "event" field (step records have
        none), and in wandb an alert (online runs) plus its numbers under `events/` at `wandb_step`."""
        if not self.enabled:
            return
        event = finite_or_none(event)
        self._file.write(json.dumps(event, allow_nan=False) + "\n")
        self._file.flush()
        if self._wandb is not None and wandb_step > self._wandb_sent:
            text = ", ".join(f"{k}={v}" for k, v in event.items() if k != "event")
            try:
                self._wandb.log({f"events/{k}": v for k, v in event.items() if isinstance(v, (int, float))},
                                step=wandb_step)
                self._sent(wandb_step)
                if self.cfg.wandb.mode == "online":
                    import wandb

                    self._wandb.alert(title=f"flashtrain: {event['event']}", text=text, level=wandb.AlertLevel.WARN)
            except Exception as e:  # noqa: BLE001 - wandb must never stop training
                log.warning("wandb event failed (%s): %s", e, text)

    def eval(self, record: dict, wandb_step: int) -> None:
        """A held-out evaluation (train/evaluation/heldout.py): its event line in metrics.jsonl, and in wandb its
        numbers under `eval/` (`eval/loss`, `eval/bpb`, `eval/per_source/<name>/loss`, ...) at `wandb_step`,
        the step's own x."""
        if not self.enabled:
            return
        record = finite_or_none(record)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._wandb is not None and wandb_step >= self._wandb_sent:
            flat: dict = {}
            _flatten("eval", {k: v for k, v in record.items() if k not in ("event", "step")}, flat)
            try:
                self._wandb.log(flat, step=wandb_step)
                self._sent(wandb_step)
            except Exception as e:  # noqa: BLE001 - wandb must never stop training
                log.warning("wandb eval log failed (%s)", e)

    def _sent(self, wandb_step: int) -> None:
        self._wandb_sent = wandb_step
        try:
            write_wandb_step(self.run_dir, self._wandb.id, wandb_step)
        except OSError as e:  # a restart may then send a step again (wandb drops it)
            log.debug("cannot record the last wandb step (%s)", e)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("wandb.finish failed: %s", e)
