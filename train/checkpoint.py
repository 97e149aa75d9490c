"""Sharded checkpoints with torch.distributed.checkpoint (DESIGN.md "Training").

Layout: `<run dir>/checkpoints/step_<8-digit step>/`, one directory per step, written to
`.tmp-step_<step>` (synchronously or in the background) and renamed by rank 0 once every rank's files
are confirmed written (below), so a directory that exists is complete and a crash mid-write leaves only
a `.tmp-*` that the next save removes. Each holds DCP's `.metadata` (rank 0), one data file
`__<rank>_<n>.distcp` per rank (empty for a rank with nothing to write) and `checksums.json`, the size
and SHA-256 of every other file. The last `keep` checkpoints are kept.

Who decides: rank 0. Listing a directory on a shared filesystem can give different ranks different
answers, so the checkpoint to resume from is the one rank 0 lists (`latest_verified_checkpoint`
broadcasts rank 0's candidates and the manifests rank 0 read; every rank hashes its share of the files,
the problems are gathered), and every rank returns the same. After a write each rank hashes the files it
wrote, in its own view; rank 0 gathers these, checks that every rank reported its files and that each is
there in rank 0's view with the reported size, writes `checksums.json` from the reports and only then
renames; otherwise (a rank's file missing or of another size) every rank raises the same
`CheckpointError`, the `.tmp-*` is removed and the previous checkpoints are untouched.

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
  (the loader's state is per reader); pp and ep may change; the rank state also holds the spike
  detector's history and Anticipatory Routing's look-ahead batches (train/stability/spike.py,
  train/stability/anticipatory.py);
- `rank<r>`: what only global rank r holds -- while Anticipatory Routing is active, the routing indices
  cached for its stage's MoE layers; written only then, and read back only by the same rank.

Loading never unpickles an arbitrary object (a checkpoint someone shares must not run code when it is
resumed from): DCP's `.metadata` is read by an unpickler that knows only DCP's metadata classes, the state
blobs with `torch.load(weights_only=True)` and the few data types they hold (numpy arrays) allowed; anything
else is refused with a `CheckpointError` before it is constructed.

Damaged checkpoints: when resuming, a `step_*` whose files do not match its manifest (or that has no
`.metadata`) is reported and moved aside to `.damaged-step_<step>` (with a `DAMAGED` note saying what is
wrong), so it never counts toward `keep` and is never deleted: the user decides what to do with it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from flashtrain.config.errors import (
    CheckpointError,  # noqa: F401 (re-exported)
    ConfigError,
    InputNotFoundError,
)
from flashtrain.parallel.sharded_state import GlobalChunk

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
OWN_PREFIX = "rank"  # `rank<r>`: state only global rank r has (a resume with the same layout reads it back)


def _blob(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _numpy_globals() -> list:
    """What a pickled numpy array needs (the data-loader state holds token arrays, the RNG state numpy's)."""
    core = getattr(np, "_core", None) or np.core
    dtypes = [type(np.dtype(t)) for t in (bool, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                          np.uint32, np.uint64, np.float16, np.float32, np.float64)]
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, *dtypes]


def _refused(what: str, error: BaseException) -> CheckpointError:
    text = str(error)
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"(?:global|class) '?([\w.]+)'?", text)
    name = found.group(1) if found else text.splitlines()[0][:200] if text else type(error).__name__
    return CheckpointError(f"{what} holds a pickled object ({name}) that a flashtrain checkpoint never contains; "
                           f"refusing to load it (unpickling it could run code): use a checkpoint from a source you "
                           f"trust, written by flashtrain")


