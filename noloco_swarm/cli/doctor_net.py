"""`noloco doctor`'s network checks: the libp2p daemon, the bootstrap peers, the clock, the
identity, the run's manifest and reachability from outside (dial-back).

The most common failures of hivemind-based clients are a libp2p daemon that does not start,
bootstrap peers that do not answer, and a machine nobody outside can reach. Each check does the
real thing: starts p2pd, dials the bootstrap peers through hivemind, reads the run's manifest
from the DHT.

The clock is compared with each bootstrap peer's (the DHT time in its answer to a DHT ping, any
hivemind node answers it): DHT records and join tickets expire by wall-clock time.

Reachability from outside is checked by dial-back (peer/net/dialback.py): a daemon listening where
`noloco join` would (the --port, or network.host_maddrs, announcing network.announce_maddrs) asks
an answering `noloco dht` bootstrap to open a fresh connection to it. A bootstrap that does not
offer it (a plain hivemind node) leaves this unchecked, and says so.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from noloco_swarm.cli.doctor_local import SETUP, Check
from noloco_swarm.peer.net import dialback
from noloco_swarm.peer.net.dialback import first_line
from noloco_swarm.peer.net.streams import relayed
from noloco_swarm.train.config import RunConfig

HIVEMIND_PIN = "hivemind==1.1.12"
RETRY = "the bootstrap answered but the DHT did not: try again, or raise --timeout on a slow link"
UNTESTED = "the bootstrap could not run this test just now: try again; if it persists, its log says why"


# ------------------------------------------------------------------------ the libp2p daemon


def p2pd_binary() -> Path:
    import hivemind

    return Path(hivemind.__file__).parent / "hivemind_cli" / "p2pd"


async def start_p2p():  # -> hivemind.P2P, typed loosely: hivemind is imported lazily
    from noloco_swarm.peer.net import lifetime

    return await lifetime.start_p2p(host_maddrs=["/ip4/127.0.0.1/tcp/0"])


def p2pd_check(error: BaseException | None) -> Check:
    binary = p2pd_binary()
    if error is None:
        return Check("p2pd", True, f"hivemind's libp2p daemon starts ({binary})")
    if not binary.exists():
        why = f"{binary} is missing"
    elif not os.access(binary, os.X_OK):
        why = f"{binary} is not executable"
    else:
        why = f"{type(error).__name__}: {error}"
    return Check(
        "p2pd",
        False,
        f"the libp2p daemon did not start: {why}",
        f"reinstall hivemind with its daemon: pip install --force-reinstall --no-deps {HIVEMIND_PIN} "
        "(on ARM or musl, build p2pd from source: see hivemind's install docs)",
    )


# ------------------------------------------------------------------------ bootstrap peers


async def bootstrap_check(p2p, maddr: str, timeout: float) -> Check:
    """Dial `maddr` through our daemon: libp2p's handshake also proves the peer id is the one named."""
    from hivemind.p2p import PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, P2PDaemonError
    from hivemind.utils.multiaddr import Multiaddr

    name = f"bootstrap {maddr}"
    try:
        address = Multiaddr(maddr)
        named = address.value_for_protocol("p2p")
        peer_id = PeerID.from_base58(named)
        address = address.decapsulate(Multiaddr(f"/p2p/{named}"))  # the daemon dials the bare address
    except Exception as e:  # noqa: BLE001  (multiaddr raises many kinds of error for bad text)
        return Check(
            name,
            False,
            f"not a peer address: {e}",
            "give the full address the bootstrap node printed, e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...",
        )
    try:
        async with asyncio.timeout(timeout):
            await p2p._client.connect(peer_id, [address])
    except TimeoutError:
        return Check(
            name,
            False,
            f"no answer within {timeout:.0f} s",
            "a firewall or NAT drops the connection: open the bootstrap's TCP port, or use a reachable bootstrap",
        )
    except (ControlFailure, P2PDaemonError, OSError) as e:
        text = str(e)
        mismatch = [line.strip(" *") for line in text.splitlines() if "peer id mismatch" in line.lower()]
        if mismatch:
            text = mismatch[0].split("] ", 1)[
                -1
            ]  # "... peer id mismatch: expected X, but remote key matches Y"
            fix = "another node answers at that address: copy the --initial-peers the bootstrap prints again"
        else:
            fix = (
                "nothing answers there: is the bootstrap node running (noloco dht), and are its IP and "
                "port right? A restarted node without --identity has a new peer id"
            )
        return Check(name, False, f"dial failed: {first_line(text)}", fix)
    return Check(name, True, "answers (libp2p connection made, peer id verified)")


