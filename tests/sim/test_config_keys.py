"""Two tiers of config keys: `noloco keys` lists at most 40, `--all` every key once; every field
docstring is one or two sentences; a removed key is refused with the key that replaced it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from noloco_swarm.cli.keys import EXPERIMENTAL_HEADING, field_docs
from noloco_swarm.cli.main import main
from noloco_swarm.train.config import REMOVED_KEYS, USER_KEYS, RunConfig
from noloco_swarm.train.layering import SECTIONS, ConfigError, build_config, valid_keys

MAX_USER_KEYS = 40


def listed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    return [line.split()[0] for line in lines if line and not line.startswith("#")]


def test_keys_lists_the_user_keys_and_all_adds_the_experimental_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    users = listed(["keys"], capsys)
    assert len(users) <= MAX_USER_KEYS
    assert sorted(users) == sorted(USER_KEYS)
    every = listed(["keys", "--all"], capsys)
    assert sorted(every) == sorted(valid_keys()) and len(every) == len(set(every))  # each exactly once
    assert every[: len(users)] == users  # the user keys first, then the experimental ones
    assert main(["keys", "--all"]) == 0
    assert EXPERIMENTAL_HEADING in capsys.readouterr().out
    assert set(USER_KEYS) <= set(valid_keys())  # no stale name in the tier list


def sentences(doc: str) -> list[str]:
    """A docstring's sentences: a stop followed by a capital, a backquote, a bracket or a quote."""
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`(\"])", doc.strip()) if s]


def test_every_field_docstring_is_one_or_two_sentences() -> None:
    long = {}
    for section, cls in [("", RunConfig), *SECTIONS.items()]:
        for name, doc in field_docs(cls).items():
            if not 1 <= len(sentences(doc)) <= 2:
                long[f"{section}.{name}".lstrip(".")] = doc
    assert not long, long
    assert sentences("One, e.g. 3,2. Two (x). Three.") == ["One, e.g. 3,2.", "Two (x).", "Three."]


@pytest.mark.parametrize(("removed", "replacement"), sorted(REMOVED_KEYS.items()))
def test_a_removed_key_is_refused_with_its_replacement(
    removed: str, replacement: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=f"{removed!r} was removed; use {replacement!r}"):
        build_config(assignments={removed: "1"}, env={})
    section, name = removed.split(".")
    path = tmp_path / "run.toml"
    path.write_text(f"[{section}]\n{name} = 1\n")
    with pytest.raises(ConfigError, match=f"--config {path}: config key {removed!r} was removed"):
        build_config(config_file=path, env={})
    with pytest.raises(ValueError, match=f"use {replacement!r}"):
        RunConfig.create(model={name: 1})


def test_the_preset_sets_the_inner_schedule_and_inner_keys_override_it() -> None:
    small = build_config("small", env={}, assignments={"model.vocab_size": "4096"})
    assert (small.inner.lr, small.inner.warmup_steps, small.inner.total_steps) == (6e-4, 1000, 25_000)
    tiny = build_config(env={}, assignments={"inner.lr": "2e-3"})
    assert (tiny.inner.lr, tiny.inner.min_lr, tiny.inner.total_steps) == (2e-3, 1e-4, 2000)
    assert "model.lr" not in tiny.flat() and "inner.lr" in tiny.manifest()
