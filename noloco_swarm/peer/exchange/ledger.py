"""The bytes of each outer exchange, per partner, from the transport's counters."""

from __future__ import annotations

from noloco_swarm.peer.net.transport import Transport


class ByteLedger:
    """Bytes (framing included) moved with each partner since our previous outer step with it.

    Only outer exchanges (and a joiner's one state fetch, which `exclude` keeps out) flow between
    replicas of one stage, so the growth of those peers' counters is this exchange's traffic,
    including what an early partner streamed to us before we reached the step, and calls made
    again after a broken stream. Where replicas do not wait for each other between outer steps
    (one stage), a partner may start streaming the next exchange before we settle this one: its
    bytes then count here instead of there, and only the sum over exchanges is exact.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._seen: dict[str, tuple[int, int]] = {}

    def settle(self, peers: list[str]) -> tuple[int, int]:
        """(sent, received) with `peers` since the last settlement; marks them settled."""
        counts = self.transport.byte_counts()
        sent = received = 0
        for peer in peers:
            now = counts.get(peer, {})
            seen = self._seen.get(peer, (0, 0))
            sent += now.get("sent_total", 0) - seen[0]
            received += now.get("received_total", 0) - seen[1]
            self._seen[peer] = (now.get("sent_total", 0), now.get("received_total", 0))
        return sent, received

    def exclude(self, peer: str, sent: int) -> None:
        """Keep `sent` bytes (state served to a joiner) out of the next exchange's count."""
        seen = self._seen.get(peer, (0, 0))
        self._seen[peer] = (seen[0] + sent, seen[1])

    def reset(self) -> None:
        """After joining: everything moved so far was the state fetch, no outer exchange."""
        self._seen = {}
        self.settle(list(self.transport.byte_counts()))