def _unblob(data: bytes, what: str = "a checkpoint's state blob"):
    """A state blob written by `_blob`: tensors, plain Python values and numpy arrays only
    (`weights_only=True`); any other pickled object raises CheckpointError without being built."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused(what, e) from None


# DCP's `.metadata` is a pickle of these classes; nothing else may be built while reading it
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,  # every class of DCP's metadata module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and the dtypes (below)
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        names = _METADATA_GLOBALS.get(module, set())
        allowed = module in _METADATA_GLOBALS and (names is None or name in names)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` read by `_MetadataUnpickler` instead of `pickle.load`."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise _refused(f"checkpoint {self.path}: its .metadata", e) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint {self.path}: its .metadata is not DCP metadata "
                                  f"({type(metadata).__name__}); pick a step_* directory written by flashtrain")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor entry (our state blobs, stored as `bytes`) is read with
    `torch.load(weights_only=True)`: DCP's own `load_bytes` unpickles it with `weights_only=False`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refused(f"checkpoint entry {read_item.dest_index.fqn!r}", e) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: str | Path):
    """The DCP metadata of a checkpoint directory, read safely (`SafeReader`)."""
    return SafeReader(str(path)).read_metadata()


def dcp_load(state: dict, path: str | Path) -> None:
    """`dcp.load` of `state` from `path` through `SafeReader` and `SafeLoadPlanner`; a refused object is
    one CheckpointError (DCP wraps what a rank raised in a CheckpointException), a missing or unreadable file
    included."""
    with warnings.catch_warnings():  # DCP warns when it runs without a process group (one process): expected
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
        except CheckpointException as e:  # a BaseException: `except Exception` would not see it
            errors = [error for error, _ in e.failures.values()]
            for error in errors:
                if isinstance(error, CheckpointError):
                    raise CheckpointError(str(error)) from None
            first = errors[0] if errors else e
            raise CheckpointError(f"checkpoint {path} could not be read ({type(first).__name__}: {first}); it is "
                                  f"damaged or still being written: pick another checkpoint") from None


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


def _from_rank0(read):
    """Collective: `read()` on rank 0 alone; its result (or the exception it raised) on every rank."""
    if _world() == 1:
        return read()
    box = [None]
    if _rank() == 0:
        try:
            box[0] = (True, read())
        except Exception as e:  # raised on every rank below, so that none waits for the others
            box[0] = (False, e)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _write_manifest_file(directory: Path, entries: dict) -> None:
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(sorted(entries.items())), f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)


def write_manifest(directory: Path) -> None:
    """Collective: rank 0 lists the directory's files (and broadcasts the list), every rank hashes its
    share of them, rank 0 writes the manifest. For a directory written otherwise (launch/import_official.py's
    PartsWriter); `CheckpointWriter` builds its manifest from what each rank confirms it wrote."""
    directory = Path(directory)
    files = _from_rank0(lambda: sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST))
    mine, errors = {}, []
    for name in files[_rank()::_world()]:
        try:
            mine[name] = _digest(directory / name)
        except OSError as e:
            errors.append(f"rank {_rank()} could not read {name} ({e})")
    parts = _gather((mine, errors))
    errors = [e for _, errs in parts for e in errs]
    if errors:
        raise CheckpointError(f"cannot write the {MANIFEST} of {directory}: {'; '.join(errors)}")
    if _rank() == 0:
        _write_manifest_file(directory, {k: v for part, _ in parts for k, v in part.items()})


def _read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """(the files a checkpoint's manifest lists, or None; what is wrong with the manifest, or None)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None, None
    try:
        listed = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return None, f"its {MANIFEST} is unreadable ({e})"
    if not isinstance(listed, dict) or not all(isinstance(v, dict) and {"size", "sha256"} <= v.keys()
                                               for v in listed.values()):
        return None, f"its {MANIFEST} is unreadable (not a map of file name to size and sha256)"
    return listed, None


def checkpoint_problem(path: str | Path, quick: bool = False) -> str | None:
    """Collective: None when every file the manifest lists is there with its size and checksum; else what
    is wrong. Rank 0 reads the manifest and broadcasts it, each rank checks its share of the files, the
    problems are gathered: the answer is the same on every rank. A checkpoint written before manifests
    existed is not checked. `quick`: every file's presence and size, but only DCP's `.metadata` hashed (what
    a tool reads before its process group exists, `check_readable`)."""
    path = Path(path)
    listed, problem = _from_rank0(lambda: _read_manifest(path))
    if listed is None:
        return problem
    problems = []
    for name in sorted(listed)[_rank()::_world()]:
        f = path / name
        try:
            if not f.is_file():
                problems.append(f"{name} is missing")
            elif f.stat().st_size != listed[name]["size"]:
                problems.append(f"{name} has {f.stat().st_size} bytes, {listed[name]['size']} were written")
            elif (not quick or name == _DCP_METADATA) and _digest(f)["sha256"] != listed[name]["sha256"]:
                problems.append(f"{name} does not match its checksum")
        except OSError as e:
            problems.append(f"{name} is unreadable ({e})")
    found = [p for part in _gather(problems) for p in part]
    return "; ".join(found) if found else None


DAMAGED_PREFIX = ".damaged-"  # `.damaged-step_<step>`: a damaged checkpoint moved aside (never counted, never deleted)
DAMAGED_NOTE = "DAMAGED"  # inside it: what was wrong, and when it was found


def check_readable(path: str | Path, allow_damaged: bool = False, quick: bool = False, report=log.warning) -> None:
    """A tool that reads a checkpoint (launch/evaluate.py, launch/harness.py, launch/export_official.py)
    verifies it as a resume does (`checkpoint_problem`, collective; `quick` before a process group exists)
    and refuses a damaged one -- files that do not match the manifest, or a directory set aside as damaged
    (`.damaged-step_*`, its `DAMAGED` note) -- with a CheckpointError; `allow_damaged` (the tools'
    --allow-damaged) reports it through `report` and goes on."""
    path = Path(path)
    note = path / DAMAGED_NOTE
    if note.is_file():
        problem = " ".join(note.read_text(errors="replace").split()) or f"{DAMAGED_NOTE} note"
    elif path.name.startswith(DAMAGED_PREFIX):
        problem = "it was set aside as damaged"
    else:
        problem = checkpoint_problem(path, quick)
    if problem is None:
        return
    if not allow_damaged:
        raise CheckpointError(f"checkpoint {path} is damaged ({problem}); give an intact one (a resume would skip "
                              f"this one for the previous complete checkpoint), or --allow-damaged to read it anyway")
    report(f"checkpoint {path} is damaged ({problem}); reading it anyway (--allow-damaged)")


def _candidates(run_dir: str | Path, with_partial: bool) -> list[tuple[Path, bool]]:
    """(checkpoint directory, complete) newest last: the complete ones and, `with_partial`, every `step_*`
    without DCP's `.metadata` (a `step_*` exists only once complete, so one without is damaged: a file was
    deleted)."""
    found = [(p, True) for p in complete_checkpoints(run_dir)]
    root = Path(run_dir) / "checkpoints"
    if with_partial and root.is_dir():
        found += [(p, False) for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)
                  and not (p / ".metadata").is_file()]
    return sorted(found, key=lambda c: int(STEP_DIR.match(c[0].name).group(1)))


