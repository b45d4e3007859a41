"""The import direction of the package (README, Layout), and the purity of the protocol core."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "noloco_swarm"
# Each sub-package may import the project parts listed for it, and nothing else of the project.
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "model": {"protocol"},
    "data": {"protocol"},
    "train": {"protocol", "model", "data"},
    "sim": {"protocol", "model", "data", "train"},
    "peer": {"protocol", "model", "data", "train"},
    "testbed": set(),  # starts processes only
    # starts whole swarms (local processes, namespaces, compose) for the CLI, the benches and the tests
    "harness": {"protocol", "model", "data", "train", "sim", "peer", "testbed"},
    "cli": {"protocol", "model", "data", "train", "sim", "peer", "testbed", "harness"},
}
# The tests whose subject is the CLI itself (its commands, flags, messages and views) may import
# noloco_swarm.cli; every other test, and every bench, drives swarms through harness/ and builds
# configs with train/layering.py.
CLI_TESTS = {
    "tests/integration/test_doctor.py",
    "tests/integration/test_plot.py",
    "tests/sim/test_cli.py",
    "tests/sim/test_config_checks.py",
    "tests/sim/test_config_keys.py",
    "tests/sim/test_config_precedence.py",
    "tests/sim/test_swarm_file.py",
    "tests/unit/test_catalog.py",  # `noloco runs`' table and JSON, and `noloco join --auto`'s choice
    "tests/unit/test_compose.py",  # the compose file's commands parse as `noloco` commands
    "tests/unit/test_doctor_checks.py",
    "tests/unit/test_local_view.py",
    "tests/unit/test_panel.py",
    "tests/unit/test_plan_cli.py",  # `noloco plan`: its JSON, table and refusals
    "tests/unit/test_testbed.py",  # `noloco testbed` refuses bad --shape, --cut and --delay
}
# The protocol core does no I/O: no sockets, no asyncio, no hivemind, no wall clock, no files.
PROTOCOL_FORBIDDEN = {
    "asyncio",
    "socket",
    "hivemind",
    "time",
    "datetime",
    "os",
    "subprocess",
    "threading",
    "io",
}


def project_imports(path: Path, root: Path = PACKAGE.parent) -> list[tuple[str, int]]:
    """(first sub-package name, line) for every import of noloco_swarm.X in a file under root."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package_parts = path.relative_to(root).with_suffix("").parts
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this file's package
                base = package_parts[: len(package_parts) - node.level]
                names = [".".join([*base, node.module or ""]).rstrip(".")]
            else:
                names = [node.module or ""]
        if isinstance(node, ast.ImportFrom) and names == ["noloco_swarm"]:  # from noloco_swarm import cli
            names = [f"noloco_swarm.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "noloco_swarm" and len(parts) > 1:
                found.append((parts[1], node.lineno))
    return found


def all_modules(sub: str) -> list[Path]:
    return sorted((PACKAGE / sub).rglob("*.py"))


def cli_importers(root: Path = ROOT) -> list[str]:
    """The bench and test files (relative to root) that import noloco_swarm.cli, with the line."""
    files = sorted((root / "bench").glob("*.py")) + sorted((root / "tests").rglob("*.py"))
    return [
        f"{path.relative_to(root)}:{line}"
        for path in files
        for target, line in project_imports(path, root=root)
        if target == "cli"
    ]


def test_benches_and_tests_import_the_cli_only_to_test_it() -> None:
    bad = [where for where in cli_importers() if where.partition(":")[0] not in CLI_TESTS]
    assert not bad, (
        "import swarms from noloco_swarm.harness and configs from noloco_swarm.train.layering, "
        "not from the CLI (or add a test of the CLI itself to CLI_TESTS):\n" + "\n".join(bad)
    )
    assert all((ROOT / name).exists() for name in CLI_TESTS), "CLI_TESTS names a file that is gone"


def test_the_cli_import_check_catches_a_bench_and_a_test(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "bench" / "probe.py").write_text("from noloco_swarm.cli.options import build_config\n")
    (tmp_path / "tests" / "unit" / "test_probe.py").write_text(
        "import json\nfrom noloco_swarm import cli\nfrom noloco_swarm.harness.local import wait\n"
    )
    assert cli_importers(tmp_path) == ["bench/probe.py:1", "tests/unit/test_probe.py:2"]


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_import_direction(sub: str) -> None:
    assert all_modules(sub), f"noloco_swarm/{sub} has no modules"
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports noloco_swarm.{target}"
        for path in all_modules(sub)
        for target, line in project_imports(path)
        if target != sub and target not in ALLOWED[sub]
    ]
    assert not bad, "import direction broken (see the README's Layout section):\n" + "\n".join(bad)


def test_protocol_core_does_no_io() -> None:
    bad = []
    for path in all_modules("protocol"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.Import):
                modules = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [(node.module or "").split(".")[0]]
            bad += [
                f"{path.name}:{node.lineno} imports {mod}" for mod in modules if mod in PROTOCOL_FORBIDDEN
            ]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                bad.append(f"{path.name}:{node.lineno} opens a file")
    assert not bad, "\n".join(bad)


def test_no_top_level_modules_besides_the_package_init() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py"], f"put modules in a sub-package, found {top}"


def test_checker_catches_a_violation(tmp_path: Path) -> None:
    probe = tmp_path / "noloco_swarm" / "protocol" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        "from noloco_swarm.peer import something\nfrom ..model import x\nfrom . import gossip\n"
        "from noloco_swarm import cli, sim\nfrom .. import harness\n"
    )
    found = [t for t, _ in project_imports(probe, root=tmp_path)]
    assert found == ["peer", "model", "protocol", "cli", "sim", "harness"]


def test_peer_rooms_stay_small() -> None:
    """Each protocol verb has its own room in peer/: no class there grows past ~300 lines, and
    the lifecycle (runtime.py) stays a few hundred lines."""
    big = []
    for path in all_modules("peer"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                big.append(f"{path.name}:{node.name} has {node.end_lineno - node.lineno + 1} lines")
    assert not big, "split these classes by protocol verb:\n" + "\n".join(big)
    assert len((PACKAGE / "peer" / "runtime.py").read_text().splitlines()) <= 400


# Commands that run no model start without transformers (about 3 s of CPU to import here): the DHT
# bootstrap, the live view, the launchers of a networked swarm, the config tools. The peer
# (`cli.join`) needs it. One fresh interpreter imports them in turn and says, after each,
# whether transformers has been loaded; the peer comes last, to show that the probe sees it.
WITHOUT_TRANSFORMERS = [
    *(f"cli.{name}" for name in ("main", "dht", "status", "local", "keys", "doctor", "testbed")),
    *(f"harness.{name}" for name in ("local", "namespaces", "compose")),
]
PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module("noloco_swarm." + name)
    print(name, "transformers" in sys.modules)
"""


def test_commands_that_run_no_model_do_not_import_transformers() -> None:
    argv = [sys.executable, "-c", PROBE, *WITHOUT_TRANSFORMERS, "cli.join"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=PACKAGE.parent).stdout
    loaded = dict(line.split() for line in out.splitlines())
    assert loaded == {**{c: "False" for c in WITHOUT_TRANSFORMERS}, "cli.join": "True"}, loaded
