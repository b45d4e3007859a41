"""Fill the one config tree from layered sources: defaults < file < NOLOCO_SET < --set < flags.

Keys are dotted paths into `RunConfig` (`outer.inner_steps`, `peer.step_timeout`,
`network.initial_peers`, `num_replicas`), plus `preset` and `method`, which choose the model preset
and the method's paper defaults (`model.name` and `outer.method` are the same two keys). Every
source names keys the same way; a higher layer wins key by key, and a key that no layer sets
keeps its default. Values are checked by the config's own validation, whose errors say what to
change; a value that cannot be read names its key, its source and what to give instead. The CLI
(cli/flags.py) adds its named flags as the top layer; a bench calls `build_config` or `resolve`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noloco_swarm.data.config import DataConfig
from noloco_swarm.model.presets import ModelConfig
from noloco_swarm.protocol.config import InnerConfig, OuterConfig, WireConfig
from noloco_swarm.train.config import REMOVED_KEYS, NetworkConfig, PeerConfig, RunConfig, removed_key

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "inner": InnerConfig,
    "outer": OuterConfig,
    "wire": WireConfig,
    "peer": PeerConfig,
    "network": NetworkConfig,
}
TOP_LEVEL = [f.name for f in dataclasses.fields(RunConfig) if f.name not in SECTIONS]
# `preset` and `method` pick whole sets of defaults; the tree stores them as model.name and outer.method.
CHOICES = {"preset": "model.name", "method": "outer.method"}
ALIASES = {tree_key: key for key, tree_key in CHOICES.items()}
# Optional keys read these words as None; peer.stage also reads "auto" (the least-served stage).
# For peer.exchange_max_mbit None is "auto" (a cap from the measured link), so only that word
# reads as None there: "none" would read as "no cap", which is 0.
NONE_WORDS = ("none", "null", "")
AUTO_KEYS = ("peer.stage",)
AUTO_ONLY = ("peer.exchange_max_mbit",)


class ConfigError(ValueError):
    """A config key or value the user gave is wrong; the message says what to change."""


class UnknownKey(ConfigError):
    """A key that is no config key (the CLI adds where the keys are listed)."""


def valid_keys() -> list[str]:
    keys = [*CHOICES, *sorted(TOP_LEVEL)]
    for section, cls in SECTIONS.items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def field_type(key: str) -> Any:
    """The type hint of a key's field (`str` for preset and method)."""
    if key in CHOICES:
        return str
    section, _, name = key.rpartition(".")
    cls = SECTIONS.get(section) if section else RunConfig
    hints = typing.get_type_hints(cls) if cls else {}
    if key in REMOVED_KEYS:
        raise ConfigError(removed_key(key))
    if name not in hints or (not section and name in SECTIONS):
        close = difflib.get_close_matches(key, valid_keys(), n=3, cutoff=0.8)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise UnknownKey(f"unknown config key {key!r}{hint}")
    return hints[name]


_WHAT_TO_GIVE = {
    bool: "true or false",
    int: "a whole number",
    float: "a number",
    str: "a string",
}


def coerce(key: str, value: Any, hint: Any = None) -> Any:
    """Turn a string (from a flag or the environment) or a TOML/JSON value into the field's type."""
    hint = field_type(key) if hint is None else hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        words = ("auto",) if key in AUTO_ONLY else NONE_WORDS + (("auto",) if key in AUTO_KEYS else ())
        if value is None or (isinstance(value, str) and value.strip().lower() in words):
            return None
        return coerce(key, value, next(a for a in args if a is not type(None)))
    if origin is tuple:
        if not isinstance(value, str | list | tuple):  # e.g. a TOML number or table
            raise ConfigError(f"{key} needs a list or comma-separated values, got {value!r}")
        items = [i.strip() for i in value.split(",") if i.strip()] if isinstance(value, str) else list(value)
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
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            if isinstance(value, str) and "e" in value.lower():
                number = float(value)
                if not number.is_integer():
                    raise ValueError(value)
                return int(number)
        if hint is float and isinstance(value, bool):
            raise ValueError(value)
        return hint(value)
    except (TypeError, ValueError) as e:
        name = getattr(hint, "__name__", str(hint))
        what = _WHAT_TO_GIVE.get(hint, f"a {name}")
        raise ConfigError(f"{key}: cannot read {value!r} as {name}; give {what}") from e


def parse_assignments(text: str, sep: str = ";") -> dict[str, str]:
    """`key=value;key=value` into a dict (the format of NOLOCO_SET and of each --set)."""
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
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:  # TOML is UTF-8 text
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


@dataclass(frozen=True)
class SwarmFile:
    """Where a public swarm is found, as its organiser ships it: a small TOML file of

        initial_peers = ["/ip4/203.0.113.7/tcp/31337/p2p/Qm...", ...]   # any live peers (required)
        run = "my-run"                                                     # optional: the run to join

    that `network.initial_peers` may name instead of (or beside) multiaddrs."""

    initial_peers: tuple[str, ...]
    run: str | None = None


