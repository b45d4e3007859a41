"""The docker-compose testbed's files and its judge, checked without an engine (the end-to-end run
is tests/integration/test_compose.py)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from noloco_swarm.cli.main import parser
from noloco_swarm.harness.compose import PEERS, judge, parse_proc_net_tcp
from noloco_swarm.peer.events import Final, Step

ROOT = Path(__file__).resolve().parents[2]


def _defaults(value: object) -> object:
    """What Compose makes of `${VAR:-default}` with VAR unset."""
    if isinstance(value, str):
        return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)
    if isinstance(value, list):
        return [_defaults(v) for v in value]
    if isinstance(value, dict):
        return {k: _defaults(v) for k, v in value.items()}
    return value


def test_compose_services_are_valid_noloco_commands() -> None:
    services = _defaults(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])
    assert isinstance(services, dict)
    boot = parser().parse_args(services["bootstrap"]["command"])
    assert boot.command == "dht" and boot.address_file == Path("/shared/bootstrap.addr")
    peers = {name: s for name, s in services.items() if name != "bootstrap"}
    assert sorted(peers) == sorted(PEERS)
    parsed = {}
    for name, service in peers.items():
        command = service["command"]
        assert command[0] == "join"  # docker/peer.sh adds --initial-peers from the bootstrap's file
        assert service["environment"]["NOLOCO_BOOTSTRAP_FILE"] == "/shared/bootstrap.addr"
        assert "NET_ADMIN" in service["cap_add"] and service["init"] is True
        args = parser().parse_args(["join", "--initial-peers", "/ip4/10.0.0.1/tcp/1/p2p/X", *command[1:]])
        assert args.announce_maddrs == [f"/dns4/{name}/tcp/31337"], "each peer announces its own address"
        parsed[name] = args
        assert service["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    assert sorted(a.stage for a in parsed.values()) == ["0", "0", "1", "1"]
    assert sum(a.new_run for a in parsed.values()) == 1  # exactly one peer publishes the manifest
    shared = {(a.run_id, a.steps, a.stages, a.replicas, tuple(a.assignments)) for a in parsed.values()}
    assert len(shared) == 1, "every peer of one run must get the same settings"
    assert len({s["environment"]["NOLOCO_SET"] for s in peers.values()}) == 1


def test_dockerfile_installs_the_cpu_torch_build_first() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and "FROM ${BASE_IMAGE}" in text
    wheelhouse = text.index("/tmp/wheelhouse/torch-")
    cpu_index = text.index("download.pytorch.org/whl/cpu")
    package = text.index("pip install -c constraints.txt .")
    assert wheelhouse < package and cpu_index < package
    ignored = [x for x in (ROOT / ".dockerignore").read_text().splitlines() if not x.startswith("#")]
    assert ".venv/" in ignored and ".git/" in ignored and not any(i.startswith("docker") for i in ignored)


def test_proc_net_tcp_gives_established_ipv4_connections() -> None:
    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue\n"
        "   0: 00000000:7A69 00000000:0000 0A 00000000:00000000\n"  # listening: not a connection
        "   1: 0300A8C0:7A69 0400A8C0:D2F0 01 00000000:00000000\n"
    )
    assert parse_proc_net_tcp(table) == [("192.168.0.3", 31337, "192.168.0.4", 54000)]


def _final(stage: int, state: str) -> Final:
    return Final(
        stage=stage, rank=0, peer_id="p", joined_round=0, steps=4, outer_steps=2, dropped_partners=0,
        dropped_samples=0, gone=[], final_view=[], train_seconds=8.0, tokens=100 * (stage == 0),
        val_loss=5.0, state_hash=state, bytes={},
    )  # fmt: skip


def _run(hash_b: str, losses: tuple[float, ...]) -> list[str]:
    events = {
        p: [
            *(
                Step(step=i + 1, loss=x, lr=0.1, seconds=1.0, tokens=0, tokens_per_second=0.0)
                for i, x in enumerate(losses)
            ),
            _final(int(p[5]), hash_b if p == "stage1-b" else f"h{p[5]}"),
        ]
        for p in PEERS
    }
    addresses = {p: f"10.0.0.{i}" for i, p in enumerate(PEERS, 2)}
    connections = {p: {(addresses[p], 31337, addresses[q], 40000) for q in PEERS if q != p} for p in PEERS}
    connections["stage0-a"] = {("127.0.0.1", 31337, "127.0.0.1", 40000)}  # loopback only
    return judge(events, 4, addresses, connections).problems


def test_judge_names_each_failed_check() -> None:
    problems = _run("h1", (8.0, 7.0, 6.0, 5.0))
    assert len(problems) == 1 and "stage0-a" in problems[0] and "container address" in problems[0]
    problems = _run("other", (5.0, 6.0, 7.0, 8.0))
    assert any("stage 1 replicas ended with different states" in p for p in problems)
    assert any("loss did not fall" in p for p in problems)
