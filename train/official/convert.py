"""Released V4.1-Flash checkpoints in and out (launch/import_official.py, launch/export_official.py).

Import: `config.json` is checked against the model config (every differing field named), every tensor the
model needs is checked for presence, dtype and shape before anything is written, then each is read,
dequantised as the public inference code does (FP8: codes x the power-of-two scale of their 32 x 32 tile;
FP4 experts: the E2M1 value x the scale of its 32 input channels; Engram rows: codes x the scale of their
32 channels) and written as fp32 into a DCP checkpoint under flashtrain's names, the experts of a layer
as rows of one stacked tensor. A release with the DSpark drafter (`config.json` `dspark_block_size` > 0) has its
`mtp.*` tensors imported too (checked against the model config's drafter fields), so the DSpark stage can start
from DeepSeek's drafter (`train.backbone=` the import); `--backbone-only` leaves them out (listed as unused, as
every tensor the model does not use).

Export: the reverse, from a flashtrain checkpoint: each tensor read on its own from DCP, quantised into the
release's formats (layout.py) and written into size-limited safetensors shards with an index and
`config.json`. From a DSpark-stage checkpoint (train.stage=dspark) the export is the whole release: the
backbone read from the checkpoint the stage names in its meta (its fingerprint checked), the drafter from the
stage checkpoint; an import holding `mtp.*` exports both from itself.

Memory: the source is read tensor by tensor (safetensors files are memory-mapped and closed after use;
DCP reads only the requested tensor), and the destination holds at most one part / shard of converted
tensors before writing it (`part_bytes` / `shard_bytes`).
"""

from __future__ import annotations

import json
import math
import resource
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashtrain.config.errors import FlashtrainError
from flashtrain.config.typed import typed_config
from flashtrain.model.config import ModelConfig
from flashtrain.model.dspark import DSpark
from flashtrain.model.param_kinds import ParamKind, parameter_kinds
from flashtrain.model.quant import (
    fp4_block_dequant,
    fp4_block_quant,
    fp8_block_dequant,
    fp8_block_quant,
    fp8_weight_dequant,
    fp8_weight_quant,
)
from flashtrain.parallel.construct import model_template
from flashtrain.train.checkpoint import _blob, _unblob, dcp_load, read_metadata
from flashtrain.train.dspark.stage import backbone_pointer
from flashtrain.train.official.dcp_parts import PartsWriter, pieces
from flashtrain.train.official.layout import (
    BLOCK,
    TORCH_DTYPE,
    OfficialTensor,
    check_quantisable,
    config_differences,
    has_drafter_config,
    normalise_name,
    official_config,
    official_tensors,
    quantised_from_config,
)
from flashtrain.train.official.safetensors import SafeFile, ShardedWriter, read_index

GiB = 1 << 30


def peak_rss_gib() -> float:
    """This process's peak resident memory (GiB): VmHWM, which starts afresh at exec (ru_maxrss would carry
    the RSS of the process that started this one)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


class OfficialCheckpointError(FlashtrainError, ValueError):
    """A released checkpoint does not match the model: the message names each tensor or config field."""


def model_shapes(cfg: ModelConfig, drafter: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model's state dict (parameters and persistent buffers) and its shape, in order;
    `drafter`: the DSpark drafter's `mtp.*` after the backbone's."""
    return model_layout(cfg, drafter)[0]


def model_layout(cfg: ModelConfig, drafter: bool = False) -> tuple[dict[str, tuple[int, ...]], dict[str, ParamKind]]:
    """`model_shapes`, and each parameter's kind (model/param_kinds.py), from meta-device templates."""
    template = model_template(cfg)
    shapes, kinds = {k: tuple(v.shape) for k, v in template.state_dict().items()}, parameter_kinds(template)
    if drafter:
        with torch.device("meta"):
            d = DSpark(cfg, init=False)
        shapes.update((k, tuple(v.shape)) for k, v in d.state_dict().items())
        kinds.update(parameter_kinds(d))
    return shapes, kinds


def engram_rows(shapes: dict[str, tuple[int, ...]], kinds: dict[str, ParamKind]) -> list[int]:
    """Each Engram table's row count, in layer order (the state dict's)."""
    return [s[0] for k, s in shapes.items() if kinds.get(k) is ParamKind.ENGRAM_TABLE]


