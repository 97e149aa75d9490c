"""The one typed-config helper (DESIGN.md "Config"): a Hydra group, as a plain mapping, becomes the package's
config dataclass. Every package's config is filled through `typed_config`; nothing deeper reads the raw
DictConfig.

- A key the dataclass does not define is an error naming the key, the nearest valid one and the file that
  defines the fields (a typo in a yaml key or an override must not be a silently ignored setting).
- A field whose default is a nested config dataclass (`field(default_factory=CheckpointConfig)`) is built
  from its sub-mapping the same way, with its dotted name in messages; `null` gives its defaults.
- Sequences become lists (OmegaConf's ListConfig, tuples).
- `renamed_fields` on the class (`{"old": "new"}`) accepts a deprecated key (null: not given) for its new name, with a
  warning; the new key also set, to another value than its default, is an error.
- `removed_fields` on the class (`{"old": "why, and what to set instead"}`) refuses a removed key with its
  reason.
- Then the dataclass's own `validate()`, when it has one, checks the values (and may normalise them).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping, TypeVar

from flashtrain.config.errors import ConfigError

T = TypeVar("T")
log = logging.getLogger(__name__)


def defined_in(cls: type) -> str:
    """`train/stability/spike.py (SpikeConfig)`: where a config class's fields are written, for messages."""
    module = sys.modules.get(cls.__module__)
    path = Path(getattr(module, "__file__", "") or "")
    parts = cls.__module__.split(".")
    rel = "/".join(parts[1:-1] + [path.name]) if parts[0] == "flashtrain" and path.name else cls.__module__
    return f"{rel} ({cls.__name__})"


def nearest(name: str, choices) -> str | None:
    """The closest valid spelling of a mistyped key or option, if one is close."""
    found = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_keys_error(where: str, unknown, known, cls: type | None = None) -> ConfigError:
    hints = [f"{k!r} (did you mean {n!r}?)" if (n := nearest(k, known)) else repr(k) for k in unknown]
    fields = f"; the known fields are in {defined_in(cls)}" if cls is not None else f"; known: {sorted(known)}"
    return ConfigError(f"{where} has unknown field(s) {', '.join(hints)}{fields} (check the spelling in conf/)")


def _nested(f: dataclasses.Field) -> type | None:
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def typed_config(cls: type[T], values: Mapping[str, Any] | None, where: str) -> T:
    """`cls` filled from `values` (a plain mapping, e.g. `OmegaConf.to_container(cfg.train)`), `where` being
    its dotted name in the configuration (`train`, `train.spike`, `model.qat`)."""
    if isinstance(values, cls):
        return values
    values = dict(values or {})
    for old, new in getattr(cls, "renamed_fields", {}).items():
        value = values.pop(old, None)
        if value is None:
            continue
        default = {f.name: f.default for f in dataclasses.fields(cls)}.get(new)
        if values.get(new, default) not in (value, default):
            raise ConfigError(f"{where}.{old}={value!r} and {where}.{new}={values[new]!r}: set only {where}.{new} "
                              f"({where}.{old} is its deprecated name)")
        warnings.warn(f"{where}.{old}={value} is deprecated and will be removed in the next release: use "
                      f"{where}.{new}={value}", DeprecationWarning, stacklevel=2)
        log.warning("%s.%s is deprecated: use %s.%s=%s", where, old, where, new, value)
        values[new] = value
    for name, why in getattr(cls, "removed_fields", {}).items():
        if name in values:
            raise ConfigError(f"{where}.{name}={values[name]!r}: {why}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in values if k not in fields]
    if unknown:
        raise unknown_keys_error(where, unknown, fields, cls)
    kwargs = {}
    for name, value in values.items():
        sub = _nested(fields[name])
        if sub is not None and (value is None or isinstance(value, Mapping)):
            kwargs[name] = typed_config(sub, value, f"{where}.{name}")
        else:
            kwargs[name] = _plain(value)
    out = cls(**kwargs)
    if hasattr(out, "validate"):
        out.validate()
    return out
