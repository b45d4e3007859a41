"""Starting a hivemind DHT node with the options volunteers behind NATs need, and describing it."""

from __future__ import annotations

from collections.abc import Sequence

from noloco_swarm.peer import identity
from noloco_swarm.peer.directory import signed_dht_kwargs
from noloco_swarm.peer.lifetime import DHT
from noloco_swarm.train.config import NetworkConfig


def start_dht(net: NetworkConfig) -> DHT:
    """A running DHT node joined to `net.initial_peers` (an empty list starts a new swarm). It
    signs its records with its libp2p key, `dht.identity` (a fresh one without
    `net.identity_path`), and checks everyone's signatures."""
    with identity.identity_file(net.identity_path) as (path, fresh):
        me = identity.load(path)
        options = net.p2p_kwargs() | {"identity_path": path, "check_if_identity_free": not fresh}
        dht = DHT(
            initial_peers=list(net.initial_peers),
            start=True,
            client_mode=net.client_mode,
            **signed_dht_kwargs(me),
            **options,
        )
    dht.identity = me
    return dht


def _relayed(addr: str) -> bool:
    return "/p2p-circuit" in addr


def _loopback(addr: str) -> bool:
    return "/127.0.0.1/" in addr or "/::1/" in addr


def reachability(addresses: Sequence[str]) -> list[str]:
    """Human-readable lines: how others can reach a node at these addresses (direct or relayed)."""
    lines = []
    for addr in addresses:
        kind = "relayed" if _relayed(addr) else ("loopback only" if "/127.0.0.1/" in addr else "direct")
        lines.append(f"{addr}  ({kind})")
    if addresses and all(_loopback(a) for a in addresses):
        lines.append(
            "only loopback addresses: peers on other machines cannot reach this node; set --host-maddrs"
        )
    return lines or ["no visible addresses yet: the node is not reachable"]


def reachability_kind(addresses: Sequence[str]) -> str:
    """One line for a live view: how others can reach a node at these addresses."""
    direct = [a for a in addresses if not _relayed(a)]
    if not addresses:
        return "not reachable (no visible addresses)"
    if direct and all(_loopback(a) for a in direct):
        return "loopback only: peers on other machines cannot reach this node"
    if not direct:
        return f"through a relay only ({len(addresses)} relayed addresses)"
    return f"direct ({len(direct)} addresses" + (", relays too)" if len(direct) < len(addresses) else ")")
