"""Closed runs: join tickets signed by the run's authority, and the gate that asks callers for one.

A run whose config names an `authority` (the text of an RSA public key, `noloco authority`)
admits only peers holding a JoinTicket for their own peer id, signed by that authority and not
expired (`noloco ticket`). A member puts its ticket in its DHT announcement; peers ignore the
announcements (and so the gone reports and the membership) of peers without a valid one, and
refuse their requests (`Gate`). libp2p authenticates the caller's peer id on every stream, so
another peer's ticket is worth nothing.

What a closed run still answers without a ticket: rpc_status (where a peer is: step, round,
loss), which joiners ask before they announce themselves and organisers ask with `noloco
status`; it carries no tensors and changes nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from noloco_swarm.peer.net.streams import Refused
from noloco_swarm.protocol import codec, records

OPEN_VERBS = ("rpc_status",)  # served to anyone, ticket or not
REFRESH_PERIOD = 2.0  # seconds: an unknown caller re-reads the directory at most this often


class TicketError(ValueError):
    """A ticket that does not admit its holder: the reason says what to fix."""


def public_key_text(key: RSAPrivateKey) -> str:
    """The authority's public key as the run's config holds it (OpenSSH text, one line)."""
    return key.get_public_key().to_bytes().decode()


def issue(authority: RSAPrivateKey, run_id: str, peer_id: str, expires: float) -> records.JoinTicket:
    """A ticket letting `peer_id` serve in `run_id` until `expires` (unix seconds)."""
    unsigned = records.JoinTicket(run_id, peer_id, expires)
    return records.JoinTicket(run_id, peer_id, expires, authority.sign(unsigned.signed_bytes()))


def check(ticket: records.JoinTicket, authority: str, run_id: str, peer_id: str, now: float) -> None:
    """Raise TicketError unless `ticket` lets `peer_id` serve in `run_id` at time `now`."""
    if ticket.run_id != run_id:
        raise TicketError(f"the ticket is for run {ticket.run_id!r}, not {run_id!r}")
    if ticket.peer_id != peer_id:
        raise TicketError(f"the ticket is for peer {ticket.peer_id}, not {peer_id}")
    if ticket.expires <= now:
        raise TicketError(f"the ticket expired {now - ticket.expires:.0f} s ago")
    if not _public_key(authority).verify(ticket.signed_bytes(), ticket.signature):
        raise TicketError("the ticket is not signed by this run's authority")


def check_public_key(text: str) -> None:
    """ValueError unless `text` is an RSA public key in OpenSSH form (the config's `authority`)."""
    try:
        _public_key(text)
    except (ValueError, TypeError, UnicodeError, UnsupportedAlgorithm) as e:
        raise ValueError(
            f"authority must be an RSA public key (ssh-rsa ..., from `noloco authority`): {e}"
        ) from e


def _public_key(text: str) -> RSAPublicKey:
    return RSAPublicKey.from_bytes(text.strip().encode())  # ValueError unless an OpenSSH RSA key


def read(path: str | Path) -> records.JoinTicket:
    """The ticket in `path` (as `noloco ticket` writes it); TicketError if it is not one."""
    try:
        return codec.decode(Path(path).read_bytes(), records.JoinTicket)
    except (OSError, codec.MessageError) as e:
        raise TicketError(f"{path} is not a join ticket: {e}") from e


def write(ticket: records.JoinTicket, path: str | Path) -> None:
    Path(path).write_bytes(codec.encode(ticket))


class Gate:
    """Who may call this peer in a closed run: peers whose ticket we have seen and checked.

    Tickets come from the announcements we read (`admit_announced`); an unknown caller makes us
    read the directory again (`refresh`, at most every REFRESH_PERIOD), since a joiner announces
    itself moments before it asks for state. Its `check` is the transport's gatekeeper."""

    def __init__(
        self,
        authority: str,
        run_id: str,
        refresh: Callable[[], Awaitable[object]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_public_key(authority)
        self.authority, self.run_id, self._refresh, self._clock = authority, run_id, refresh, clock
        self.expires: dict[str, float] = {}  # peer id -> when its ticket expires
        self._lock = asyncio.Lock()
        self._last_refresh = -float("inf")

    def admit_announced(self, announcement: records.PeerAnnouncement) -> bool:
        """Check the ticket in `announcement`; True (and its peer admitted) if it is valid."""
        try:
            ticket = codec.decode(announcement.ticket, records.JoinTicket)
            check(ticket, self.authority, self.run_id, announcement.peer_id, self._clock())
        except (codec.MessageError, TicketError):
            return False
        self.expires[announcement.peer_id] = max(self.expires.get(announcement.peer_id, 0.0), ticket.expires)
        return True

    def admits(self, peer_id: str) -> bool:
        return self.expires.get(peer_id, 0.0) > self._clock()

    async def check(self, peer_id: str, verb: str, header: codec.Message) -> None:
        """Raise Refused('no_ticket') unless `peer_id` may call `verb` here."""
        if verb in OPEN_VERBS or self.admits(peer_id):
            return
        async with self._lock:  # one directory read for a burst of unknown callers
            if not self.admits(peer_id) and time.monotonic() - self._last_refresh >= REFRESH_PERIOD:
                self._last_refresh = time.monotonic()
                await self._refresh()
        if not self.admits(peer_id):
            raise Refused(
                "no_ticket",
                f"run {self.run_id!r} is closed: {verb} needs a valid join ticket for {peer_id} "
                "in its announcement (ask the run's organiser for one: `noloco ticket`)",
            )
