"""`noloco runs` (issue 37): two runs of real peers on one DHT, one of them closed, listed by the
real command, with a forged and a malformed listing beside them that are skipped and counted.
(`noloco join --auto` joins a run in test_terminal.py's first hour; its choice among runs is
tests/unit/test_catalog.py's.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from noloco_swarm.harness.local import local_swarm
from noloco_swarm.peer import tickets
from noloco_swarm.peer.directory import RUNS_KEY, signed_dht_kwargs
from noloco_swarm.peer.events import Step, of_kind
from noloco_swarm.peer.net import identity
from noloco_swarm.peer.net.lifetime import DHT
from noloco_swarm.protocol import codec, records
from tests.integration.helpers import PACED_1S
from tests.integration.test_swarm import small

pytestmark = pytest.mark.integration
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
# Long enough that both runs still train when the test has looked at them; the test ends them.
STEPS = 5000
# A killed peer's announcement outlives it by this much (peer.heartbeat_ttl; 30 s by default).
TTL = 8


def noloco(args: list[str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "noloco_swarm.cli.main", *args]
    env = os.environ | {"COLUMNS": "100"}
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120, env=env)


def noloco_runs(bootstrap: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return noloco(["runs", "--initial-peers", bootstrap, *extra])


def started(swarm: object) -> None:
    deadline = time.monotonic() + 180
    while not all(of_kind(p.events(), Step) for p in swarm.peers):
        assert time.monotonic() < deadline, [p.log_tail() for p in swarm.peers]
        time.sleep(0.2)


def paced(stage: int | None, replica: int) -> dict[str, str]:
    return PACED_1S  # rounds of 3 steps, at least 1 s each: the test waits on the DHT, not on them


def test_runs_lists_an_open_and_a_closed_run_with_the_stage_short_of_peers(
    cache: Path, tmp_path: Path
) -> None:
    """An open 2 x 2 run loses a stage-1 peer (SIGKILL); a closed run of one stage trains beside it
    on the same DHT. `noloco runs --json` lists both with their model, method, peers per stage
    against what each stage asks for, access, round and tokens, names stage 1 of the open run
    as short of peers, and skips (and counts) a stranger's listing of the open run under a config
    it never signed, and a listing that does not decode. The table is printed for the docs."""
    open_cfg = small(
        "noloco",
        **{"inner.total_steps": str(STEPS), "peer.heartbeat_ttl": str(TTL)},
        description="tiny on the embedded corpus: a test run",
    )
    for folder in ("open", "closed"):
        (tmp_path / folder).mkdir()
    authority = tmp_path / "authority.key"
    identity.generate(authority)
    closed_cfg = small(
        "noloco",
        **{
            "inner.total_steps": str(STEPS),
            "num_stages": "1",
            "num_replicas": "1",
            "peer.heartbeat_ttl": str(TTL),
        },
        authority=tickets.public_key_text(identity.load(authority).key),
    )
    with (
        local_swarm(open_cfg, STEPS, workdir=tmp_path / "open", peer_env=paced) as open_run,
        local_swarm(
            closed_cfg,
            STEPS,
            workdir=tmp_path / "closed",
            initial_peers=(open_run.bootstrap,),
            authority=authority,
            peer_env=paced,
        ) as closed_run,
    ):
        started(open_run)
        started(closed_run)
        # A stranger lists the open run under a config nobody signed a manifest of, and stores
        # garbage under a listing subkey of its own.
        me = _key(tmp_path)
        stranger = DHT(
            initial_peers=[open_run.bootstrap], host_maddrs=LOOPBACK, start=True, **signed_dht_kwargs(me)
        )
        try:
            forged = records.RunListing(open_run.run_id, "0" * 64)
            expires = get_dht_time() + 600
            assert stranger.store(RUNS_KEY, codec.encode(forged), expires, subkey=me.owned(open_run.run_id))
            assert stranger.store(RUNS_KEY, b"\x01not a listing", expires, subkey=me.owned("junk"))
        finally:
            stranger.shutdown()
        victim = next(p for p in open_run.peers if p.stage == 1)
        os.kill(victim.proc.pid, signal.SIGKILL)
        # Until the victim's announcement expires (TTL s after its last heartbeat), the open run
        # still shows it.
        deadline, listed = time.monotonic() + TTL + 90, {}
        while time.monotonic() < deadline:
            out = noloco_runs(open_run.bootstrap, "--json")
            assert out.returncode == 0, out.stderr
            listed = json.loads(out.stdout)
            runs = {r["run_id"]: r for r in listed["runs"]}
            # Announcements carry a peer's step as of its last heartbeat (every TTL / 3 s).
            if (
                runs.get(open_run.run_id, {}).get("peers") == [2, 1]
                and closed_run.run_id in runs
                and all(r["step"] > 0 for r in runs.values())
            ):
                break
            time.sleep(2)
        # The table through a swarm file, as an organiser ships the bootstrap's address.
        swarm_file = tmp_path / "swarm.toml"
        swarm_file.write_text(f'initial_peers = ["{open_run.bootstrap}"]\n')
        table = noloco_runs(str(swarm_file))
        # Without a run id (and without --auto), join lists the open runs and stops.
        listing = noloco(["join", "--initial-peers", open_run.bootstrap])
    print(table.stdout)
    (tmp_path / "runs.txt").write_text(table.stdout)
    runs = {r["run_id"]: r for r in listed["runs"]}
    assert set(runs) == {open_run.run_id, closed_run.run_id}, listed
    assert listed["skipped"] == 2, listed
    a, b = runs[open_run.run_id], runs[closed_run.run_id]
    assert (a["wanted"], a["peers"], a["short"], a["closed"]) == ([2, 2], [2, 1], [1], False), a
    assert (b["wanted"], b["peers"], b["short"], b["closed"]) == ([1], [1], [], True), b
    for run in (a, b):
        assert (run["preset"], run["method"]) == ("tiny", "noloco") and run["parameters"] > 0, run
        assert run["step"] > 0 and run["tokens"] > 0 and run["round"] == run["step"] // 3, listed
    assert a["description"] == "tiny on the embedded corpus: a test run" and b["description"] == ""
    assert table.returncode == 0, table.stderr
    for text in (
        f"{open_run.run_id}  [open]  tiny on the embedded corpus: a test run",
        f"{closed_run.run_id}  [closed: a join ticket is needed]",
        "peers per stage 2/2 1/2: stage 1 short of peers",
        "peers per stage 1/1: every stage has its peers",
        "2 listings skipped",
    ):
        assert text in table.stdout, table.stdout
    assert listing.returncode == 2 and open_run.run_id in listing.stderr and "--auto" in listing.stderr, (
        listing
    )
    # only the open runs: a closed one needs a ticket, which `noloco join` alone cannot give
    assert closed_run.run_id not in listing.stderr and "1 closed run(s) not shown" in listing.stderr, listing


def test_runs_says_when_no_initial_peer_answers(tmp_path: Path) -> None:
    key = tmp_path / "nobody.key"
    identity.generate(key)
    nobody = f"/ip4/127.0.0.1/tcp/9/p2p/{identity.load(key).peer_id}"  # the discard port: nobody listens
    out = noloco_runs(nobody)
    assert out.returncode == 1 and "could not reach the DHT" in out.stdout, out


def _key(tmp_path: Path) -> identity.Identity:
    path = tmp_path / "stranger.key"
    identity.generate(path)
    return identity.load(path)
