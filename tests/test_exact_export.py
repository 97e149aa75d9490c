"""An export is exactly the model that was trained (issue 35; docs/official_formats.md "Exact export"): a
flash_tiny run trained with the weight switches on (`model.qat.experts_fp4`, `weights_fp8`, `weights_bf16`),
exported in the release's FP8 / FP4 layout by launch/export_official.py and read back by
launch/import_official.py, gives back, tensor for tensor and bit for bit, the weights its forward computed
with (the master weights through model/formats.py `as_trained`, whose grids tests/test_formats.py checks by
hand); and launch/evaluate.py scores the run's checkpoint and the import identically, record for record.

The launch tools run in this process (as their command lines run them), the training run in its own."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
import warm_launch
from layer_plans import FOUR_LAYERS

from flashtrain.model.formats import Stored, as_trained, weight_formats
from flashtrain.parallel.construct import model_template
from flashtrain.train.checkpoint import load_weights
from flashtrain.train.config import compose, model_config

ROOT = Path(__file__).resolve().parent.parent
# flash_tiny's layer roles on four layers, Engram heads of 32 channels (the FP8 Engram format's block)
MODEL = ["+exp=flash_tiny", *FOUR_LAYERS, "model.engram_head_dim=32", "model.qat.experts_fp4=true",
         "model.qat.weights_fp8=true", "model.qat.weights_bf16=true"]
EVAL_TOKENS = "512"


def run_tool(script: str, *argv: str) -> None:
    """launch/SCRIPT in this process, as its command line runs it; it must exit 0 (or return)."""
    old = sys.argv
    sys.argv = [script, *argv]
    try:
        runpy.run_path(str(ROOT / "launch" / script), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), f"{script} exited with {e.code}"
    finally:
        sys.argv = old


@pytest.mark.slow
def test_the_export_of_a_qat_run_is_the_model_it_trained(tmp_path, capsys):
    corpus = [f"data.corpus_dir={tmp_path / 'corpus'}", "data.corpus_text_bytes=300000", "data.corpus_mm_docs=100",
              "data.corpus_shards=2"]
    run = tmp_path / "run"
    out = warm_launch.run([sys.executable, str(ROOT / "launch" / "pretrain.py"), *MODEL, *corpus,
                            f"hydra.run.dir={run}", "logging.wandb.mode=disabled", "logging.progress=false",
                            "logging.heatmap_interval=0", "train.max_steps=1", "train.eval.interval=0"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = run / "checkpoints" / "step_00000001"
    run_tool("export_official.py", str(ckpt), str(tmp_path / "release"))
    run_tool("import_official.py", str(tmp_path / "release"), str(tmp_path / "import"), *MODEL, *corpus)

    cfg = model_config(compose([*MODEL, *corpus]))
    trained, imported = (model_template(cfg).materialize("cpu", 1) for _ in range(2))
    load_weights(ckpt, trained)
    load_weights(tmp_path / "import", imported)
    formats, back = weight_formats(trained), dict(imported.named_parameters())
    moved = dict.fromkeys(Stored, 0)
    with torch.no_grad():
        for name, master in trained.named_parameters():
            used = as_trained(master, formats[name], cfg.qat)  # what the forward computed with
            assert torch.equal(back[name], used), name
            moved[formats[name]] += not torch.equal(used, master)
    assert all(moved[f] for f in (Stored.FP8, Stored.FP4, Stored.FP8_ROWS, Stored.BF16)), moved  # off their grids

    capsys.readouterr()
    records = []
    for path, extra in ((ckpt, []), (tmp_path / "import", [*MODEL, *corpus])):
        run_tool("evaluate.py", str(path), "--json", "--tokens", EVAL_TOKENS, *extra)
        records.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    ran, imp = records
    assert ran["step"] == 1 and imp["step"] == 0 and ran["tokens"] > 0
    assert {k: v for k, v in ran.items() if k != "step"} == {k: v for k, v in imp.items() if k != "step"}
