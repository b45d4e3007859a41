"""Describe the config tree: every key with its type and docstring, and a resolved config as TOML."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import math
import textwrap
import types
import typing
from typing import Any

from noloco_swarm.train.config import RunConfig, experimental
from noloco_swarm.train.layering import (
    AUTO_KEYS,
    AUTO_ONLY,
    CHOICES,
    SECTIONS,
    TOP_LEVEL,
    Resolved,
    field_type,
)

EXPERIMENTAL_HEADING = (
    "# experimental keys: lab tuning (model shape, microbatches, overlap, transport, deadlines, pacing, "
    "memory, checks), defaults set by measurement (docs/config.md)"
)
CHOICE_DOCS = {
    "preset": "Model preset (tiny, mini, small, medium, large): sets model.* and the inner schedule's defaults.",
    "method": "noloco, diloco, allreduce or local: sets outer.* to the method's paper defaults.",
}


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string under each field), whitespace collapsed."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def type_name(hint: Any) -> str:
    """A short, readable name of a field's type: `int`, `float | None`, `tuple[str, ...]`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is tuple:
        inner = [type_name(a) if a is not Ellipsis else "..." for a in args]
        return f"tuple[{', '.join(inner)}]"
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def describe_keys(show_all: bool = False) -> str:
    """`noloco keys`: one line per key a volunteer or organiser sets (name, type, meaning); with
    `show_all`, the experimental keys too, under a heading of their own (train/config.py USER_KEYS)."""
    rows = [(key, "str", doc) for key, doc in CHOICE_DOCS.items()]
    top_docs = field_docs(RunConfig)
    rows += [(key, type_name(field_type(key)), top_docs.get(key, "")) for key in TOP_LEVEL]
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            doc = docs.get(f.name, "")
            if key in CHOICES.values():
                doc = f"The same key as {next(k for k, v in CHOICES.items() if v == key)}. {doc}"
            rows.append((key, type_name(field_type(key)), doc))
    width = max(len(k) for k, _, _ in rows) + 2
    kind = max(len(t) for _, t, _ in rows) + 2

    def lines(chosen: list[tuple[str, str, str]]) -> list[str]:
        return [f"{k:<{width}}{t:<{kind}}{doc}".rstrip() for k, t, doc in chosen]

    out = lines([r for r in rows if not experimental(r[0])])
    if show_all:
        out += ["", EXPERIMENTAL_HEADING, *lines([r for r in rows if experimental(r[0])])]
    return "\n".join(out)


def toml_value(key: str, value: Any) -> str:
    """A value as TOML that `--config` reads back to the same value (None as "none" or "auto")."""
    if value is None:
        return '"auto"' if key in AUTO_KEYS + AUTO_ONLY else '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(key, v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def toml_lines(values: dict[str, Any], notes: dict[str, str] | None = None) -> list[str]:
    """Dotted keys as TOML lines for `--config`: the top-level keys first (in TOML, a key after a
    [section] header belongs to that section), then each section's keys under its header, in the
    order given; `notes` puts a comment after a key's value."""
    notes = notes or {}
    ordered = [k for k in values if "." not in k] + [k for k in values if "." in k]
    lines: list[str] = []
    section = ""
    for key in ordered:
        head, _, name = key.rpartition(".")
        if head != section:
            section = head
            lines += ["", f"[{head}]"]
        note = notes.get(key)
        lines.append(f"{name} = {toml_value(key, values[key])}" + (f"  # {note}" if note else ""))
    return lines


def to_toml(resolved: Resolved, title: str) -> str:
    """The resolved config as a TOML file for `--config`; each value set by a source says which."""
    flat = resolved.cfg.flat()
    values = {key: flat.pop(tree_key) for key, tree_key in CHOICES.items()} | flat
    lines = [f"# {title}", "# precedence: defaults < --config FILE < NOLOCO_SET < --set < named flags"]
    return "\n".join(lines + toml_lines(values, resolved.origin))