def set_aside(path: Path, problem: str) -> Path:
    """Rank 0: move a damaged checkpoint out of the `step_*` names (atomic rename) to `.damaged-step_<step>`
    (`-2`, `-3`, ... when that name is taken), with a note of what is wrong; returns the new path."""
    target = path.with_name(f"{DAMAGED_PREFIX}{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{DAMAGED_PREFIX}{path.name}-{n}")
    os.replace(path, target)
    try:
        (target / DAMAGED_NOTE).write_text(f"{path.name} was found damaged when resuming: {problem}\n")
    except OSError:  # the note is a courtesy; the rename is what matters
        pass
    return target


def latest_verified_checkpoint(run_dir: str | Path, report=log.warning, move_damaged: bool = False) -> Path | None:
    """Collective: the newest complete checkpoint whose files match their checksums; each damaged newer
    one (files that do not match the manifest, or no `.metadata`) is reported and skipped. The candidates
    are rank 0's listing, broadcast, so every rank walks the same ones and returns the same path.
    `move_damaged` (the trainer's resume): rank 0 also moves each damaged one aside (`set_aside`), so it
    no longer counts toward `train.checkpoint.keep` and no save ever deletes it."""
    for path, complete in reversed(_from_rank0(lambda: _candidates(run_dir, move_damaged))):
        problem = checkpoint_problem(path) if complete else ".metadata is missing"
        if problem is None:
            return path
        if move_damaged:
            moved = _from_rank0(lambda: set_aside(path, problem))
            report(f"checkpoint {path} is damaged ({problem}); moved it aside to {moved} (it no longer counts "
                   f"toward train.checkpoint.keep and is never deleted: inspect or delete it yourself) and "
                   f"skipping it for the previous complete one")
        else:
            report(f"checkpoint {path} is damaged ({problem}); skipping it for the previous complete one")
    return None


