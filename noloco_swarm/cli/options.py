"""Fill the one config tree from a config file, `NOLOCO_*` environment variables and flags.

Precedence, lowest first: the preset's and method's defaults, a TOML config file (`--config`),
`NOLOCO_SET` (semicolon-separated `key=value`), then `--set key=value` flags and the named flags.
Keys are dotted paths into `RunConfig`: `outer.inner_steps`, `inner.lr`, `model.seq_len`,
`num_replicas`. Every value is checked by the config's own validation, whose errors say what to
change.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from noloco_swarm.data.config import DataConfig
from noloco_swarm.model.presets import ModelConfig
from noloco_swarm.protocol.config import InnerConfig, OuterConfig
from noloco_swarm.train.config import NetworkConfig, PeerConfig, RunConfig

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "inner": InnerConfig,
    "outer": OuterConfig,
    "peer": PeerConfig,
    "network": NetworkConfig,
}
TOP_LEVEL = {f.name for f in dataclasses.fields(RunConfig)} - set(SECTIONS)


class ConfigError(ValueError):
    """A config key or value the user gave is wrong; the message says what to change."""


def valid_keys() -> list[str]:
    keys = sorted(TOP_LEVEL)
    for section, cls in SECTIONS.items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _field_type(key: str) -> Any:
    section, _, name = key.rpartition(".")
    cls = SECTIONS.get(section) if section else RunConfig
    hints = typing.get_type_hints(cls) if cls else {}
    if name not in hints or (not section and name in SECTIONS):
        raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid_keys())}")
    return hints[name]


def coerce(key: str, value: Any, hint: Any = None) -> Any:
    """Turn a string (from a flag or the environment) or a TOML value into the field's type."""
    hint = _field_type(key) if hint is None else hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return coerce(key, value, next(a for a in args if a is not type(None)))
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        items = [i for i in items if i != ""] if isinstance(value, str) else items
        item_types = [args[0]] * len(items) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(item_types) != len(items):
            raise ConfigError(f"{key} needs {len(item_types)} comma-separated values, got {value!r}")
        return tuple(coerce(key, i, t) for i, t in zip(items, item_types, strict=True))
    if origin is typing.Literal:
        hint = str
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if hint is int and isinstance(value, str):
            return int(float(value)) if "e" in value.lower() else int(value)
        return hint(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: cannot read {value!r} as {getattr(hint, '__name__', hint)}") from e


def parse_assignments(text: str, sep: str = ";") -> dict[str, str]:
    """`key=value;key=value` into a dict (the format of NOLOCO_SET)."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(sep))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def load_file(path: str | Path) -> dict[str, Any]:
    """A TOML file's keys flattened to dotted keys; `preset` and `method` may appear at the top."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def build_config(
    preset: str = "tiny",
    method: str = "noloco",
    *,
    config_file: str | Path | None = None,
    assignments: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> RunConfig:
    """Defaults < config file < NOLOCO_SET < assignments (flags). Returns a validated RunConfig."""
    env = dict(os.environ) if env is None else env
    merged: dict[str, Any] = {}
    if config_file:
        merged.update(load_file(config_file))
    merged.update(parse_assignments(env.get("NOLOCO_SET", "")))
    merged.update(assignments or {})
    preset = str(merged.pop("preset", preset))
    method = str(merged.pop("method", method))
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    top: dict[str, Any] = {}
    for key, value in merged.items():
        typed = coerce(key, value)
        section, _, name = key.rpartition(".")
        (sections[section] if section else top)[name] = typed
    try:
        return RunConfig.create(preset, method, **sections, **top)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e