# Seconds a clock may be off the bootstrap's, beyond the ping's own uncertainty: announcements
# live peer.heartbeat_ttl (30 s) and are refreshed every third of it.
CLOCK_TOLERANCE = 5.0
CLOCK_FIX = (
    "set this machine's clock from the network (timedatectl set-ntp true, or run chronyd or ntpd): "
    "DHT records and join tickets expire by wall-clock time"
)


def clock_verdict(name: str, offset: float, uncertainty: float) -> Check:
    """`offset`: the bootstrap's clock minus ours (s), measured within +- `uncertainty` (half the
    ping's round trip)."""
    if abs(offset) - uncertainty > CLOCK_TOLERANCE:
        ahead = "behind" if offset > 0 else "ahead of"
        return Check(name, False, f"this clock is {abs(offset):.1f} s {ahead} the bootstrap's", CLOCK_FIX)
    return Check(name, True, f"within {abs(offset) + uncertainty:.2f} s of the bootstrap's")


async def clock_check(p2p, maddr: str, timeout: float) -> Check:
    """Our clock against the DHT time a bootstrap peer reports in its answer to a DHT ping."""
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2
    from hivemind.utils.multiaddr import Multiaddr

    name = f"clock vs {maddr}"
    peer_id = PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p"))
    stub = super(DHTProtocol, DHTProtocol).get_stub(p2p, peer_id)  # the DHT's own RPC, any hivemind node
    sent = time.time()
    try:
        async with asyncio.timeout(timeout):
            response = await stub.rpc_ping(dht_pb2.PingRequest(validate=False))
    except Exception as e:  # noqa: BLE001  (a node that is no DHT node answers with many kinds of error)
        return Check(
            name,
            False,
            f"the bootstrap did not answer a DHT ping: {first_line(str(e)) or type(e).__name__}",
            "the bootstrap answers libp2p but is no DHT node: use the address noloco dht (or a peer) prints",
        )
    back = time.time()
    return clock_verdict(name, response.dht_time - (sent + back) / 2, (back - sent) / 2)


async def identity_check(path: str, initial_peers: Sequence[str]) -> Check:
    """Is a live node of the swarm already using the key in `path` (another copy of this peer)?"""
    from hivemind.p2p import P2P

    from noloco_swarm.peer.net.lifetime import children_die_with_us

    with children_die_with_us():
        taken = await P2P.is_identity_taken(
            path,
            initial_peers=list(initial_peers),
            tls=True,
            use_auto_relay=False,
            use_ipfs=False,
            use_relay=True,
        )
    if taken:
        return Check(
            "identity",
            False,
            f"a live node of the swarm already runs with the key in {path}",
            "stop the other process that uses this key, or give this one its own --identity file",
        )
    return Check("identity", True, f"no live node uses the key in {path}")


def manifest_check(cfg: RunConfig, timeout: float) -> Check:
    """Read the run's manifest through a client-mode DHT node and compare it with our config."""
    from noloco_swarm.peer.directory import manifest_key, signed_manifests
    from noloco_swarm.peer.net.node import start_dht
    from noloco_swarm.protocol import records
    from noloco_swarm.train.config import NetworkConfig

    run_id = cfg.peer.run_id
    dht = start_dht(NetworkConfig(initial_peers=cfg.network.initial_peers, client_mode=True))
    try:  # read the record raw: a peer's directory skips one it cannot decode, we must name why
        future = dht.get(manifest_key(run_id), latest=True, return_future=True)
        found = future.result(timeout=timeout)
    except TimeoutError:
        future.cancel()
        return Check(f"run {run_id}", False, f"the DHT did not answer within {timeout:.0f} s", RETRY)
    finally:
        dht.shutdown()
    found_manifests, unreadable = signed_manifests(None if found is None else found.value, run_id)
    manifests = [m for _, m in found_manifests]  # one per author (the DHT checked their signatures)
    if not manifests and unreadable is not None:
        return Check(
            f"run {run_id}",
            False,
            f"its manifest cannot be read: {unreadable}",
            "the run uses another noloco-swarm version (protocol): install the one the run uses",
        )
    if not manifests:
        return Check(f"run {run_id}", True, "no manifest yet: the first peer starts it with --new-run")
    mine = records.RunManifest.create(run_id, cfg.manifest())
    if any(m.config_hash == mine.config_hash for m in manifests):
        return Check(f"run {run_id}", True, "your config matches the run's manifest")
    existing = manifests[0]
    diff = existing.differences(mine)
    return Check(
        f"run {run_id}",
        False,
        f"your config differs from the run's in {len(diff)} key(s): {'; '.join(diff[:3])}",
        "use the run's config (the organiser's --config file, or --set KEY=VALUE for each key above)",
    )