# ------------------------------------------------------------------------------- confirmed writes
_DCP_METADATA = ".metadata"


def _data_file_rank(name: str) -> int | None:
    m = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
    return int(m.group(1)) if m else None


def _written_files(directory: Path, rank: int) -> dict:
    """What this rank wrote into `directory`, in its own view: {"files": {name: {"size", "sha256"}},
    "problems": [...]}. DCP's FileSystemWriter writes `__<rank>_<n>.distcp` (one per writer thread, empty
    when the rank has nothing to write) on every rank and `.metadata` on the coordinator, rank 0 (the
    background write's group holds every rank in order, so its ranks are the global ones)."""
    files, problems = {}, []
    try:
        names = sorted(p.name for p in directory.iterdir()
                       if _data_file_rank(p.name) == rank or (rank == 0 and p.name == _DCP_METADATA))
    except OSError as e:
        return {"files": files, "problems": [f"cannot list {directory} ({e})"]}
    for name in names:
        try:
            files[name] = _digest(directory / name)
        except OSError as e:
            problems.append(f"cannot read {name} it wrote ({e})")
    return {"files": files, "problems": problems}


def _before_confirm(tmp: Path) -> None:
    """Every rank, once it has recorded the files it wrote and before rank 0 confirms them. A seam for the
    tests: a file that vanishes or changes here is what a lost write or a lagging shared filesystem looks
    like to rank 0."""


