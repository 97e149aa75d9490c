"""Sharded checkpoints with torch.distributed.checkpoint (DESIGN.md "Training").

Layout: `<run dir>/checkpoints/step_<8-digit step>/`, one directory per step, written to
`.tmp-step_<step>` (synchronously or in the background) and renamed by rank 0 once every rank's shards
are written, so a directory that
exists is complete and a crash mid-write leaves only a `.tmp-*` that the next save removes. The last
`keep` checkpoints are kept.

Contents (DCP keys):
- `model.*`: every tensor of `model.state_dict()` (MoE selection biases included), resharded by DCP;
  with a pipeline each rank holds (and writes) its stages' blocks only, under the same names, so a
  checkpoint written with any `parallel.pp` loads with any other;
- `optim.<optimizer>.<parameter FQN>.<state>`: each optimizer state tensor as a flat global tensor of
  its parameter's global element count, keyed by parameter name (independent of parameter order);
  every rank writes the pieces it owns (ZeRO-1, parallel/zero.py) and on load requests the pieces it
  owns in the new layout, so optimizer state reshards across dp / ep / pp; scalars (AdamW's step) are
  plain; a parameter without state (e.g. a frozen ViT body) has no key;
- sharded parameters: a rank holds rows [r E/ep, (r+1) E/ep) of every stacked expert tensor, and a
  row block of each row-sharded Engram table; they are written as `GlobalChunk`s
  (parallel/sharded_state.py) at their global row offset, so the checkpoint holds the global tensors
  and loads with any `ep` / dp;
- `meta`: step, tokens seen, the resolved config, the Engram compressed vocabulary the token map gave
  (`engram_compressed_vocab_size`, for the export), written once;
- `dp<r>`: data-parallel rank r's data-loader state and RNG states (the ranks of one pipeline read the
  same batches; any of them writes it), so resuming needs the same number of data-parallel readers
  (the loader's state is per reader); pp and ep may change.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from model.config import ConfigError
from parallel.sharded_state import GlobalChunk

log = logging.getLogger(__name__)


def _global(name: str, p: torch.Tensor, layout: dict) -> tuple[tuple[int, ...], int]:
    """(global shape, flat offset of this rank's local tensor in it): pieces are cut along dim 0 only."""
    shape, offset = layout.get(name, (tuple(p.shape), (0,) * p.dim()))
    return tuple(shape), offset[0] * math.prod(shape[1:]) if shape else 0


def _sharded_model_state(model: nn.Module, layout: dict) -> dict:
    state = model.state_dict()
    return {k: GlobalChunk([(v, layout[k][1])], layout[k][0]) if k in layout else v for k, v in state.items()}


def _unwrap(t):
    return t.chunks[0][0] if isinstance(t, GlobalChunk) else t


STEP_DIR = re.compile(r"^step_(\d{8})$")


def _blob(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unblob(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories, oldest first (a `.tmp-*` is never complete)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


# ---------------------------------------------------------------------------------------- verification
MANIFEST = "checksums.json"  # {file name: {"size": bytes, "sha256": hex}} of every other file of the checkpoint
_HASH_BLOCK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or one to load is damaged; the message says which and what is kept."""


def _digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _gather(obj) -> list:
    if _world() == 1:
        return [obj]
    out = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def write_manifest(directory: Path) -> None:
    """Collective: every rank hashes its share of the checkpoint's files, rank 0 writes the manifest."""
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    mine = {n: _digest(directory / n) for n in files[_rank()::_world()]}
    merged = {k: v for part in _gather(mine) for k, v in part.items()}
    if _rank() == 0:
        tmp = directory / f".{MANIFEST}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(sorted(merged.items())), f, indent=0)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)


def checkpoint_problem(path: str | Path) -> str | None:
    """Collective: None when every file the manifest lists is there with its size and checksum (each rank
    checks its share); else what is wrong. A checkpoint written before manifests existed is not checked."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None
    try:
        listed = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    problems = []
    for name in sorted(listed)[_rank()::_world()]:
        f = path / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != listed[name]["size"]:
            problems.append(f"{name} has {f.stat().st_size} bytes, {listed[name]['size']} were written")
        elif _digest(f)["sha256"] != listed[name]["sha256"]:
            problems.append(f"{name} does not match its checksum")
    found = [p for part in _gather(problems) for p in part]
    return "; ".join(found) if found else None


def latest_verified_checkpoint(run_dir: str | Path, report=log.warning) -> Path | None:
    """Collective: the newest complete checkpoint whose files match their checksums; each damaged newer
    one is reported and skipped."""
    for path in reversed(complete_checkpoints(run_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        report(f"checkpoint {path} is damaged ({problem}); skipping it for the previous complete one")
    return None


def optimizer_state_sharded(optimizers: dict, model: nn.Module, layout: dict) -> dict:
    """{"<optimizer>.<parameter FQN>.<state>": value}: each state tensor as the flat global tensor of
    its parameter's elements, of which this rank writes the pieces it owns (ZeRO-1, expert shards,
    Engram row blocks); scalars (AdamW's step) as they are."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    flat = {}
    for oname, opt in optimizers.items():
        for p, k, v, pieces in opt.owned_state():
            name = name_of[id(p)]
            key = f"{oname}.{name}.{k}"
            v = v if torch.is_tensor(v) else torch.tensor(v)
            if v.dim() == 0:
                flat[key] = v
                continue
            if not pieces:
                continue
            shape, base = _global(name, p, layout)
            values, at, chunks = v.reshape(-1), 0, []
            for q in pieces:
                chunks.append((values[at:at + q.numel], (base + q.start,)))
                at += q.numel
            flat[key] = GlobalChunk(chunks, (math.prod(shape),))
    return flat


def _optimizer_templates(md: dict, optimizers: dict, model: nn.Module, layout: dict) -> dict:
    """Receiving templates for the optimizer state this rank owns, from the checkpoint's metadata."""
    params = dict(model.named_parameters())
    out = {}
    for key, m in md.items():
        if not key.startswith("optim."):
            continue
        oname, rest = key[len("optim."):].split(".", 1)
        fqn = rest.rsplit(".", 1)[0]
        if fqn not in params:
            continue  # another pipeline stage's parameter
        if oname not in optimizers:
            raise ConfigError(f"checkpoint has optimizer state {key!r} for optimizer {oname!r}, which this run does "
                             f"not have (it has {sorted(optimizers)}); was it written by another optimizer config?")
        p = params[fqn]
        if len(m.size) == 0:
            out[key[len("optim."):]] = torch.empty((), dtype=m.properties.dtype)
            continue
        shape, base = _global(fqn, p, layout)
        if m.size[0] != math.prod(shape):
            raise ConfigError(f"checkpoint state {key!r} has {m.size[0]} elements but parameter {fqn!r} has "
                             f"{math.prod(shape)} (global shape {shape}); was it written by another model config?")
        pieces = optimizers[oname].state_pieces(p)
        if pieces:
            out[key[len("optim."):]] = GlobalChunk([(torch.empty(q.numel, dtype=m.properties.dtype), (base + q.start,))
                                                    for q in pieces], (m.size[0],))
    return out


def _install_optimizer_state(optimizers: dict, model: nn.Module, loaded: dict) -> None:
    params = dict(model.named_parameters())
    for opt in optimizers.values():
        opt.clear_state()
    for key, v in loaded.items():
        oname, rest = key.split(".", 1)
        fqn, k = rest.rsplit(".", 1)
        value = torch.cat([t for t, _ in v.chunks]) if isinstance(v, GlobalChunk) else v
        optimizers[oname].install_state(params[fqn], k, value)


class CheckpointWriter:
    """Writes checkpoints, synchronously or (async_save) in the background: `dcp.async_save` stages a
    copy of the state and returns, the training continues, and the `.tmp-*` directory is renamed only
    when the write has finished (at the next save, or `wait()` at the end) -- a crash in between leaves
    the previous checkpoint as the newest complete one. Background writes use their own gloo group so
    they never interleave with the training collectives."""

    def __init__(self, run_dir: str | Path, keep: int, async_save: bool = False):
        self.run_dir, self.keep, self.async_save = Path(run_dir), keep, async_save
        self.group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self.pending = None

    def save(self, step: int, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], meta: dict,
             rank_state: dict, dp_rank: int | None = None, fault_hook=None, layout: dict | None = None) -> Path:
        """Collective: every rank calls it."""
        self.wait()
        final = step_dir(self.run_dir, step)
        tmp = final.with_name(f".tmp-{final.name}")
        rank = _rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as e:
                raise self._failed(tmp, e) from e
        _barrier()
        layout = layout or {}
        state = {"model": _sharded_model_state(model, layout),
                 "optim": optimizer_state_sharded(optimizers, model, layout),
                 "meta": _blob(meta), f"dp{rank if dp_rank is None else dp_rank}": _blob(rank_state)}
        with warnings.catch_warnings():  # DCP warns when it runs without a process group (one process): expected
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            if self.async_save:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
                self.pending = (future, tmp, final, fault_hook)
                return final
            try:
                dcp.save(state, checkpoint_id=str(tmp))
            except Exception as e:  # disk full, permissions, a rank's write: keep what was there, say so
                raise self._failed(tmp, e) from e
        self._finalize(tmp, final, fault_hook)
        return final

    def _failed(self, tmp: Path, error: BaseException) -> CheckpointError:
        """Remove the partial write and describe the failure; the complete checkpoints are untouched."""
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        newest = latest_checkpoint(self.run_dir)
        return CheckpointError(f"writing checkpoint {tmp.name.removeprefix('.tmp-')} into {tmp.parent} failed "
                               f"({type(error).__name__}: {error}); the previous checkpoints are untouched (newest: "
                               f"{newest.name if newest else 'none'}). Free space or fix the permissions, then restart "
                               f"in the run directory to resume")

    def wait(self) -> None:
        """Finish a background write (rename + prune); a no-op when none is pending."""
        if self.pending is None:
            return
        future, tmp, final, hook = self.pending
        self.pending = None
        try:
            future.result()
        except Exception as e:
            raise self._failed(tmp, e) from e
        self._finalize(tmp, final, hook)

    def _finalize(self, tmp: Path, final: Path, fault_hook) -> None:
        _barrier()
        write_manifest(tmp)
        _barrier()
        if fault_hook is not None:
            fault_hook(tmp)
        if _rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            for old in complete_checkpoints(self.run_dir)[:-self.keep] if self.keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
            for stale in final.parent.glob(".tmp-step_*"):
                if stale.name != f".tmp-{final.name}":
                    shutil.rmtree(stale, ignore_errors=True)
        _barrier()


def weights_only(path: str | Path) -> bool:
    """True for a checkpoint of model weights alone (no optimizer, data-loader or RNG state)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        return False
    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return not any(k.startswith("optim.") or re.fullmatch(r"dp\d+", k) for k in md)


def _load_weights_only(path: Path, model: nn.Module, layout: dict) -> dict:
    """A checkpoint of weights alone (launch/import_official.py): the model's tensors and `meta`."""
    state = {"model": _sharded_model_state(model, layout), "meta": b""}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict({k: _unwrap(v) for k, v in state["model"].items()})
    return _unblob(state["meta"])


def load_checkpoint(path: str | Path, model: nn.Module, optimizers: dict, dp_rank: int | None = None,
                    dp: int | None = None, layout: dict | None = None) -> tuple[dict, dict]:
    """Load model and optimizer state in place (only the parameters `model` holds: a pipeline stage
    loads its own blocks, an expert / Engram shard its rows, ZeRO-1 its owned pieces of the optimizer
    state); returns (meta, this data-parallel rank's state). A checkpoint of weights alone (an imported
    release, launch/import_official.py: no optimizer, data-loader or RNG state) loads the model and
    returns (meta, None)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no .metadata); pick a step_* "
                                f"directory under <run dir>/checkpoints")
    dp_rank = _rank() if dp_rank is None else dp_rank
    layout = layout or {}
    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    rank_key = f"dp{dp_rank}"
    saved = sorted(int(k[2:]) for k in md if re.fullmatch(r"dp\d+", k))
    if weights_only(path):
        return _load_weights_only(path, model, layout), None
    if rank_key not in md or (dp is not None and len(saved) != dp):
        raise ConfigError(f"checkpoint {path} was written with {len(saved)} data-parallel reader(s) and this run has "
                         f"{dp if dp is not None else 'more'}: the data-loader state needs the same number of "
                         f"data-parallel ranks (world size / (parallel.pp x parallel.cp) = {len(saved)}); "
                         f"the model and optimizer state would load into any layout, and parallel.pp / parallel.ep / "
                         f"parallel.cp may differ")
    state = {"model": _sharded_model_state(model, layout), "optim": _optimizer_templates(md, optimizers, model, layout),
             "meta": b"", rank_key: b""}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict({k: _unwrap(v) for k, v in state["model"].items()})
    _install_optimizer_state(optimizers, model, state["optim"])
    return _unblob(state["meta"]), _unblob(state[rank_key])
