"""ModelConfig validation, the LayerPlan role table (V41_SPEC §2) and launch/plan.py (published sizes)."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import warm_launch

from flashtrain.config.errors import ConfigError
from flashtrain.config.typed import typed_config
from flashtrain.model.config import ModelConfig
from flashtrain.model.layer_plan import layer_plan
from flashtrain.train.config import compose, model_config

ROOT = Path(__file__).resolve().parent.parent

# V41_SPEC §2, written out literally
SPEC_ROLES = {0: "swa", 1: "swa", 2: "full", 8: "full", 14: "full", 20: "full",
              24: "reindex", 28: "reindex", 32: "reindex", 36: "reindex"}


def spec_role(l: int) -> str:
    return SPEC_ROLES.get(l, "reuse")


def test_flash_plan_matches_spec(flash_cfg):
    plan = layer_plan(flash_cfg)
    assert [r.role.value for r in plan] == [spec_role(l) for l in range(40)]
    assert [r.compress_ratio for r in plan] == [0, 0] + [2] * 18 + [1] * 20
    for r in plan[2:]:
        assert r.kv_source == max(s for s in (2, 8, 14, 20) if s <= r.id)
        assert r.index_source == max(s for s in (2, 8, 14, 20, 24, 28, 32, 36) if s <= r.id)
    assert [r.id for r in plan if r.is_candidate_source] == [20]
    assert [r.id for r in plan if r.uses_candidates] == [24, 28, 32, 36]
    assert [r.id for r in plan if r.engram] == [1, 14]
    assert plan[0].kv_source is None and plan[1].index_source is None


@pytest.mark.parametrize("exp", ["flash_small", "flash_tiny"])
def test_small_exps_keep_the_role_pattern(exp, flash_cfg):
    small = model_config(compose([f"+exp={exp}"]))
    assert [r.as_dict() for r in layer_plan(small)] == [r.as_dict() for r in layer_plan(flash_cfg)]
    assert small.dim < flash_cfg.dim


def test_candidate_restriction_switch(flash_cfg):
    off = dataclasses.replace(flash_cfg, candidate_restriction=False)
    assert not any(r.uses_candidates for r in layer_plan(off))


@pytest.mark.parametrize("change, field", [
    (dict(kv_source_layers=[1, 8, 14, 20]), "kv_source_layers"),  # layer 1 has ratio 0
    (dict(engram_layer_ids=[1, 40]), "engram_layer_ids"),
    (dict(o_groups=3), "o_groups"),
    (dict(compress_ratios=[0] * 39), "compress_ratios"),
    (dict(candidate_source_layer=21), "candidate_source_layer"),
    (dict(rope_head_dim=600), "rope_head_dim"),
    (dict(n_activated_experts=400), "n_activated_experts"),
    (dict(index_source_layers=[8, 14, 20]), "index_source_layers"),
])
def test_validation_names_field_and_value(flash_cfg, change, field):
    bad = dataclasses.replace(flash_cfg, **change)
    with pytest.raises(ConfigError) as e:
        bad.validate()
    assert f"model.{field}=" in str(e.value)


def test_kv_sources_after_the_candidate_source_are_rejected(flash_cfg):
    """Divergence (b) of issue 16. With the candidate source at layer 14 and kv source 20 after it, the public
    code would restrict the indexers of layers 20 (Full), 24, 28, 32 and 36 to layer 14's pool (its rule:
    every indexer after the source, never cleared), flashtrain only the Reindex layers reading layer 14's
    KV (here: none). Such a config is refused with the fix; without restriction it is accepted."""
    bad = dataclasses.replace(flash_cfg, candidate_source_layer=14)
    with pytest.raises(ConfigError, match=r"model.candidate_source_layer=14: kv source layer\(s\) \[20\] come after"
                                          r".*candidate_source_layer=20.*candidate_restriction=false"):
        bad.validate()
    dataclasses.replace(flash_cfg, candidate_source_layer=14, candidate_restriction=False).validate()
    # the published layout (source = last kv source) is the case where both rules agree: layers 24..36 only
    assert [r.id for r in layer_plan(flash_cfg) if r.uses_candidates] == [24, 28, 32, 36]


def test_unknown_field_rejected():
    with pytest.raises(ConfigError, match="unknown field.*'dimm'"):
        typed_config(ModelConfig, {"dimm": 5}, "model")


def _plan(*args):
    out = warm_launch.run([sys.executable, str(ROOT / "launch" / "plan.py"), *args], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    return out


def test_plan_reports_published_sizes():
    out = _plan("+exp=flash", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert abs(r["params_backbone"] / 552e9 - 1) < 0.01
    assert r["params_engram"] == 256 * (384_006_168 + 384_016_682)
    assert r["params_total"] == r["params_backbone"] + r["params_engram"]
    assert abs(r["params_activated_per_token"] / 16e9 - 1) < 0.05
    assert [l["role"] for l in r["layers"]] == [spec_role(l) for l in range(40)]
    for l in r["layers"]:
        assert {"id", "role", "compress_ratio", "kv_source", "index_source", "engram", "params"} <= set(l)
    assert r["params_backbone"] == r["params_text"] + r["params_vision"]
    opt = r["optimizers"]
    assert set(opt) == {"muon", "sinkhorn", "adamw"}
    assert sum(o["params"] for o in opt.values()) == r["params_total"]
    assert opt["sinkhorn"]["params"] == r["params_engram"] + 2 * 129280 * 5120  # tables + embedding + head
    assert opt["sinkhorn"]["tensors"] == 4
    assert abs(r["params_vit"] / 0.41e9 - 1) < 0.02  # "the ViT is about 0.41B"
    assert sum(l["params"] for l in r["layers"]) + r["params_embedding"] + r["params_head"] + 5120 \
        + r["params_vision"] == r["params_total"]


@pytest.mark.slow
def test_plan_human_output_and_bad_config():
    out = _plan("+exp=flash_tiny")
    assert out.returncode == 0 and "reindex" in out.stdout and "Engram tables" in out.stdout
    bad = _plan("+exp=flash_tiny", "model.o_groups=3")
    assert bad.returncode == 2 and "model.o_groups=3" in bad.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q tests" in readme and "python -m pytest -q tests" in ci
    assert "pip install torch==2.13.0 -e '.[test]'" in readme and "pip install -q torch==2.13.0 -e '.[test]'" in ci
    assert "torchrun --standalone --nproc_per_node=2 launch/pretrain.py +exp=flash_small" in readme
