"""Real peer processes with real p2pd daemons on loopback must reproduce the simulator bit for bit."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from noloco_swarm.cli.options import build_config
from noloco_swarm.cli.swarm import local_swarm, wait
from noloco_swarm.model import num_flat
from noloco_swarm.sim.config import RunConfig
from noloco_swarm.sim.engine import Simulator
from noloco_swarm.sim.run import data_batches
from tests.integration.helpers import descendants, p2pd_descendants, process_group

pytestmark = pytest.mark.integration
STEPS = 7  # H = 3: two outer steps, then one inner step so that replicas differ at the end


def small(method: str, **extra: str) -> RunConfig:
    assignments = {
        "model.seq_len": "32",
        "inner.batch_size": "2",
        "outer.inner_steps": "3",
        "inner.warmup_steps": "2",
        "inner.total_steps": "8",
        "eval_windows": "4",
        "num_stages": "2",
        "num_replicas": "2",
        **extra,
    }
    return build_config("tiny", method, assignments=assignments, env={})


@pytest.fixture
def one_thread() -> Iterator[None]:
    # The peers run with one torch thread; the reference must too, or float sums may be ordered
    # differently inside the kernels.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def simulate(cfg: RunConfig, steps: int) -> tuple[list[list[str]], dict[int, list[list[str]]]]:
    """Final replica hashes, and the hashes right after every outer step (keyed by step)."""
    sim = Simulator(cfg, data_batches(cfg))
    after_outer = {}
    for _ in range(steps):
        if sim.inner_step().outer_step:
            after_outer[sim.step] = sim.replica_hashes()
    return sim.replica_hashes(), after_outer


@pytest.mark.parametrize("method", ["noloco", "diloco"])
def test_swarm_ends_with_the_simulators_weights(method: str, cache: Path, one_thread: None) -> None:
    cfg = small(method)
    before = p2pd_descendants()
    with local_swarm(cfg, STEPS, step_timeout=60) as swarm:
        wait(swarm, timeout=400)
        summaries = swarm.summaries()
        outers = []
        for p in swarm.peers:
            events = p.events()
            rank = next(e["rank"] for e in events if e["event"] == "membership")
            outers += [(p.stage, rank, e) for e in events if e["event"] == "outer"]
    assert p2pd_descendants() <= before, "the swarm left p2pd daemons behind"
    expected, after_outer = simulate(cfg, STEPS)
    got = {(s["stage"], s["rank"]): s["state_hash"] for s in summaries}
    assert len(got) == 4
    assert all(s["steps"] == STEPS and s["outer_steps"] == 2 for s in summaries)
    for (stage, rank), digest in got.items():
        assert digest == expected[stage][rank], f"stage {stage} replica {rank} differs from the simulator"
    assert expected[0][0] != expected[0][1], "replicas should differ after the last inner step"
    # Bytes: with gamma == beta a pair exchanges theta only, 1.0x the stage's fp32 bytes each way.
    theta_bytes = {s: num_flat_stage(cfg, s) * 4 for s in range(2)}
    assert len(outers) == 8
    for stage, rank, e in outers:
        assert e["state_hash"] == after_outer[e["step"]][stage][rank], f"outer step {e['step']} differs"
        assert theta_bytes[stage] <= e["sent_bytes"] <= theta_bytes[stage] * 1.01 + 4096
        assert theta_bytes[stage] <= e["received_bytes"] <= theta_bytes[stage] * 1.01 + 4096
        assert e["failed"] == [] and len(e["partners"]) == 1 and len(e["state_hash"]) == 64
    assert all(s["val_loss"] is not None for s in summaries if s["stage"] == 0)


def num_flat_stage(cfg: RunConfig, stage: int) -> int:
    from noloco_swarm.model import build_stage

    return num_flat(build_stage(cfg.model, stage, cfg.num_stages, cfg.seed))


def test_a_killed_peer_takes_its_daemon_and_the_rest_of_the_swarm_finishes(cache: Path) -> None:
    """Failure is normal control flow: samples routed to a dead replica are dropped, its partner
    steps alone, and everyone else finishes the run."""
    steps = 12
    cfg = small("noloco", **{"inner.total_steps": str(steps)})
    before = p2pd_descendants()
    with local_swarm(cfg, steps, step_timeout=10) as swarm:
        victim = next(p for p in swarm.peers if p.stage == 1 and p.replica == 1)
        deadline = time.monotonic() + 120
        while not any(e["event"] == "step" and e["step"] >= 2 for e in victim.events()):
            assert time.monotonic() < deadline, victim.log_tail()
            time.sleep(0.2)
        daemons = p2pd_descendants(victim.proc.pid)
        assert daemons, "the peer should run its own p2pd"
        os.kill(victim.proc.pid, signal.SIGKILL)  # no cleanup code of the peer runs
        deadline = time.monotonic() + 15
        while any(Path(f"/proc/{pid}").exists() and pid in descendants(os.getpid()) for pid in daemons):
            assert time.monotonic() < deadline, "p2pd outlived its SIGKILLed peer"
            time.sleep(0.2)
        survivors = [p for p in swarm.peers if p is not victim]
        deadline = time.monotonic() + 300
        while not all(p.proc.poll() is not None for p in survivors):
            assert time.monotonic() < deadline, "\n".join(p.log_tail() for p in survivors)
            time.sleep(0.5)
        assert [p.proc.returncode for p in survivors] == [0, 0, 0], "\n".join(p.log_tail() for p in survivors)
        summaries = {(s["stage"], s["rank"]): s for s in swarm.summaries()}
    assert p2pd_descendants() <= before
    victim_rank = next(rank for (stage, rank) in [(1, 0), (1, 1)] if (stage, rank) not in summaries)
    assert all(s["steps"] == steps for s in summaries.values())
    assert sum(s["dropped_samples"] for s in summaries.values() if s["stage"] == 0) > 0
    partner = summaries[(1, 1 - victim_rank)]
    assert [1, victim_rank] in partner["gone"] and partner["outer_steps"] == steps // 3


def test_hivemind_dht_cli_is_a_working_entry_point(cache: Path) -> None:
    """Peers find each other through hivemind's own bootstrap tool, not only through ours."""
    exe = shutil.which("hivemind-dht", path=str(Path(sys.executable).parent))
    assert exe
    cfg = small("noloco", num_replicas="1", **{"outer.inner_steps": "2", "inner.total_steps": "4"})
    with process_group([exe, "--host_maddrs", "/ip4/127.0.0.1/tcp/0"]) as (_, bootstrap):  # noqa: SIM117
        with local_swarm(cfg, 4, step_timeout=60, initial_peers=(bootstrap,)) as swarm:
            wait(swarm, timeout=300)
            assert all(f"--initial-peers {bootstrap}" in " ".join(p.proc.args) for p in swarm.peers)  # type: ignore[arg-type]
            summaries = swarm.summaries()
    assert sorted((s["stage"], s["steps"]) for s in summaries) == [(0, 4), (1, 4)]