SWARM_FILE_KEYS = ("initial_peers", "run")


def is_swarm_file(entry: str) -> bool:
    """Whether an entry of network.initial_peers names a swarm file rather than a multiaddr: a
    path that does not start with /, ends in .toml, or is a file (no multiaddr is one)."""
    return not entry.startswith("/") or entry.endswith(".toml") or Path(entry).expanduser().is_file()


def load_swarm_file(path: str | Path) -> SwarmFile:
    """The swarm file at `path`; ConfigError naming the file and what is wrong with it."""
    try:
        data = tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(
            f"network.initial_peers names {str(path)!r}, which is no multiaddr (/ip4/..., /dns/...) "
            f"and no readable swarm file: {e}"
        ) from e
    unknown = sorted(set(data) - set(SWARM_FILE_KEYS))
    if unknown:
        raise ConfigError(
            f"swarm file {path}: unknown keys {unknown}; a swarm file has {list(SWARM_FILE_KEYS)}"
        )
    peers, run = data.get("initial_peers"), data.get("run")
    if (
        not isinstance(peers, list)
        or not peers
        or not all(isinstance(p, str) and p.startswith("/") for p in peers)
    ):
        raise ConfigError(
            f"swarm file {path}: initial_peers must be a non-empty list of multiaddrs "
            '(e.g. initial_peers = ["/ip4/203.0.113.7/tcp/31337/p2p/Qm..."])'
        )
    if run is not None:
        from noloco_swarm.protocol.codec import check_run_id

        try:
            check_run_id(run if isinstance(run, str) else "")
        except ValueError as e:
            raise ConfigError(f"swarm file {path}: run: {e}") from e
    return SwarmFile(tuple(peers), run)


def load_run_config(path: str | Path) -> dict[str, Any]:
    """The JSON of `RunConfig.manifest()` that a launcher hands its peers (dotted keys)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read run config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"run config {path} is not a JSON object of dotted keys")
    return data


@dataclass(frozen=True)
class Layer:
    """One source of settings: its name (shown in messages), dotted key -> value, and whether a
    user gave it (defaults, and the run config a launcher hands its peers, are not explicit)."""

    source: str
    values: Mapping[str, Any]
    explicit: bool = True


@dataclass(frozen=True)
class Resolved:
    """A validated config and where each value came from."""

    cfg: RunConfig
    origin: dict[str, str]
    """Key -> the source of its value, for every key some layer set (preset-derived ones absent)."""
    explicit: dict[str, str]
    """The keys whose value a user's source gave (file, NOLOCO_SET, --set, a flag) -> that source."""


def resolve(layers: Sequence[Layer]) -> Resolved:
    """Apply the layers lowest first, key by key; check the result. Raises ConfigError."""
    typed: dict[str, Any] = {}
    origin: dict[str, str] = {}
    explicit: dict[str, str] = {}
    for layer in layers:
        for raw_key, value in layer.values.items():
            key = ALIASES.get(raw_key, raw_key)
            try:
                typed[key] = coerce(key, value)
            except ConfigError as e:  # the same kind of error, naming the source
                raise type(e)(f"{layer.source}: {e}") from None
            origin[key] = layer.source
            if layer.explicit:
                explicit[key] = layer.source
            else:
                explicit.pop(key, None)
    # A derived default, the same from every source: an outer exchange's deadline follows the step's.
    if "peer.step_timeout" in typed and "peer.exchange_timeout" not in typed:
        typed["peer.exchange_timeout"] = typed["peer.step_timeout"]
        origin["peer.exchange_timeout"] = origin["peer.step_timeout"]
    preset, method = typed.pop("preset", "tiny"), typed.pop("method", "noloco")
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    top: dict[str, Any] = {}
    for key, value in typed.items():
        section, _, name = key.rpartition(".")
        (sections[section] if section else top)[name] = value
    try:
        cfg = RunConfig.create(preset, method, **sections, **top)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e
    return Resolved(cfg, origin, explicit)


def build_config(
    preset: str = "tiny",
    method: str = "noloco",
    *,
    config_file: str | Path | None = None,
    assignments: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> RunConfig:
    """Defaults (`preset`, `method`) < config file < NOLOCO_SET (from `env`, default os.environ) < assignments."""
    env = os.environ if env is None else env
    layers = [Layer("default", {"preset": preset, "method": method}, explicit=False)]
    if config_file:
        layers.append(Layer(f"--config {config_file}", load_file(config_file)))
    layers.append(Layer("NOLOCO_SET", parse_assignments(env.get("NOLOCO_SET", ""))))
    layers.append(Layer("--set", dict(assignments or {})))
    return resolve(layers).cfg
