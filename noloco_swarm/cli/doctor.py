"""`noloco doctor`: preflight checks before joining a swarm, each failure with a one-line fix.

The checks run in the order a volunteer would fix them: the config, the libp2p daemon, the
bootstrap peers and the clock, the ports, reachability from outside, the run's manifest, memory
and installed versions (doctor_net.py checks the network, doctor_local.py this machine). The
report is one line per check, and a fix under each that failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from noloco_swarm.cli.doctor_local import (
    Check,
    config_check,
    listen_ports,
    memory_check,
    port_check,
    versions_check,
)
from noloco_swarm.cli.doctor_net import dialback_check, manifest_check, network_checks
from noloco_swarm.train.config import RunConfig


def run_checks(
    cfg: RunConfig,
    *,
    port: int | None,
    memory_limit: float | None,
    timeout: float = 10.0,
    refusals: Sequence[str] = (),
) -> list[Check]:
    """Every check, in the order a volunteer would fix them."""
    checks = [config_check(refusals), *asyncio.run(network_checks(cfg, timeout))]
    listen = [("0.0.0.0", port)] if port else []
    listen += [hp for hp in listen_ports(cfg.network.host_maddrs) if hp[1] != port]
    for host, p in listen:
        fix = (
            f"stop what holds it (ss -ltnp 'sport = :{p}' shows it) or choose another: "
            f"--host-maddrs /ip4/0.0.0.0/tcp/OTHER"
        )
        checks.append(port_check(host, p, "listen port", fix))
    if not listen:
        checks.append(
            Check("port", True, "no fixed port: the daemon picks a free one (give --port to check one)")
        )
    if cfg.peer.metrics_port:
        checks.append(
            port_check(
                cfg.peer.metrics_host,
                cfg.peer.metrics_port,
                "metrics port",
                "stop what holds it or choose another --metrics-port",
            )
        )
    answered = [c for c in checks if c.name.startswith("bootstrap ") and c.ok]
    ports_free = all(c.ok for c in checks if c.name.startswith("port "))
    if answered and ports_free:
        bootstraps = [c.name.removeprefix("bootstrap ") for c in answered]
        checks.append(asyncio.run(dialback_check(cfg, port, bootstraps, timeout)))
    if cfg.peer.run_id and answered:
        checks.append(manifest_check(cfg, timeout))
    checks.append(memory_check(cfg, cfg.peer.stage, memory_limit))
    checks.append(versions_check())
    return checks


def report(checks: Sequence[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
        if not c.ok:
            lines.append(f"      fix: {c.fix}")
    failed = sum(not c.ok for c in checks)
    lines.append(
        f"all {len(checks)} checks passed" if not failed else f"{failed} of {len(checks)} checks failed"
    )
    return "\n".join(lines)


def run_doctor(
    cfg: RunConfig,
    *,
    port: int | None,
    memory_limit: float | None,
    timeout: float,
    refusals: Sequence[str] = (),
) -> int:
    checks = run_checks(cfg, port=port, memory_limit=memory_limit, timeout=timeout, refusals=refusals)
    print(report(checks), flush=True)
    return 0 if all(c.ok for c in checks) else 1
