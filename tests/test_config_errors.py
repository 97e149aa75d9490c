"""Hydra-level mistakes as one line naming the nearest valid key or option (issue 30 item 12;
train/config.py `compose`), in process: the launch tests run the same mistakes through launch/pretrain.py."""

import pytest

from flashtrain.config.errors import ConfigError
from flashtrain.train.config import compose

CASES = {
    "+foo=bar": "+foo=bar: 'foo' is not a config group or key; the top-level keys are data, logging, model, optim, "
                "parallel, plan, run_name, schedule, train",
    "+trian.max_steps=3": "+trian.max_steps=3: 'trian' is not a config group or key (did you mean 'train'?)",
    "trian.max_steps=3": "trian.max_steps=3: 'trian' is not a config group or key (did you mean train?)",
    "train.max_step=3": "train.max_step=3: train has no key 'max_step' (did you mean train.max_steps?)",
    "train.checkpoint.kep=3": "train.checkpoint.kep=3: train.checkpoint has no key 'kep' (did you mean "
                              "train.checkpoint.keep?)",
    "+exp=flash_smal": "+exp=flash_smal: there is no exp 'flash_smal' (did you mean +exp=flash_small?); the exp "
                       "options are flash, flash_2048gpu, flash_2048gpu_1m, flash_dspark, flash_node, flash_small, "
                       "flash_small_dspark, flash_tiny, flash_tiny_dspark",
    "model=flash_tin": "model=flash_tin: there is no model 'flash_tin' (did you mean model=flash_tiny?)",
    "exp=flash_tiny": "exp=flash_tiny: exp is not selected by default, so it is added with a +: +exp=flash_tiny",
    "train.max_steps": "cannot parse the override 'train.max_steps'",
}


@pytest.mark.parametrize("override", list(CASES))
def test_a_hydra_mistake_is_one_line_naming_the_nearest(override):
    with pytest.raises(ConfigError) as e:
        compose(["+exp=flash_tiny", override] if not override.startswith(("+exp", "exp")) else [override])
    assert "\n" not in str(e.value) and str(e.value).startswith(CASES[override]), str(e.value)


def test_valid_overrides_still_compose():
    cfg = compose(["+exp=flash_tiny", "train.max_steps=3", "data.num_workers=1", "hydra.run.dir=/tmp/x"])
    assert cfg.train.max_steps == 3 and set(cfg) == {"model", "optim", "data", "schedule", "train", "logging",
                                                      "parallel", "plan", "run_name"}


def test_a_config_composed_outside_hydra_resolves_whole():
    """compose() outside a Hydra app (launch/evaluate.py on an import, the benches): run_name's default
    interpolates the Hydra runtime, which is not running; it resolves to the chosen model."""
    from flashtrain.train.build import read_configs
    from flashtrain.train.config import compose

    assert read_configs(compose(["+exp=flash_tiny"])).cfg_dict["run_name"] == "flash_tiny"
    assert compose(["+exp=flash_tiny", "run_name=mine"]).run_name == "mine"