def _confirm_written(tmp: Path, reports: list[dict]) -> list[str]:
    """Rank 0: what is wrong with the ranks' reports, checked against the checkpoint's `.metadata` (which
    data file holds bytes up to where) and against rank 0's own view of each reported file."""
    problems = [f"rank {r}: {p}" for r, rep in enumerate(reports) for p in rep["problems"]]
    extent: dict[str, int] = {}
    for info in read_metadata(tmp).storage_data.values():
        extent[info.relative_path] = max(extent.get(info.relative_path, 0), info.offset + info.length)
    for r, rep in enumerate(reports):
        unconfirmed = sorted(n for n in extent if _data_file_rank(n) == r and n not in rep["files"])
        if unconfirmed:
            problems.append(f"rank {r} did not confirm writing {', '.join(unconfirmed)}, which the checkpoint's "
                            f"{_DCP_METADATA} lists")
        elif not any(_data_file_rank(n) == r for n in rep["files"]):
            problems.append(f"rank {r} confirmed no data file (__{r}_<n>.distcp)")
        if r == 0 and _DCP_METADATA not in rep["files"]:
            problems.append(f"rank 0 did not confirm writing {_DCP_METADATA}")
        for name, d in sorted(rep["files"].items()):
            f = tmp / name
            if d["size"] < extent.get(name, 0):
                problems.append(f"rank {r}'s {name} has {d['size']} bytes and the checkpoint's {_DCP_METADATA} "
                                f"places data up to byte {extent[name]}")
            elif not f.is_file():
                problems.append(f"rank {r}'s {name} ({d['size']} bytes written) is missing in rank 0's view")
            elif f.stat().st_size != d["size"]:
                problems.append(f"rank {r}'s {name} has {d['size']} bytes in rank {r}'s view and "
                                f"{f.stat().st_size} in rank 0's")
    return problems


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
             rank_state: dict, dp_rank: int | None = None, fault_hook=None, layout: dict | None = None,
             own_state: dict | None = None) -> Path:
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
        if own_state is not None:  # this rank's own (e.g. the routing indices cached for its pipeline stage)
            state[f"{OWN_PREFIX}{rank}"] = _blob(own_state)
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

    def _failed(self, tmp: Path, error: BaseException, collective: bool = False) -> CheckpointError:
        """Remove the partial write and describe the failure; the complete checkpoints are untouched.
        `collective`: every rank is here (an agreed verdict), so each returns once the removal is done."""
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if collective:
            _barrier()
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
        """Collective (default group): confirm every rank's files (module docstring), write the manifest
        from the ranks' reports, rename, prune. Every rank gets rank 0's verdict, so a failure raises the
        same `CheckpointError` everywhere and nothing is renamed."""
        report = _written_files(tmp, _rank())
        _before_confirm(tmp)
        reports = _gather(report)

        def confirm() -> str | None:
            try:
                problems = _confirm_written(tmp, reports)
                if not problems:
                    _write_manifest_file(tmp, {k: v for rep in reports for k, v in rep["files"].items()})
                return "; ".join(problems) or None
            except Exception as e:  # an unreadable .metadata, a failed manifest write: a verdict, not a hang
                return f"confirming the written files failed ({type(e).__name__}: {e})"

        verdict = _from_rank0(confirm)
        if verdict is not None:
            raise self._failed(tmp, CheckpointError(f"not every rank's files are confirmed: {verdict}"),
                               collective=True)
        if fault_hook is not None:
            fault_hook(tmp)
        if _rank() == 0:
            if final.exists():  # the same step again (after a spike rollback): out of the way first
                _discard(final)
            os.replace(tmp, final)
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            for old in complete_checkpoints(self.run_dir)[:-self.keep] if self.keep > 0 else []:
                _discard(old)
            for stale in [*final.parent.glob(".tmp-step_*"), *final.parent.glob(".old-step_*")]:
                if stale.name != f".tmp-{final.name}":
                    shutil.rmtree(stale, ignore_errors=True)
        _barrier()


