"""The one typed-config helper (conf/typed.py) and the one error family (conf/errors.py)."""

from dataclasses import dataclass, field

import pytest

from flashtrain.config.errors import CheckpointError, ConfigError, DataError, FlashtrainError
from flashtrain.config.typed import typed_config
from flashtrain.data.config import DataConfigError
from flashtrain.train.config import TrainConfig


@dataclass
class Inner:
    size: int = 1
    names: list = field(default_factory=list)

    def validate(self):
        if self.size < 1:
            raise ConfigError(f"outer.inner.size={self.size}: must be >= 1")


@dataclass
class Outer:
    rate: float = 0.5
    mode: str = "a"
    inner: Inner = field(default_factory=Inner)
    renamed_fields = {"old_mode": "mode"}
    removed_fields = {"lr": "removed; set schedule.peak_lr"}


def test_nested_fields_and_sequences():
    out = typed_config(Outer, {"rate": 2.0, "inner": {"size": 3, "names": ("x", "y")}}, "outer")
    assert out == Outer(rate=2.0, inner=Inner(size=3, names=["x", "y"]))
    assert typed_config(Outer, {"inner": None}, "outer").inner == Inner()  # null: the nested defaults
    assert typed_config(Outer, None, "outer") == Outer()


def test_unknown_keys_name_the_nearest_field_and_the_file():
    with pytest.raises(ConfigError, match=r"outer has unknown field\(s\) 'rat' \(did you mean 'rate'\?\).*"
                                          r"tests/test_typed_config.py \(Outer\)|outer has unknown field\(s\) 'rat' "
                                          r"\(did you mean 'rate'\?\)"):
        typed_config(Outer, {"rat": 1}, "outer")
    with pytest.raises(ConfigError, match=r"outer.inner has unknown field\(s\) 'sizes' \(did you mean 'size'\?\)"):
        typed_config(Outer, {"inner": {"sizes": 1}}, "outer")
    with pytest.raises(ConfigError, match=r"'zzz'(?! \(did)"):  # nothing close: no suggestion
        typed_config(Outer, {"zzz": 1}, "outer")


def test_validate_runs_on_nested_configs():
    with pytest.raises(ConfigError, match="outer.inner.size=0"):
        typed_config(Outer, {"inner": {"size": 0}}, "outer")


def test_renamed_and_removed_fields():
    with pytest.warns(DeprecationWarning, match="use outer.mode=b"):
        assert typed_config(Outer, {"old_mode": "b"}, "outer").mode == "b"
    assert typed_config(Outer, {"old_mode": None, "mode": "c"}, "outer").mode == "c"  # null: not given
    with pytest.raises(ConfigError, match="set only outer.mode"):
        typed_config(Outer, {"old_mode": "b", "mode": "c"}, "outer")
    with pytest.raises(ConfigError, match="outer.lr=0.1: removed; set schedule.peak_lr"):
        typed_config(Outer, {"lr": 0.1}, "outer")


def test_the_train_config_is_filled_through_it():
    t = typed_config(TrainConfig, {"checkpoint": {"keep": 5}, "spike": {"action": "skip"}}, "train")
    assert t.checkpoint.keep == 5 and t.spike.action == "skip" and t.checkpoint.interval == 50
    with pytest.raises(ConfigError, match=r"train.checkpoint has unknown field\(s\) 'kep' \(did you mean 'keep'\?\)"):
        typed_config(TrainConfig, {"checkpoint": {"kep": 5}}, "train")


def test_one_error_family():
    for cls in (ConfigError, DataError, CheckpointError, DataConfigError):
        assert issubclass(cls, FlashtrainError)
