"""A hostile DHT node against a running swarm: as a stranger it forges an honest peer's
announcement and gone reports in members' names; holding a member's key (as a member that lies
would), it reports an honest, live peer gone round after round. Nobody is evicted, every peer
keeps one view per round, nothing is dropped, and the lying member ends up unheard."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from noloco_swarm.cli.swarm import local_swarm, wait
from noloco_swarm.peer import identity
from noloco_swarm.peer.directory import RunDirectory, gone_key, peers_key, signed_dht_kwargs
from noloco_swarm.peer.events import Dropped, Excluded, FalseReport, Joined, Step, of_kind
from noloco_swarm.peer.lifetime import DHT
from noloco_swarm.protocol import messages
from tests.integration.test_swarm import small, views_by_round

pytestmark = pytest.mark.integration
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_forged_records_and_a_lying_member_evict_nobody(cache: Path, tmp_path: Path) -> None:
    steps, H = 30, 3  # ten rounds: the reports of rounds 0..3 fall due while it trains
    cfg = small("noloco", **{"outer.inner_steps": str(H), "inner.total_steps": str(steps)})
    with local_swarm(cfg, steps, workdir=tmp_path, durable=True) as swarm:  # durable: keys on disk
        run = swarm.run_id
        deadline = time.monotonic() + 120
        while not all(of_kind(p.events(), Step) for p in swarm.peers):
            assert time.monotonic() < deadline, [p.log_tail() for p in swarm.peers]
            time.sleep(0.2)
        liar = identity.load(tmp_path / "peer-0-0.key")  # a member; its process stays honest
        honest = identity.load(tmp_path / "peer-0-1.key").peer_id
        victim = identity.load(tmp_path / "peer-1-1.key").peer_id
        hostile = DHT(
            initial_peers=[swarm.bootstrap], host_maddrs=LOOPBACK, start=True, **signed_dht_kwargs(liar)
        )
        try:
            # As the member: the victim is gone, in rounds 0..3 (signed: these records are real).
            as_member = RunDirectory(hostile, run, identity=liar)
            for round_ in range(4):
                assert as_member.report_gone(messages.GoneReport(run, victim, liar.peer_id, round_))
            # As a stranger: the victim's announcement for round 1000 with an hour to live, under
            # its plain id and under the member's mark; a report in the honest member's name.
            forged = messages.encode(messages.PeerAnnouncement(run, victim, 1, 1000))
            for subkey in (victim, liar.owned(victim)):
                hostile.store(peers_key(run), forged, get_dht_time() + 3600, subkey=subkey)
            framed = messages.GoneReport(run, victim, honest, 0)
            hostile.store(
                gone_key(run), messages.encode(framed), get_dht_time() + 3600, subkey=f"{victim}/{honest}/0"
            )
            wait(swarm, timeout=400)
        finally:
            hostile.shutdown()
        events = [p.events() for p in swarm.peers]
    views = views_by_round(events)
    assert all(len(v) == 1 for v in views.values()), views
    assert all(victim in next(iter(v))[1] for v in views.values()), "the victim was evicted"
    everything = [e for ev in events for e in ev]
    assert not [e for e in everything if isinstance(e, Dropped | Excluded | Joined)]
    false = [e for e in everything if isinstance(e, FalseReport)]
    assert false and {(e.reporter, e.peer) for e in false} == {(liar.peer_id, victim)}, false
    assert any(e.ignored_until > 0 for e in false), "the lying member was never sentenced"
    assert all(s.steps == steps for s in swarm.summaries())