def _discard(path: Path) -> None:
    """Delete a checkpoint directory so that a crash midway never leaves a `step_*` with files missing: it
    is renamed `.old-step_*` (atomic) first; a leftover `.old-*` is removed by the next save."""
    old = path.with_name(f".old-{path.name}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(path, old)
    shutil.rmtree(old, ignore_errors=True)


def weights_only(path: str | Path) -> bool:
    """True for a checkpoint of model weights alone (no optimizer, data-loader or RNG state)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        return False
    md = read_metadata(path).state_dict_metadata
    return not any(k.startswith("optim.") or re.fullmatch(r"dp\d+", k) for k in md)


def _load_weights_only(path: Path, model: nn.Module, layout: dict) -> dict:
    """A checkpoint of weights alone (launch/import_official.py): the model's tensors and `meta`."""
    state = {"model": _sharded_model_state(model, layout), "meta": b""}
    dcp_load(state, path)
    model.load_state_dict({k: _unwrap(v) for k, v in state["model"].items()})
    return _unblob(state["meta"], f"checkpoint {path}: its meta")


def read_meta(path: str | Path) -> dict:
    """A checkpoint's `meta` alone (step, tokens seen, the run's config; an import: its model config)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise InputNotFoundError(f"{str(path)!r} is not a checkpoint (no .metadata); give a checkpoints/step_XXXXXXXX "
                                 f"directory or one written by launch/import_official.py")
    state = {"meta": b""}
    dcp_load(state, path)
    return _unblob(state["meta"], f"checkpoint {path}: its meta")


def load_weights(path: str | Path, model: nn.Module, layout: dict | None = None) -> dict:
    """The model's parameters and buffers alone, into any layout and any number of data-parallel ranks
    (evaluation, train/evaluation/heldout.py); returns the checkpoint's meta."""
    return _load_weights_only(Path(path), model, layout or {})


def load_checkpoint(path: str | Path, model: nn.Module, optimizers: dict, dims=None,
                    layout: dict | None = None) -> tuple[dict, dict]:
    """Load model and optimizer state in place (only the parameters `model` holds: a pipeline stage
    loads its own blocks, an expert / Engram shard its rows, ZeRO-1 its owned pieces of the optimizer
    state); returns (meta, this data-parallel rank's state). A checkpoint of weights alone (an imported
    release, launch/import_official.py: no optimizer, data-loader or RNG state) loads the model and
    returns (meta, None). `dims` (parallel/dims.py `ParallelDims`): this rank's data-parallel rank among how
    many; None: the process group's rank, as many readers as saved."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no .metadata); pick a step_* "
                                f"directory under <run dir>/checkpoints")
    dp_rank, dp = (_rank(), None) if dims is None else (dims.dp_rank, dims.dp)
    layout = layout or {}
    md = read_metadata(path).state_dict_metadata
    rank_key = f"dp{dp_rank}"
    saved = sorted(int(k[2:]) for k in md if re.fullmatch(r"dp\d+", k))
    if weights_only(path):
        return _load_weights_only(path, model, layout), None
    if rank_key not in md or (dp is not None and len(saved) != dp):
        rank_key = f"dp{dp_rank % len(saved)}"  # another number of readers: `mine` is that rank's (its "data": None)
    same_readers = rank_key == f"dp{dp_rank}" and (dp is None or len(saved) == dp)
    state = {"model": _sharded_model_state(model, layout), "optim": _optimizer_templates(md, optimizers, model, layout),
             "meta": b"", rank_key: b""}
    own_key = f"{OWN_PREFIX}{_rank()}"
    if own_key in md:
        state[own_key] = b""
    dcp_load(state, path)
    mine = _unblob(state[rank_key], f"checkpoint {path}: its {rank_key}")
    own = _unblob(state[own_key], f"checkpoint {path}: its {own_key}") if own_key in state else None
    meta = _unblob(state["meta"], f"checkpoint {path}: its meta")
    model.load_state_dict({k: _unwrap(v) for k, v in state["model"].items()})
    _install_optimizer_state(optimizers, model, state["optim"])
    mine["own"] = own
    if not same_readers:
        mine["data"] = None  # this layout's readers take every reader's data position: `load_data_states`
    return meta, mine


def saved_readers(path: str | Path) -> int:
    """How many data-parallel readers wrote checkpoint `path` (its `dp<r>` states)."""
    return sum(1 for k in read_metadata(path).state_dict_metadata if re.fullmatch(r"dp\d+", k))


def load_data_states(path: str | Path) -> list[dict]:
    """Every data-parallel rank's data-loader state of checkpoint `path` (data/loader.py `relayout` re-splits
    them over another layout), read from each rank's `dp<r>` state; and checks that none of them holds
    look-ahead batches (Anticipatory Routing active at the save), which belong to their reader."""
    n = saved_readers(path)
    state = {f"dp{r}": b"" for r in range(n)}
    dcp_load(state, path)
    blobs = [_unblob(state[f"dp{r}"], f"checkpoint {path}: its dp{r}") for r in range(n)]
    ahead = [b.get("anticipatory_routing", {}) for b in blobs]
    if any(a.get("batches") for a in ahead):
        raise ConfigError(f"checkpoint {path} was saved while Anticipatory Routing held look-ahead batches (until "
                          f"step {ahead[0].get('active_until')}), which belong to its {n} data-parallel reader(s): "
                          f"resume with {n} reader(s) (world size / (parallel.pp x parallel.cp)) until then, and "
                          f"change the layout at a later checkpoint")
    return [b["data"] for b in blobs]
