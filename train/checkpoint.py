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
- `optim.<optimizer>.<parameter FQN>.<state>`: optimizer state tensors keyed by parameter name, so the
  checkpoint does not depend on parameter order; on load the template is built from the checkpoint's
  own metadata (a parameter without state -- e.g. a frozen ViT body -- has no key);
- expert parallelism: a rank holds rows [r E/ep, (r+1) E/ep) of every stacked expert tensor; those
  tensors (and their optimizer states) are written as DTensors sharded on dim 0 over the EP mesh, so
  the checkpoint holds global [E, ...] tensors with global expert indices and loads with any `ep`;
- `meta`: step, tokens seen, the resolved config, written once;
- `dp<r>`: data-parallel rank r's data-loader state and RNG states (the ranks of one pipeline read the
  same batches; any of them writes it), so resuming needs the same dp size but any pp.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

log = logging.getLogger(__name__)


class RowShards:
    """Tensors this rank holds a dim-0 slice of (routed experts under EP): `names` (parameter FQNs)
    over the 1-D DeviceMesh `mesh`, each rank the slice of its mesh coordinate, equal sizes."""

    def __init__(self, mesh, names: set[str]):
        self.mesh, self.names = mesh, set(names)

    def wrap(self, t: torch.Tensor):
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(t, self.mesh, [Shard(0)], run_check=False)

    def local_template(self, size, dtype):
        n = self.mesh.size()
        if size[0] % n:
            raise ValueError(f"checkpoint tensor of {size[0]} rows cannot be split over parallel.ep={n}")
        return self.wrap(torch.empty((size[0] // n,) + tuple(size[1:]), dtype=dtype))


def _unwrap(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _sharded_model_state(model: nn.Module, shards: RowShards | None) -> dict:
    state = model.state_dict()
    if shards is not None:
        state = {k: shards.wrap(v) if k in shards.names else v for k, v in state.items()}
    return state
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


def optimizer_state_flat(optimizers: dict[str, torch.optim.Optimizer], model: nn.Module) -> dict[str, torch.Tensor]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    flat = {}
    for oname, opt in optimizers.items():
        for p, state in opt.state.items():
            for k, v in state.items():
                flat[f"{oname}.{name_of[id(p)]}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return flat


def load_optimizer_state_flat(optimizers: dict[str, torch.optim.Optimizer], model: nn.Module,
                              flat: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for opt in optimizers.values():
        opt.state.clear()
    for key, v in flat.items():
        oname, rest = key.split(".", 1)
        fqn, k = rest.rsplit(".", 1)
        if oname not in optimizers or fqn not in params:
            raise ValueError(f"checkpoint has optimizer state {key!r} that this run cannot place (optimizer "
                             f"{oname!r}, parameter {fqn!r}); was it written by another model or optimizer config?")
        optimizers[oname].state[params[fqn]][k] = v.to(params[fqn].device) if v.dim() else v


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
             rank_state: dict, dp_rank: int | None = None, fault_hook=None, shards: RowShards | None = None) -> Path:
        """Collective: every rank calls it."""
        self.wait()
        final = step_dir(self.run_dir, step)
        tmp = final.with_name(f".tmp-{final.name}")
        rank = _rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        optim = optimizer_state_flat(optimizers, model)
        if shards is not None:
            params = dict(model.named_parameters())
            for key, v in optim.items():
                fqn = key.split(".", 1)[1].rsplit(".", 1)[0]
                if fqn in shards.names and v.shape == params[fqn].shape:
                    optim[key] = shards.wrap(v)
        state = {"model": _sharded_model_state(model, shards), "optim": optim,
                 "meta": _blob(meta), f"dp{rank if dp_rank is None else dp_rank}": _blob(rank_state)}
        with warnings.catch_warnings():  # DCP warns when it runs without a process group (one process): expected
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            if self.async_save:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
                self.pending = (future, tmp, final, fault_hook)
                return final
            dcp.save(state, checkpoint_id=str(tmp))
        self._finalize(tmp, final, fault_hook)
        return final

    def wait(self) -> None:
        """Finish a background write (rename + prune); a no-op when none is pending."""
        if self.pending is None:
            return
        future, tmp, final, hook = self.pending
        self.pending = None
        future.result()
        self._finalize(tmp, final, hook)

    def _finalize(self, tmp: Path, final: Path, fault_hook) -> None:
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


def load_checkpoint(path: str | Path, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer],
                    dp_rank: int | None = None, dp: int | None = None,
                    shards: RowShards | None = None) -> tuple[dict, dict]:
    """Load model and optimizer state in place (only the parameters `model` holds: a pipeline stage
    loads its own blocks); returns (meta, this data-parallel rank's state)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no .metadata); pick a step_* "
                                f"directory under <run dir>/checkpoints")
    dp_rank = _rank() if dp_rank is None else dp_rank
    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    rank_key = f"dp{dp_rank}"
    saved = sorted(int(k[2:]) for k in md if re.fullmatch(r"dp\d+", k))
    if rank_key not in md or (dp is not None and len(saved) != dp):
        raise ValueError(f"checkpoint {path} was written with {len(saved)} data-parallel rank(s) and this run has "
                         f"{dp if dp is not None else 'more'}: resume with the same data-parallel size "
                         f"(world size / parallel.pp = {len(saved)}); the pipeline degree may differ")
    params = dict(model.named_parameters())
    optim_tmpl = {}
    for key, m in md.items():
        if not key.startswith("optim."):
            continue
        fqn = key.split(".", 2)[2].rsplit(".", 1)[0]
        if fqn not in params:
            continue  # another pipeline stage's parameter
        if shards is not None and fqn in shards.names and len(m.size) == params[fqn].dim():
            optim_tmpl[key[len("optim."):]] = shards.local_template(tuple(m.size), m.properties.dtype)
        else:
            optim_tmpl[key[len("optim."):]] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    state = {"model": _sharded_model_state(model, shards), "optim": optim_tmpl, "meta": b"", rank_key: b""}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict({k: _unwrap(v) for k, v in state["model"].items()})
    load_optimizer_state_flat(optimizers, model, {k: _unwrap(v) for k, v in state["optim"].items()})
    return _unblob(state["meta"]), _unblob(state[rank_key])