# ------------------------------------------------------------------------ the whole run


async def network_checks(cfg: RunConfig, timeout: float) -> list[Check]:
    try:
        p2p = await start_p2p()
    except Exception as e:  # noqa: BLE001  (whatever stops the daemon is what the volunteer must see)
        return [p2pd_check(e)]
    checks = [p2pd_check(None)]
    try:
        async with asyncio.TaskGroup() as group:
            dials = [group.create_task(bootstrap_check(p2p, m, timeout)) for m in cfg.network.initial_peers]
        checks += [d.result() for d in dials]
        answered = [m for m, c in zip(cfg.network.initial_peers, checks[1:], strict=True) if c.ok]
        async with asyncio.TaskGroup() as group:
            clocks = [group.create_task(clock_check(p2p, m, timeout)) for m in answered]
        checks += [c.result() for c in clocks]
    finally:
        await p2p.shutdown()
    identity = cfg.network.identity_path
    if identity and Path(identity).exists() and answered:
        checks.append(await identity_check(identity, answered))
    if not cfg.network.initial_peers:
        checks.append(
            Check(
                "bootstrap",
                True,
                "no --initial-peers given: not checked (a peer needs them to join a swarm)",
            )
        )
    return checks


DIALBACK_FIX = (
    "nobody outside can open a connection to this machine: forward TCP port {port} to it (router, "
    "firewall, cloud security group) and announce your public address with --announce-maddrs "
    "/ip4/PUBLIC_IP/tcp/{port}, or let relays carry it: --set network.use_auto_relay=true"
)


async def dialback_check(
    cfg: RunConfig, port: int | None, bootstraps: Sequence[str], timeout: float
) -> Check:
    """Listen where `noloco join` would and ask the first bootstrap that offers it to dial us back."""
    from hivemind.utils.multiaddr import Multiaddr

    from noloco_swarm.peer.net import lifetime

    net = cfg.network
    listen = [f"/ip4/0.0.0.0/tcp/{port}"] if port else list(net.host_maddrs)
    options = {"announce_maddrs": list(net.announce_maddrs)} if net.announce_maddrs else {}
    try:
        p2p = await lifetime.start_p2p(host_maddrs=listen, initial_peers=list(bootstraps), **options)
    except Exception as e:  # noqa: BLE001  (the daemon's own message says what is wrong)
        return Check("dial-back", False, f"could not listen on {listen}: {first_line(str(e))}", SETUP)
    try:
        ours = [str(a) for a in await p2p.get_visible_maddrs() if not relayed(a)]
        shown = (
            Multiaddr(ours[0]).value_for_protocol("tcp") if ours else (port or "PORT")
        )  # announced, if any
        for maddr in bootstraps:
            peer = Multiaddr(maddr).value_for_protocol("p2p")
            try:
                verdict = await ask_twice(p2p, peer, ours[: dialback.MAX_ADDRS], timeout)
            except Exception as e:  # noqa: BLE001  (a broken answer is as good as none)
                return Check("dial-back", False, f"{maddr} did not answer: {first_line(str(e))}", RETRY)
            if verdict is None:
                continue
            name = f"dial-back from {maddr}"
            if not verdict.tested:
                return Check(name, False, f"not tested: {verdict.detail}", UNTESTED)
            if verdict.ok:
                return Check(name, True, f"reached us at {', '.join(verdict.dialed)} on a fresh connection")
            tried = f" (tried {', '.join(verdict.dialed)})" if verdict.dialed else ""
            return Check(name, False, verdict.detail + tried, DIALBACK_FIX.format(port=shown))
    finally:
        await p2p.shutdown()
    return Check(
        "dial-back", True, "not checked: no answering bootstrap offers it (only noloco dht nodes do)"
    )


async def ask_twice(p2p: Any, peer: str, addrs: list[str], timeout: float) -> dialback.Verdict | None:
    """dialback.ask, asked once more (after the bootstrap's rate limit has passed) when the first
    answer did not come or says the bootstrap could not dial: one broken stream or one failed
    start of the bootstrap's dialer is no verdict on this machine. The second outcome stands."""
    try:
        verdict = await dialback.ask(p2p, peer, addrs, timeout)
        if verdict is None or verdict.tested:
            return verdict
    except Exception:  # noqa: BLE001  (asked again below; the second error is the one reported)
        pass
    await asyncio.sleep(dialback.RATE_SECONDS)
    return await dialback.ask(p2p, peer, addrs, timeout)
