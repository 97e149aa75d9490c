"""Released-checkpoint import / export (issue 16; train/official/, launch/import_official.py,
launch/export_official.py) on flash_tiny-shaped synthetic checkpoints written by the export itself.

- export -> import gives back every tensor: FP32-stored ones exactly, BF16-stored ones as their BF16
  rounding, FP8 / FP4 ones within the format's bound computed from the stored scales;
- the stored names, dtypes and shapes are the release's, and hand-made blocks decode as the public
  code's tables say (E2M1 nibbles, E8M0 scales);
- a tampered checkpoint (missing tensor, wrong shape, wrong dtype, config mismatch) fails naming it;
- a run starts from the import at step 0, and a restart resumes from its own checkpoint;
- a DSpark-stage export loads strictly into a stand-in of the public module tree, whose drafter blocks alias the
  backbone's embedding and head (safetensors' `load_model`; torch's strict load misses exactly the aliases).
"""

import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import warm_launch

from flashtrain.model.param_kinds import parameter_kinds
from flashtrain.parallel.construct import model_template
from flashtrain.train.checkpoint import _blob, load_checkpoint
from flashtrain.train.config import compose, model_config
from flashtrain.train.official.convert import (
    OfficialCheckpointError,
    dequantise,
    error_bound,
    import_official,
    quantise,
)
from flashtrain.train.official.layout import OfficialTensor, official_tensors
from flashtrain.train.official.safetensors import SafeFile, read_index, write_file

pytestmark = pytest.mark.xdist_group("official_checkpoint")  # its module-scoped reference runs are shared

ROOT = Path(__file__).resolve().parent.parent
# flash_tiny with Engram heads of 32 channels: the release's FP8 Engram format scales 32 channels at a time
OVERRIDES = ["+exp=flash_tiny", "model.engram_head_dim=32"]


def _cfg():
    conf = compose(OVERRIDES)
    from omegaconf import OmegaConf

    return model_config(conf), OmegaConf.to_container(conf.model, resolve=True)


