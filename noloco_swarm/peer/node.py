"""Starting a hivemind DHT node with the options volunteers behind NATs need, and describing it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hivemind import DHT


@dataclass(frozen=True)
class NetworkConfig:
    """How a peer listens and is reached; maps one to one onto hivemind's P2P options."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of any live peers of the swarm (the bootstrap node prints one)."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Addresses to listen on; a fixed port (e.g. /ip4/0.0.0.0/tcp/31337) helps port forwarding."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses to announce instead of the listen ones (your public IP behind a forwarded port)."""
    identity_path: str | None = None
    """Private key file; keeps the peer id across restarts (created if missing)."""
    use_relay: bool = True
    """Let libp2p circuit relays carry our traffic when direct connections fail."""
    use_auto_relay: bool = False
    """Look for relays automatically and announce relayed addresses (for peers behind NAT)."""
    client_mode: bool = False
    """Do not accept incoming DHT requests (peers that cannot be reached at all)."""
    extra: dict[str, object] = field(default_factory=dict)

    def dht_kwargs(self) -> dict[str, object]:
        kwargs: dict[str, object] = {
            "host_maddrs": list(self.host_maddrs),
            "use_relay": self.use_relay,
            "use_auto_relay": self.use_auto_relay,
            "client_mode": self.client_mode,
            **self.extra,
        }
        if self.announce_maddrs:
            kwargs["announce_maddrs"] = list(self.announce_maddrs)
        if self.identity_path:
            kwargs["identity_path"] = self.identity_path
        return kwargs


def start_dht(net: NetworkConfig) -> DHT:
    """A running DHT node joined to `net.initial_peers` (an empty list starts a new swarm)."""
    return DHT(initial_peers=list(net.initial_peers), start=True, **net.dht_kwargs())


def reachability(addresses: Sequence[str]) -> list[str]:
    """Human-readable lines: how others can reach a node at these addresses (direct or relayed)."""
    lines = []
    for addr in addresses:
        kind = (
            "relayed" if "/p2p-circuit" in addr else ("loopback only" if "/127.0.0.1/" in addr else "direct")
        )
        lines.append(f"{addr}  ({kind})")
    if addresses and all("/127.0.0.1/" in a or "/::1/" in a for a in addresses):
        lines.append(
            "only loopback addresses: peers on other machines cannot reach this node; set --host-maddrs"
        )
    return lines or ["no visible addresses yet: the node is not reachable"]
