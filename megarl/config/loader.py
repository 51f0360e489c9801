"""YAML file + dotted command-line overrides -> a type-checked RunConfig.

    cfg = load_config("configs/quickstart.yaml", ["actor.optim.lr=3e-4", "rollout.n=8"])
    cfg = load_config("quickstart")  # a shipped config by name, from any directory (config/shipped.py)

Override values are parsed as YAML scalars (`true`, `null`, `8`, `[1, 2]`). Every value is
checked against its dataclass field type (Optional, Literal, nested sections); a wrong type
or an unknown key raises ConfigError naming the full dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megarl.config import shipped
from megarl.config.schema import RunConfig


class ConfigError(ValueError):
    """A configuration value is wrong; str() is one line that starts with the dotted key."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = " ".join(message.split())  # one line, whatever the caller passed
        super().__init__(self.message if self.message.startswith(key) else f"{key}: {self.message}")


# ------------------------------------------------------------------ schema introspection
@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a config dataclass (the schema uses postponed annotations)."""
    return typing.get_type_hints(cls)


def all_dotted_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the schema as a dotted path, e.g. 'actor.optim.lr'."""
    keys = []
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += all_dotted_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_describe(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


# keys that were renamed: an old config is told the new name
_RENAMED = {"algorithm.name": "algorithm.adv_estimator"}
# keys that were replaced by another form: an old config is told what to write instead
_REPLACED = {
    "trainer.tensorboard": (
        "trainer.tensorboard was replaced by trainer.loggers; for tensorboard events list it there, "
        "e.g. trainer.loggers=[console,jsonl,tensorboard] (or drop the key: the default is [console,jsonl])"
    ),
}


def _unknown_key(key: str, known_here: list[str]) -> ConfigError:
    if key in _REPLACED:
        return ConfigError(key, _REPLACED[key])
    leaf = key.rsplit(".", 1)[-1]
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    close = [section + k for k in difflib.get_close_matches(leaf, known_here, n=3, cutoff=0.6)]
    close += [k for k in all_dotted_keys() if k.rsplit(".", 1)[-1] == leaf and k not in close]
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    if key in _RENAMED:
        hint = f"; it was renamed to {_RENAMED[key]}"
    return ConfigError(key, f"{key} is not a config key{hint} (known here: {', '.join(known_here)})")


# ------------------------------------------------------------------ values
def coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` converted to field type `tp`, or ConfigError naming `key`.

    Conversions are deliberately few: ints widen to floats; numeric strings are accepted for
    floats (PyYAML reads `1e-6` as a string); numbers are accepted for strings.
    """
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        members = typing.get_args(tp)
        if value is None and type(None) in members:
            return None
        for member in members:
            if member is type(None):
                continue
            try:
                return coerce(value, member, key)
            except ConfigError:
                continue
        raise ConfigError(key, f"{key}={value!r} is not a valid {_describe(tp)}")
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is not bool:
            return value
        raise ConfigError(key, f"{key}={value!r} must be one of {_describe(tp)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if value is None:  # an empty YAML section ("ref:") means all defaults
            return tp()
        if not isinstance(value, dict):
            raise ConfigError(key, f"{key} is a section; give a mapping, not {value!r}")
        return from_dict(tp, value, key + ".")
    if origin is list:  # list[X]: a YAML sequence, each item an X (named key[i] when it is not)
        if not isinstance(value, list):
            raise ConfigError(key, f"{key}={value!r} is not a valid {_describe(tp)}")
        return [coerce(item, typing.get_args(tp)[0], f"{key}[{i}]") for i, item in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise TypeError(f"config schema field {key} has unsupported type {tp!r}")
    raise ConfigError(key, f"{key}={value!r} is not a valid {_describe(tp)}")


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build config dataclass `cls` from a nested dict; missing keys keep their defaults."""
    types_here = field_types(cls)
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in types_here:
            raise _unknown_key(key, list(types_here))
        kwargs[name] = coerce(value, types_here[name], key)
    return cls(**kwargs)


def check_types(obj: Any, prefix: str = "") -> None:
    """Re-check a config built in code (dataclasses do not enforce annotations)."""
    for name, tp in field_types(type(obj)).items():
        value = getattr(obj, name)
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, tp):
                raise ConfigError(key, f"{key} must be a {tp.__name__}, got {value!r}")
            check_types(value, key + ".")
            continue
        coerced = coerce(value, tp, key)
        if type(coerced) is not type(value) and not (isinstance(value, int) and tp is float):
            raise ConfigError(key, f"{key}={value!r} is not a valid {_describe(tp)}")


# ------------------------------------------------------------------ overrides and files
def parse_override(text: str) -> tuple[list[str], Any]:
    """'actor.optim.lr=3e-4' -> (['actor', 'optim', 'lr'], '3e-4' parsed as a YAML scalar)."""
    if "=" not in text:
        raise ConfigError(text, f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(key or text, f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(key, f"{key}: value {raw!r} is not valid YAML ({e})") from None
    return key.split("."), value


def apply_override(data: dict, path: list[str], value: Any) -> None:
    """Set data[path[0]]...[path[-1]] = value, creating sections that the file left out.

    The path is checked against the schema first, so a typo is reported by its dotted name.
    """
    cls: Any = RunConfig
    for i, part in enumerate(path):
        dotted = ".".join(path[: i + 1])
        types_here = field_types(cls)
        if part not in types_here:
            raise _unknown_key(dotted, list(types_here))
        cls = types_here[part]
        if i < len(path) - 1 and not dataclasses.is_dataclass(cls):
            raise ConfigError(dotted, f"{dotted} is a value, not a section; cannot set {'.'.join(path)}")
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            dotted = ".".join(path[: i + 1])
            raise ConfigError(dotted, f"{dotted} is a section, but the file sets it to {child!r}")
        node = child
    if isinstance(value, dict) and isinstance(node.get(path[-1]), dict):
        _deep_merge(node[path[-1]], value)  # section=value overrides only the keys it names
    else:
        node[path[-1]] = value


def _deep_merge(into: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key written twice in one mapping (PyYAML keeps the last silently,
    so a stray `model:` line would replace a whole section without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", f"config file {p} does not exist")
    try:
        data = yaml.load(p.read_text(), Loader=_UniqueKeyLoader) or {}  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError("config", f"config file {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"config file {p} must hold a mapping of sections")
    return data


def read_config_file(path: str | Path) -> dict:
    """A YAML file, or a shipped config by its bare name (`quickstart`), whose `configs/...` paths
    then resolve from any working directory (megarl/config/shipped.py)."""
    p = Path(path)
    if shipped.is_config_name(str(path)):
        found = shipped.find_shipped(str(path))
        if found is None:
            names = ", ".join(shipped.shipped_names())
            raise ConfigError(
                "config",
                f"{path!r} is neither a file nor a shipped config; give a path to a YAML file or one of the "
                f"shipped names: {names}",
            )
        p = found
    data = read_yaml(p)
    return shipped.anchor_shipped_paths(data) if shipped.is_shipped(p) else data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> RunConfig:
    """Schema defaults <- YAML file or shipped config (if any) <- dotted overrides, type-checked."""
    data = read_config_file(path) if path is not None else {}
    for text in overrides:
        apply_override(data, *parse_override(text))
    return from_dict(RunConfig, data)


# ------------------------------------------------------------------ output
def to_dict(cfg: Any) -> dict:
    """Plain nested dict (for logging, checkpoints and `from_dict`)."""
    return dataclasses.asdict(cfg)


def dump(cfg: Any) -> str:
    """YAML text that load_config reads back into an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
