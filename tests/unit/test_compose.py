"""The docker-compose testbed cannot run here (no Docker engine); check what can be checked."""

from __future__ import annotations

from pathlib import Path

import yaml

from noloco_swarm.cli.main import parser

ROOT = Path(__file__).resolve().parents[2]


def test_compose_services_are_valid_noloco_commands() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    boot = parser().parse_args(services["bootstrap"]["command"])
    assert boot.command == "dht" and boot.address_file == Path("/shared/bootstrap.addr")
    peers = {name: s for name, s in services.items() if name != "bootstrap"}
    assert len(peers) == 4
    parsed = {}
    for name, service in peers.items():
        entry = service["entrypoint"]
        assert entry[:2] == ["sh", "-c"] and "cat /shared/bootstrap.addr" in entry[2]
        args = parser().parse_args(
            ["join", "--initial-peers", "/ip4/10.0.0.1/tcp/1/p2p/X", *service["command"]]
        )
        parsed[name] = args
        assert service["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    assert sorted(a.stage for a in parsed.values()) == ["0", "0", "1", "1"]
    assert sum(a.new_run for a in parsed.values()) == 1  # exactly one peer publishes the manifest
    shared = {(a.run_id, a.steps, a.stages, a.replicas, tuple(a.assignments)) for a in parsed.values()}
    assert len(shared) == 1, "every peer of one run must get the same settings"


def test_dockerfile_installs_the_cpu_torch_build_first() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    torch_line = next(i for i, line in enumerate(lines) if "torch==" in line)
    package_line = next(i for i, line in enumerate(lines) if "-c constraints.txt" in line)
    assert "download.pytorch.org/whl/cpu" in lines[torch_line] and torch_line < package_line