def _run(script, *args):
    out = warm_launch.run([sys.executable, str(ROOT / "launch" / script), *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A flash_tiny checkpoint with weights of every magnitude, exported (FP8 and BF16) and imported back
    through the documented commands."""
    d = tmp_path_factory.mktemp("official")
    cfg, model_dict = _cfg()
    model = model_template(cfg).materialize("cpu", 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            # the initial weights (trainable from), rows scaled over four decades so that scales and subnormal
            # codes are exercised, and no tensor left all zero
            t.add_(torch.randn(t.shape, generator=g) * 1e-3)
            if t.dim():
                t.mul_(torch.logspace(-4, 0, t.shape[0]).view(-1, *[1] * (t.dim() - 1)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = d / "ckpt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.save({"model": state, "meta": _blob({"step": 7, "tokens_seen": 0, "config": {"model": model_dict},
                                                "engram_compressed_vocab_size": 401})}, checkpoint_id=str(ckpt))
    runs = {}
    for dtype in ("fp8", "bf16"):
        runs[dtype] = _run("export_official.py", str(ckpt), str(d / f"off_{dtype}"), "--dtype", dtype,
                           "--shard-gb", "0.001")
        assert runs[dtype].returncode == 0, runs[dtype].stderr[-3000:]
        runs[f"import_{dtype}"] = _run("import_official.py", str(d / f"off_{dtype}"), str(d / f"imp_{dtype}"),
                                       *OVERRIDES, "--part-gb", "0.0005")
        assert runs[f"import_{dtype}"].returncode == 0, runs[f"import_{dtype}"].stderr[-3000:]
    return d, cfg, state, runs


def _imported(cfg, path):
    model = model_template(cfg).materialize("cpu", 1)
    meta, mine = load_checkpoint(path, model, {})
    assert mine is None and meta["step"] == 0 and meta["weights_only"]
    return model.state_dict()


def _stored(directory):
    index = read_index(directory)
    out = {}
    for file in sorted(set(index.values())):
        with SafeFile(Path(directory) / file) as f:
            for name in f.keys():
                out[name] = f.get(name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_export_import_gives_every_tensor_back(exported, dtype):
    d, cfg, state, _ = exported
    got = _imported(cfg, d / f"imp_{dtype}")
    stored = _stored(d / f"off_{dtype}")
    assert set(got) == set(state)
    formats = {}
    kinds = parameter_kinds(model_template(cfg))
    for t in official_tensors({k: tuple(v.shape) for k, v in state.items()}, kinds, dtype == "fp8"):
        want = state[t.source] if t.expert is None else state[t.source][t.expert]
        back = got[t.source] if t.expert is None else got[t.source][t.expert]
        formats[t.fmt] = formats.get(t.fmt, 0) + 1
        if t.fmt == "fp32":
            assert torch.equal(back, want), t.name
        elif t.fmt == "bf16":
            assert torch.equal(back, want.to(torch.bfloat16).float()), t.name
        else:
            bound = error_bound(t, want, stored[t.scale_name])
            err = (back - want).abs()
            assert (err <= bound).all(), (t.name, (err - bound).max().item())
            assert err.max() > 0, t.name  # really quantised
    if dtype == "fp8":
        assert set(formats) == {"fp32", "bf16", "fp8", "fp4", "fp8_rows"}
    else:
        assert set(formats) == {"fp32", "bf16"}


def test_release_names_dtypes_and_config(exported):
    d, cfg, state, runs = exported
    stored = _stored(d / "off_fp8")
    E, inter, dim = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim
    expect = {
        "layers.0.ffn.experts.3.w1.weight": (torch.int8, (inter, dim // 2)),
        "layers.0.ffn.experts.3.w1.scale": (torch.float8_e8m0fnu, (inter, dim // 32)),
        "layers.0.ffn.experts.7.w2.weight": (torch.int8, (dim, inter // 2)),
        "layers.0.attn.wq_a.weight": (torch.float8_e4m3fn, (cfg.q_lora_rank, dim)),
        "layers.0.attn.wq_a.scale": (torch.float8_e8m0fnu, (1, 2)),
        "layers.0.attn.wo_a.weight": (torch.bfloat16, tuple(state["layers.0.attn.wo_a.weight"].shape)),
        "layers.0.attn.attn_sink": (torch.float32, (cfg.n_heads,)),
        "layers.0.ffn.gate.bias_vl": (torch.float32, (E,)),
        "layers.1.engram.embed.weight": (torch.float8_e4m3fn, tuple(state["layers.1.engram.embed.weight"].shape)),
        "layers.1.engram.embed.scale": (torch.float8_e8m0fnu, (state["layers.1.engram.embed.weight"].shape[0], 1)),
        "layers.2.attn.indexer.weights_proj.weight": (torch.bfloat16, (cfg.index_n_heads, dim)),
        "head.weight": (torch.bfloat16, (cfg.vocab_size, dim)),
        "layers.0.hc_attn_fn": (torch.float32, (24, 4 * dim)),
    }
    for name, (dtype, shape) in expect.items():
        assert stored[name].dtype == dtype and tuple(stored[name].shape) == shape, name
    assert "layers.0.ffn.experts.w1" not in stored and f"layers.0.ffn.experts.{E}.w1.weight" not in stored
    bf16 = _stored(d / "off_bf16")
    assert (not any(n.endswith(".scale") for n in bf16)
            and bf16["layers.0.ffn.experts.3.w1.weight"].dtype == torch.bfloat16)
    # shards of at most 0.001 GiB of tensor data (no tensor here is larger), named as the release names them,
    # with an index
    files = sorted(p.name for p in (d / "off_fp8").glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    limit = int(0.001 * (1 << 30))
    data, largest = [], []
    for name in files:
        with SafeFile(d / "off_fp8" / name) as f:
            sizes = [f.get(n).numel() * f.get(n).element_size() for n in f.keys()]
        data.append(sum(sizes))
        largest.append(max(sizes))
        assert 0 < data[-1] <= limit, name
    # filled in order: a shard is written when the next tensor would not fit, so no shard could also have held the
    # largest tensor of the next (a smaller limit, MiB for GiB, would leave them far emptier)
    assert all(data[i] + largest[i + 1] > limit for i in range(len(files) - 1)), (data, largest)
    # the summaries: the export's tensors, bytes and shards as written; the import's bytes as read (the weights and
    # their scales, every stored tensor here), in GB with three decimals
    total = sum(data)
    assert (f"{len(stored)} tensors, {total / 1e9:.3f} GB in {len(files)} shard(s) in "
            in runs["fp8"].stdout), runs["fp8"].stdout
    assert f" tensors from {total / 1e9:.3f} GB in " in runs["import_fp8"].stdout, runs["import_fp8"].stdout
    config = json.loads((d / "off_fp8" / "config.json").read_text())
    assert config["dtype"] == "fp8" and config["expert_dtype"] == "fp4" and config["dim"] == dim
    assert config["candidate_source_layer"] == 20 and config["engram_compressed_vocab_size"] == 401
    assert config["engram_num_embeddings"] == [state[f"layers.{i}.engram.embed.weight"].shape[0] for i in (1, 14)]
    assert json.loads((d / "off_bf16" / "config.json").read_text())["expert_dtype"] is None
    assert "start from it with train.resume_from=" in runs["import_fp8"].stdout


def test_formats_decode_hand_made_blocks():
    """The public code's tables, independently: FP4 code c has magnitude [0, .5, 1, 1.5, 2, 3, 4, 6][c & 7],
    negative when c & 8, the even element in the low nibble; E8M0 byte b is 2^(b - 127); an FP8 weight's
    scale covers a 32 x 32 tile."""
    t4 = OfficialTensor("layers.0.ffn.experts.0.w1.weight", (1, 32), "fp4", "layers.0.ffn.experts.w1", 0)
    packed = torch.tensor([[c | ((c + 1) << 4) for c in range(0, 16, 2)] * 2], dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2.0
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert dequantise(t4, packed, scale).tolist() == [[2.0 * v for v in table] * 2]
    # and back: a block with amax 3.0 -> scale 2^ceil(log2(3 / 6)) = 0.5; 1.1 / 0.5 = 2.2 -> code 4 (2.0);
    # -0.8 / 0.5 = -1.6 -> code 3 | 8 (-1.5); 0.3 / 0.5 = 0.6 -> code 1 (0.5); 3.0 -> 6.0 -> code 7
    row = torch.zeros(1, 32)
    row[0, :4] = torch.tensor([1.1, -0.8, 0.3, 3.0])
    (_, codes), (_, s) = quantise(t4, row)
    assert s.view(torch.uint8).tolist() == [[126]]
    assert codes.view(torch.uint8)[0, :2].tolist() == [4 | ((3 | 8) << 4), 1 | (7 << 4)]
    t8 = OfficialTensor("layers.0.attn.wkv.weight", (40, 70), "fp8", "layers.0.attn.wkv.weight")
    w = torch.zeros(40, 70)
    w[33, 65] = 100.0  # tile (1, 2): scale 2^ceil(log2(100 / 448)) = 0.25
    w[0, 0] = 1.0  # tile (0, 0): 2^ceil(log2(1 / 448)) = 2^-8
    (_, c8), (_, s8) = quantise(t8, w)
    assert s8.shape == (2, 3) and s8.float()[1, 2] == 0.25 and s8.float()[0, 0] == 2.0 ** -8
    # 100 / 0.25 = 400 lies halfway between the e4m3 values 384 and 416 (step 32 in [256, 512)): ties to the
    # even mantissa, 384; 1 / 2^-8 = 256 exactly
    assert c8.float()[33, 65] == 384.0 and c8.float()[0, 0] == 256.0
    back = dequantise(t8, c8, s8)
    assert back[33, 65] == 96.0 and back[0, 0] == 1.0


def _copy(d, name):
    dst = d.parent / f"tampered_{name}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(d, dst)
    return dst


def _rewrite(directory, fn):
    """Apply fn(dict of name -> tensor) to the shard holding each tensor, in place."""
    index = read_index(directory)
    for file in sorted(set(index.values())):
        with SafeFile(directory / file) as f:
            tensors = {n: f.get(n) for n in f.keys()}
        fn(tensors)
        write_file(directory / file, tensors)


@pytest.mark.parametrize("case, change, message", [
    ("missing", lambda ts: ts.pop("layers.5.attn.wkv.scale", None), r"missing tensor\(s\) layers\.5\.attn\.wkv\.scale"),
    ("shape", lambda ts: ts.update({"layers.3.attn.attn_sink": torch.zeros(3)})
     if "layers.3.attn.attn_sink" in ts else None,
     r"layers\.3\.attn\.attn_sink .* has shape \(3,\), the model needs \(2,\)"),
    ("dtype", lambda ts: ts.update({"layers.2.ffn.experts.1.w3.weight": ts["layers.2.ffn.experts.1.w3.weight"]
                                    .to(torch.bfloat16)}) if "layers.2.ffn.experts.1.w3.weight" in ts else None,
     r"layers\.2\.ffn\.experts\.1\.w3\.weight .* is torch\.bfloat16, the release format is torch\.int8"),
])
def test_tampered_checkpoint_names_the_tensor(exported, case, change, message):
    d, cfg, _, _ = exported
    bad = _copy(d / "off_fp8", case)
    if case == "missing":  # drop it from the index too, as a checkpoint without it would
        index = json.loads((bad / "model.safetensors.index.json").read_text())
        del index["weight_map"]["layers.5.attn.wkv.scale"]
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    _rewrite(bad, change)
    with pytest.raises(OfficialCheckpointError, match=message):
        import_official(bad, d / f"out_{case}", cfg, {}, log=lambda *_: None)
    assert not (d / f"out_{case}").exists()


def test_config_mismatch_names_every_field(exported):
    d, cfg, _, _ = exported
    bad = _copy(d / "off_fp8", "config")
    config = json.loads((bad / "config.json").read_text())
    config["index_topk"], config["window_size"] = 16, 32
    del config["hc_eps"]
    (bad / "config.json").write_text(json.dumps(config))
    out = _run("import_official.py", str(bad), str(d / "out_config"), *OVERRIDES)
    assert out.returncode == 2
    assert "index_topk: config.json has 16, the model config 8" in out.stderr
    assert "window_size: config.json has 32, the model config 16" in out.stderr
    assert "hc_eps: missing from config.json" in out.stderr
    assert "Traceback" not in out.stderr


def test_unused_tensors_are_listed(exported):
    """The drafter (DSpark, `mtp.*`) is not trained here: its tensors are listed, its config entries ignored."""
    d, cfg, _, _ = exported
    extra = _copy(d / "off_fp8", "mtp")
    write_file(extra / "mtp.safetensors", {"mtp.0.attn.wq_a.weight": torch.zeros(2, 2, dtype=torch.bfloat16)})
    index = json.loads((extra / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.0.attn.wq_a.weight"] = "mtp.safetensors"
    (extra / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((extra / "config.json").read_text())  # a release with a drafter layer after the backbone
    config["n_mtp_layers"], config["compress_ratios"] = 1, config["compress_ratios"] + [0]
    (extra / "config.json").write_text(json.dumps(config))
    report = import_official(extra, d / "out_mtp", cfg, {}, log=lambda *_: None)
    assert report.unused == ["mtp.0.attn.wq_a.weight"]


@pytest.mark.slow
def test_a_run_starts_from_the_import_and_restarts_from_its_own_checkpoint(exported, tmp_path):
    d, cfg, _, _ = exported
    corpus = tmp_path / "corpus"
    base = [sys.executable, str(ROOT / "launch" / "pretrain.py"), *OVERRIDES, f"hydra.run.dir={tmp_path / 'run'}",
            "logging.wandb.mode=disabled", "logging.progress=false", "logging.heatmap_interval=0",
            f"data.corpus_dir={corpus}",
            "data.corpus_text_bytes=300000", "data.corpus_mm_docs=100", "data.corpus_shards=2",
            f"train.resume_from={d / 'imp_fp8'}"]
    first = warm_launch.run(base + ["train.max_steps=1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "started from the weights in" in first.stdout and "step 0, fresh optimizer state" in first.stdout
    again = warm_launch.run(base + ["train.max_steps=2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "holds weights only" in again.stdout and "resumed from" in again.stdout and "step 1" in again.stdout


# ------------------------------------------------------------------------------------- the DSpark drafter
DRAFTER = OVERRIDES + ["model.n_layers=8", "model.compress_ratios=[0,0,2,2,2,1,1,1]", "model.kv_source_layers=[2,5]",
                       "model.index_source_layers=[2,5,6]", "model.candidate_source_layer=5",
                       "model.engram_layer_ids=[1,4]", "model.dspark_target_layer_ids=[5,6,7]"]


@pytest.fixture(scope="module")
def drafter_release(tmp_path_factory):
    """A backbone checkpoint (weights, manifest) and a DSpark-stage checkpoint naming it, with weights of every
    magnitude; the stage's export (the whole release) and its import (backbone + drafter), in process."""
    from omegaconf import OmegaConf

    from flashtrain.model.dspark import DSpark
    from flashtrain.train.dspark.stage import backbone_pointer
    from flashtrain.train.official.convert import export_official
    from flashtrain.train.official.dcp_parts import PartsWriter

    d = tmp_path_factory.mktemp("official_dspark")
    conf = compose(DRAFTER)
    cfg, run_config = model_config(conf), OmegaConf.to_container(conf, resolve=True)
    g = torch.Generator().manual_seed(1)

    def spread(model):
        with torch.no_grad():
            for t in model.state_dict().values():
                t.add_(torch.randn(t.shape, generator=g) * 1e-3)
                if t.dim():
                    t.mul_(torch.logspace(-4, 0, t.shape[0]).view(-1, *[1] * (t.dim() - 1)))
        return {k: v.clone() for k, v in model.state_dict().items()}

    backbone = spread(model_template(cfg).materialize("cpu", 0))
    drafter = spread(DSpark(cfg, seed=2))
    writer = PartsWriter(d / "backbone")
    writer.add({"model": backbone})
    writer.add({"meta": _blob({"step": 8, "tokens_seen": 0, "config": run_config,
                               "engram_compressed_vocab_size": 401})})
    writer.close()
    stage = d / "stage"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.save({"model": drafter, "meta": _blob({"step": 3, "tokens_seen": 0, "config": run_config,
                                                   "backbone": backbone_pointer(d / "backbone")})},
                 checkpoint_id=str(stage))
    export_official(stage, d / "release", shard_bytes=1 << 20, log=lambda *_: None)
    import_official(d / "release", d / "imported", cfg, {"model": run_config["model"]}, log=lambda *_: None)
    return d, cfg, backbone, drafter


def test_drafter_round_trip_names_dtypes_and_config(drafter_release):
    """Export of a DSpark-stage checkpoint -> import: the backbone and the drafter back within the format
    bounds (FP32 exactly, BF16 as its rounding, FP8 / FP4 within the bound of the stored scales); the drafter's
    tensors under the release's names and dtypes; config.json with the drafter's fields; the stage starts its
    drafter from the import (train/dspark/stage.py `has_drafter`)."""
    from flashtrain.model.dspark import DSpark
    from flashtrain.train.checkpoint import load_weights
    from flashtrain.train.dspark.stage import has_drafter
    from flashtrain.train.official.convert import model_layout

    d, cfg, backbone, drafter = drafter_release
    stored = _stored(d / "release")
    D, r, V = cfg.dim, cfg.dspark_markov_rank, cfg.vocab_size
    expect = {
        "mtp.0.main_proj.weight": (torch.float8_e4m3fn, (D, 3 * D)),
        "mtp.0.main_proj.scale": (torch.float8_e8m0fnu, (D // 32, 3 * D // 32)),
        "mtp.0.main_norm.weight": (torch.bfloat16, (D,)),
        "mtp.1.attn.wq_b.weight": (torch.float8_e4m3fn, (cfg.n_heads * cfg.head_dim, cfg.q_lora_rank)),
        "mtp.1.attn.attn_sink": (torch.float32, (cfg.n_heads,)),
        "mtp.1.attn.wo_a.weight": (torch.bfloat16, tuple(drafter["mtp.1.attn.wo_a.weight"].shape)),
        "mtp.2.ffn.experts.3.w1.weight": (torch.int8, (cfg.moe_inter_dim, D // 2)),
        "mtp.2.ffn.experts.3.w1.scale": (torch.float8_e8m0fnu, (cfg.moe_inter_dim, D // 32)),
        "mtp.2.ffn.shared_experts.w2.weight": (torch.float8_e4m3fn, (D, cfg.moe_inter_dim)),
        "mtp.2.ffn.gate.bias_vl": (torch.float32, (cfg.dspark_n_routed_experts,)),
        "mtp.2.ffn.gate.weight": (torch.bfloat16, (cfg.dspark_n_routed_experts, D)),
        "mtp.0.hc_ffn_base": (torch.float32, (24,)),
        "mtp.2.norm.weight": (torch.bfloat16, (D,)),
        "mtp.2.markov_head.embed.weight": (torch.bfloat16, (V, r)),
        "mtp.2.markov_head.head.weight": (torch.bfloat16, (V, r)),
        "mtp.2.confidence_head.proj.weight": (torch.bfloat16, (1, D + r)),
    }
    for name, (dtype, shape) in expect.items():
        assert stored[name].dtype == dtype and tuple(stored[name].shape) == shape, name
    assert f"mtp.2.ffn.experts.{cfg.dspark_n_routed_experts}.w1.weight" not in stored
    assert not any(n.startswith("mtp.") and n.endswith(("embed.weight", "head.weight")) and "markov" not in n
                   for n in stored)  # the shared embedding and head are the backbone's
    config = json.loads((d / "release" / "config.json").read_text())
    assert {k: config[k] for k in ("n_mtp_layers", "dspark_block_size", "dspark_noise_token_id",
                                   "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
                                   "dspark_n_activated_experts")} == {
        "n_mtp_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 511, "dspark_target_layer_ids": [5, 6, 7],
        "dspark_markov_rank": 8, "dspark_n_routed_experts": 4, "dspark_n_activated_experts": 2}
    assert config["compress_ratios"] == [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0]
    assert config["engram_compressed_vocab_size"] == 401
    # back: every tensor within its format's bound
    shapes, kinds = model_layout(cfg, drafter=True)
    got_backbone = model_template(cfg).materialize("cpu", 5)
    load_weights(d / "imported", got_backbone)
    assert has_drafter(d / "imported")
    got_drafter = DSpark(cfg, seed=9)
    load_weights(d / "imported", got_drafter)
    got = {**got_backbone.state_dict(), **got_drafter.state_dict()}
    want = {**backbone, **drafter}
    assert set(got) == set(want) == set(shapes)
    formats = set()
    for t in official_tensors(shapes, kinds, True):
        w = want[t.source] if t.expert is None else want[t.source][t.expert]
        b = got[t.source] if t.expert is None else got[t.source][t.expert]
        formats.add((t.name.split(".")[0], t.fmt))
        if t.fmt == "fp32":
            assert torch.equal(b, w), t.name
        elif t.fmt == "bf16":
            assert torch.equal(b, w.to(torch.bfloat16).float()), t.name
        else:
            assert ((b - w).abs() <= error_bound(t, w, stored[t.scale_name])).all(), t.name
    assert {f for p, f in formats if p == "mtp"} == {"fp32", "bf16", "fp8", "fp4"}


def test_drafter_import_can_leave_the_drafter_out_and_export_checks_the_backbone(drafter_release, tmp_path):
    from flashtrain.train.dspark.stage import has_drafter
    from flashtrain.train.official.convert import export_official

    d, cfg, _, _ = drafter_release
    report = import_official(d / "release", tmp_path / "bb", cfg, {}, log=lambda *_: None, drafter=False)
    assert not has_drafter(tmp_path / "bb") and "mtp.0.main_proj.weight" in report.unused
    # the backbone the stage names, changed (its manifest gone: the fingerprint is then .metadata's): refused
    (d / "backbone" / "checksums.json").rename(d / "backbone" / "checksums.json.bak")
    try:
        with pytest.raises(OfficialCheckpointError, match="whose files have changed"):
            export_official(d / "stage", tmp_path / "out", log=lambda *_: None)
    finally:
        (d / "backbone" / "checksums.json.bak").rename(d / "backbone" / "checksums.json")


def _public_structure(stored: dict, n_mtp: int) -> torch.nn.Module:
    """A stand-in of the public `Transformer`'s parameter tree (DeepSeek-V4.1-Flash `inference/model.py`,
    revision dba1be0, docs/official_formats.md "The drafter's embedding and head"), as far as state-dict names
    go: a module per dotted prefix and a parameter per released tensor (its stored dtype and shape, as the
    public `Linear` holds FP8 codes and a `scale` parameter), then what `Transformer.__init__` does for each
    drafter block: `self.mtp[-1].embed = self.embed; self.mtp[-1].head = self.head` -- the same modules,
    registered again under `mtp.{i}` (nn.Module.__setattr__), not copies."""
    root = torch.nn.Module()
    for name, t in stored.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
    for i in range(n_mtp):
        block = root.mtp._modules[str(i)]
        block.embed, block.head = root.embed, root.head
    return root


def test_drafter_release_loads_strictly_into_the_public_structure(drafter_release, tmp_path):
    """The release stores the shared embedding and head once (`embed.weight`, `head.weight`), as the public code
    holds them once: in its module tree `mtp.{i}.embed` / `mtp.{i}.head` are the backbone's modules. So
    - torch's strict `load_state_dict` names exactly the 3 x 2 alias names missing (what a user saw);
    - safetensors' `load_model` (the loader of the public generate.py, which knows shared tensors), strict,
      loads the export written as one file (convert.py's model0-mp1.safetensors) with nothing missing or
      unexpected, and the drafter's embed / head are then the backbone's values;
    - a file that also holds copies under the alias names is refused by that strict load (unexpected keys):
      writing them would break it."""
    from safetensors.torch import load_model

    d, cfg, _, _ = drafter_release
    stored = _stored(d / "release")
    aliases = {f"mtp.{i}.{m}.weight" for i in range(3) for m in ("embed", "head")}  # n_mtp_layers = 3
    assert cfg.n_mtp_layers == 3 and not aliases & set(stored)
    public = _public_structure(stored, cfg.n_mtp_layers)
    assert set(public.state_dict()) == set(stored) | aliases
    assert public.mtp._modules["2"].head.weight is public.head.weight  # shared, not copied

    result = public.load_state_dict(stored, strict=False)
    assert sorted(result.missing_keys) == sorted(aliases) and result.unexpected_keys == []
    with pytest.raises(RuntimeError, match="Missing key"):
        _public_structure(stored, cfg.n_mtp_layers).load_state_dict(stored, strict=True)

    single = tmp_path / "model0-mp1.safetensors"
    write_file(single, stored)
    fresh = _public_structure(stored, cfg.n_mtp_layers)
    missing, unexpected = load_model(fresh, single, strict=True)
    assert not missing and not unexpected
    for i in range(3):
        block = fresh.mtp._modules[str(i)]
        assert torch.equal(block.embed.weight, stored["embed.weight"])
        assert torch.equal(block.head.weight, stored["head.weight"])
    assert torch.equal(fresh.mtp._modules["0"].main_proj.scale.view(torch.uint8),
                       stored["mtp.0.main_proj.scale"].view(torch.uint8))  # the rest loaded too

    copies = dict(stored, **{a: stored[a.split(".", 2)[2]].clone() for a in aliases})
    write_file(tmp_path / "with_copies.safetensors", copies)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        load_model(_public_structure(stored, cfg.n_mtp_layers), tmp_path / "with_copies.safetensors", strict=True)