# -------------------------------------------------------------------------------------------- formats
def dequantise(t: OfficialTensor, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The fp32 value of a released tensor, as the public inference code computes with it."""
    if t.fmt == "fp8":
        return fp8_weight_dequant(data, scale, BLOCK)
    if t.fmt == "fp4":
        return fp4_block_dequant(data, scale, BLOCK)
    if t.fmt == "fp8_rows":
        return fp8_block_dequant(data, scale, BLOCK)
    return data.float()


def quantise(t: OfficialTensor, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The released tensors (data, and scale when quantised) for the fp32 `value` of `t`."""
    value = value.float()
    if t.fmt == "fp8":
        codes, scale = fp8_weight_quant(value, BLOCK)
    elif t.fmt == "fp4":
        codes, scale = fp4_block_quant(value, BLOCK, torch.float8_e8m0fnu)
    elif t.fmt == "fp8_rows":
        codes, scale = fp8_block_quant(value, BLOCK)
    else:
        return [(t.name, value.to(torch.float32 if t.fmt == "fp32" else torch.bfloat16))]
    return [(t.name, codes), (t.scale_name, scale)]


# -------------------------------------------------------------------------------------------- import
@dataclass
class ImportReport:
    out: Path
    tensors: int = 0
    bytes_read: int = 0
    unused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _read_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise OfficialCheckpointError(f"{src} has no config.json: point SRC_DIR at the released checkpoint's directory "
                                      f"(config.json, model*.safetensors, model.safetensors.index.json)")
    return json.loads(path.read_text())


def _locate(src: Path, tensors: list[OfficialTensor]) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """{stored name: (file, name in the file)} for every stored tensor `tensors` need; the unused names."""
    index = read_index(src)
    by_name = {}
    for original, file in index.items():
        by_name.setdefault(normalise_name(original), (file, original))
    need = {s.name for t in tensors for s in t.stored()}
    missing = sorted(need - set(by_name))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise OfficialCheckpointError(f"{src}: missing tensor(s) {shown}; the model config expects them (is it the "
                                      f"checkpoint of this model? compare its config.json with the +exp you gave)")
    unused = sorted(by_name[n][1] for n in set(by_name) - need)
    return {n: by_name[n] for n in need}, unused


def _check_stored(src: Path, tensors: list[OfficialTensor], where: dict[str, tuple[str, str]]) -> None:
    """Dtype and shape of every stored tensor, from the headers only."""
    problems = []
    files = {}
    try:
        for t in tensors:
            for s in t.stored():
                file, name = where[s.name]
                if file not in files:
                    files[file] = SafeFile(src / file)
                dtype, shape = files[file].info(name)
                if dtype != TORCH_DTYPE[s.dtype] and not (s.dtype == "I8" and dtype == torch.uint8):
                    problems.append(f"{name} ({file}) is {dtype}, the release format is {TORCH_DTYPE[s.dtype]}")
                elif tuple(shape) != tuple(s.shape):
                    problems.append(f"{name} ({file}) has shape {tuple(shape)}, the model needs {tuple(s.shape)}")
    finally:
        for f in files.values():
            f.close()
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise OfficialCheckpointError(f"{src}: {shown}")


def import_official(src: str | Path, out: str | Path, cfg: ModelConfig, run_config: dict,
                    part_bytes: int = 2 * GiB, log=print, drafter: bool | None = None) -> ImportReport:
    """Convert the released checkpoint in `src` into a flashtrain DCP checkpoint `out` for model `cfg`
    (`run_config`: the resolved run configuration, stored as the checkpoint's config). Fails, before
    writing anything, on a config.json field or a tensor that does not match. `drafter`: import the DSpark
    drafter's `mtp.*` (default: when config.json describes one)."""
    src, out = Path(src), Path(out)
    found = _read_config(src)
    quantised = quantised_from_config(found)
    drafter = has_drafter_config(found) if drafter is None else drafter
    if drafter:
        cfg.validate_drafter()
    shapes, kinds = model_layout(cfg, drafter)
    expected = official_config(cfg, engram_rows(shapes, kinds), quantised, drafter=drafter)
    diff = config_differences(found, expected)
    if diff:
        raise OfficialCheckpointError(f"{src}/config.json does not match the model config:\n  " + "\n  ".join(diff)
                                      + "\nimport with the +exp (and model.* overrides) of the released model")
    report = ImportReport(out)
    if cfg.engram_compressed_vocab_size is None and cfg.engram_layer_ids:
        report.notes.append("engram_compressed_vocab_size: config.json has "
                            f"{found.get('engram_compressed_vocab_size')}, "
                            f"the model config takes it from the token map; set model.engram_compressed_vocab_size="
                            f"{found.get('engram_compressed_vocab_size')} to have it checked at start")
    tensors = official_tensors(shapes, kinds, quantised)
    where, report.unused = _locate(src, tensors)
    _check_stored(src, tensors, where)

    writer = PartsWriter(out)
    pending: dict[str, object] = {}
    expert_rows: dict[str, list] = {}
    pending_bytes = 0

    def flush():
        nonlocal pending, expert_rows, pending_bytes
        state = dict(pending)
        for key, chunks in expert_rows.items():
            state[key] = pieces(chunks, shapes[key])
        writer.add({"model": state})
        pending, expert_rows, pending_bytes = {}, {}, 0

    by_file: dict[str, list[OfficialTensor]] = {}
    for t in tensors:
        by_file.setdefault(where[t.name][0], []).append(t)
    for n, (file, group) in enumerate(sorted(by_file.items()), 1):
        opened = {file: SafeFile(src / file)}
        try:
            for t in group:
                parts = []
                for s in t.stored():
                    sfile, name = where[s.name]
                    if sfile not in opened:
                        opened[sfile] = SafeFile(src / sfile)
                    parts.append(opened[sfile].get(name))
                report.bytes_read += sum(p.numel() * p.element_size() for p in parts)
                value = dequantise(t, parts[0], parts[1] if len(parts) > 1 else None)
                if t.expert is None:
                    pending[t.source] = value
                else:
                    expert_rows.setdefault(t.source, []).append((value.unsqueeze(0), (t.expert,) + (0,) * value.dim()))
                pending_bytes += value.numel() * value.element_size()
                report.tensors += 1
                if pending_bytes >= part_bytes:
                    flush()
        finally:
            for f in opened.values():
                f.close()
        log(f"[{n}/{len(by_file)}] {file}: {len(group)} tensors")
    flush()
    meta = {"step": 0, "tokens_seen": 0, "config": run_config, "weights_only": True, "imported_from": str(src),
            "unused_tensors": report.unused, "drafter": drafter}
    writer.add({"meta": _blob(meta)})
    writer.close()
    return report


# -------------------------------------------------------------------------------------------- export
@dataclass
class ExportReport:
    out: Path
    shards: int = 0
    tensors: int = 0
    bytes_written: int = 0


def _checkpoint_meta(ckpt: Path) -> tuple[dict, dict]:
    if not (ckpt / ".metadata").is_file():
        raise FileNotFoundError(f"{str(ckpt)!r} is not a complete checkpoint (no .metadata); pick a step_* directory "
                                f"under <run dir>/checkpoints")
    md = read_metadata(ckpt).state_dict_metadata
    state = {"meta": b""}
    _load(state, ckpt)
    return _unblob(state["meta"]), md


def _load(state: dict, ckpt: Path) -> None:
    dcp_load(state, ckpt)  # no arbitrary unpickling (train/checkpoint.py)


def _batches(keys: list[str], md: dict, budget: int) -> list[list[str]]:
    """Consecutive keys whose tensors together stay within `budget` bytes (a larger one alone)."""
    out, cur, size = [], [], 0
    for k in keys:
        m = md[f"model.{k}"]
        n = math.prod(m.size) * m.properties.dtype.itemsize
        if cur and size + n > budget:
            out.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    return out + ([cur] if cur else [])


def export_official(ckpt: str | Path, out: str | Path, quantised: bool = True, shard_bytes: int = 5 * GiB,
                    read_bytes: int = 1 * GiB, log=print) -> ExportReport:
    """Write the flashtrain checkpoint `ckpt` in the released layout into `out` (config.json, safetensors
    shards of at most `shard_bytes` (a larger tensor gets its own), model.safetensors.index.json),
    reading at most `read_bytes` of checkpoint tensors at a time (a larger tensor alone). A DSpark-stage
    checkpoint gives the whole release: its drafter and the backbone checkpoint it names (module docstring)."""
    ckpt, out = Path(ckpt), Path(out)
    meta, md = _checkpoint_meta(ckpt)
    cfg = typed_config(ModelConfig, meta["config"]["model"], "model")
    if cfg.ablated:
        raise OfficialCheckpointError(f"{ckpt} was trained with the ablation(s) {', '.join(cfg.ablated)}: the release "
                                      f"layout and DeepSeek's inference code have no such model; export a run "
                                      f"of V4.1 as published (model.attention=csa2, residual=mhc, ffn=moe)")
    sources, vocab = _export_sources(ckpt, meta, md)
    drafter = any(k.startswith("model.mtp.") for k in md)
    shapes, kinds = model_layout(cfg, drafter)
    where = {k: next(s for s in sources if k.startswith("mtp.") == s[2]) for k in shapes}
    missing = [k for k in shapes if f"model.{k}" not in where[k][1]]
    if missing:
        raise OfficialCheckpointError(f"{ckpt} lacks model tensor(s) {missing[:8]}: was it written by this model?")
    if cfg.engram_layer_ids and cfg.engram_compressed_vocab_size is None and vocab is None:
        raise OfficialCheckpointError(
            f"{ckpt}: model.engram_compressed_vocab_size is null and the checkpoint does not record the size the "
            f"token map gave (written before it did); the public code derives its Engram hashes from it")
    tensors = official_tensors(shapes, kinds, quantised)
    if quantised:
        check_quantisable(tensors)
    out.mkdir(parents=True, exist_ok=True)
    config = official_config(cfg, engram_rows(shapes, kinds), quantised, vocab, drafter=drafter)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    writer = ShardedWriter(out, shard_bytes, metadata={"format": "pt", "exported_by": "flashtrain",
                                                       "step": str(meta.get("step", 0))})
    report = ExportReport(out)
    by_source: dict[str, list[OfficialTensor]] = {}
    for t in tensors:
        by_source.setdefault(t.source, []).append(t)
    done = 0
    batches = [(path, md_s, batch) for path, md_s, mtp in sources
               for batch in _batches([k for k in by_source if k.startswith("mtp.") == mtp], md_s, read_bytes)]
    for path, md_s, batch in batches:
        state = {"model": {k: torch.empty(tuple(md_s[f"model.{k}"].size), dtype=md_s[f"model.{k}"].properties.dtype)
                           for k in batch}}
        _load(state, path)  # one DCP read for the batch: it reads only these tensors
        for key in batch:
            value = state["model"].pop(key)
            for t in by_source[key]:
                for name, tensor in quantise(t, value if t.expert is None else value[t.expert]):
                    writer.add(name, tensor)
                    report.bytes_written += tensor.numel() * tensor.element_size()
                    report.tensors += 1
            del value
        done += len(batch)
        log(f"[{done}/{len(by_source)}] tensors converted")
    weight_map = writer.close()
    report.shards = len(set(weight_map.values()))
    return report


def _export_sources(ckpt: Path, meta: dict, md: dict) -> tuple[list[tuple[Path, dict, bool]], int | None]:
    """Where the export reads each tensor: [(checkpoint, its DCP metadata, holds the `mtp.*` tensors)], and the
    Engram compressed vocabulary the backbone's token map gave. A DSpark-stage checkpoint names its backbone
    checkpoint (train/dspark/stage.py `backbone_pointer`): read from there, once its fingerprint is the recorded
    one."""
    vocab = meta.get("engram_compressed_vocab_size")
    pointer = meta.get("backbone")
    if pointer is None:
        return [(ckpt, md, False), (ckpt, md, True)], vocab

    backbone = Path(pointer["path"])
    if not (backbone / ".metadata").is_file():
        raise OfficialCheckpointError(f"{ckpt} was trained against the backbone {backbone}, which is not a checkpoint "
                                      f"any more: restore it there (the export writes the backbone with the drafter)")
    if backbone_pointer(backbone)["fingerprint"] != pointer["fingerprint"]:
        raise OfficialCheckpointError(f"{ckpt} was trained against the backbone {backbone} (fingerprint "
                                      f"{pointer['fingerprint'][:12]}), whose files have changed since: export the "
                                      f"drafter with the backbone it was trained against")
    backbone_meta, backbone_md = _checkpoint_meta(backbone)
    if vocab is None:
        vocab = backbone_meta.get("engram_compressed_vocab_size")
    return [(backbone, backbone_md, False), (ckpt, md, True)], vocab


def error_bound(t: OfficialTensor, value: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The largest |value - dequantise(quantise(value))| the format allows, per element: half a step of the
    FP8 (3 mantissa bits: 2^-4 relative, 2^-10 x scale below the normal range) or E2M1 grid (at most 1.0 x
    scale, between 4 and 6); 0 for BF16 / FP32 storage of a value that came from BF16 / FP32."""
    if t.fmt in ("bf16", "fp32"):
        return torch.zeros_like(value)
    if t.fmt == "fp4":
        s = scale.float().repeat_interleave(BLOCK, dim=-1)
        return s * 1.0
    s = scale.float()
    if t.fmt == "fp8":
        s = s.repeat_interleave(BLOCK, 0)[: value.shape[0]].repeat_interleave(BLOCK, 1)[:, : value.shape[1]]
    else:
        s = s.repeat_interleave(BLOCK, dim=-1)
    return value.abs() * 2.0 ** -4 + s * 2.0 ** -10


__all__ = ["import_official", "export_official", "peak_rss_gib", "OfficialCheckpointError", "dequantise", "quantise",
           "error_bound", "model_shapes"]
