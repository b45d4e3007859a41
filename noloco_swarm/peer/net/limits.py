"""What a request may carry, and how much of a peer one caller may hold, decided before any tensor
byte is read.

Two limits, both decided from the envelope alone (peer/net/streams.py), so that a refused request costs
its receiver a few hundred bytes of header and no allocation:

  per verb     `Accepts`, registered with the verb's handler: how many tensors its request may
               carry, of which dtypes, and how many bytes in all. Status, probe and state-fetch
               requests carry none (`NONE`); forward and eval rows follow from the run's shape
               (`rows`); an exchange carries at most the stage's weights (`weights`). A request
               carrying other tensors is refused as 'undeclared_tensors', one carrying more bytes
               as 'too_large'.
  per caller   `Admission`: inbound streams open and tensor bytes being received (or held by a
               handler) per caller, and in all, against TransportConfig's caps; beyond one the
               request is refused at once as 'busy'. The caller is the libp2p peer id that p2pd
               authenticated for the stream, never anything a message claims.

Pure bookkeeping: no I/O and no clock (the transport owns the deadlines).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from noloco_swarm.peer.net.streams import Refused, TransportConfig
from noloco_swarm.protocol.codec import WIRE_DTYPES, TensorMeta
from noloco_swarm.protocol.rpc import MAX_ENVELOPE_TENSORS

# Rows one forward request may carry, in batches of the run: a replica of stage s holds about
# B * D_0 / D_s rows per step, so with uneven stages one request can carry several batches' rows
# (every row of a position comes from a different stage-0 origin). 16 covers a stage-0 with 16x
# the replicas of a later stage; a swarm more lopsided than that has that stage's rows refused.
ROW_MARGIN = 16


@dataclass(frozen=True)
class Accepts:
    """The tensors one verb's request may carry. The default carries none."""

    max_tensors: int = 0
    """Most tensors one request may carry."""
    max_bytes: int = 0
    """Most raw tensor bytes one request may carry, all its tensors together."""
    dtypes: frozenset[str] = frozenset()
    """The dtypes its tensors may have (names as in TensorMeta); empty: any."""
    direct_only: bool = False
    """A bulk verb (an outer exchange, a state chunk): refused on a stream that came through a
    circuit relay, whose link is a third peer's (peer/net/transport.py's `call(direct=True)`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_tensors <= MAX_ENVELOPE_TENSORS:
            raise ValueError(f"max_tensors must be within 0..{MAX_ENVELOPE_TENSORS}, got {self.max_tensors}")
        if self.max_bytes < 0 or (self.max_tensors == 0 and self.max_bytes):
            raise ValueError("max_bytes must be >= 0, and 0 for a request that carries no tensors")

    @classmethod
    def rows(cls, rows: int, seq_len: int, width: int, wire_format: str) -> Accepts:
        """Activation rows and their token ids (rpc_forward, rpc_eval): at most `rows` rows of
        (seq_len, width) in `wire_format` (with an int8 payload, its float32 scale per position),
        and their int64 token ids; subspace rows (width k) carry seq_len + 1 int32 ids each."""
        if wire_format == "subspace":
            return cls(2, rows * (seq_len * width * 2 + (seq_len + 1) * 4), frozenset({"bfloat16", "int32"}))
        payload = WIRE_DTYPES[wire_format]
        item = {"float32": 4, "bfloat16": 2, "int8": 1}[payload]
        scale = 4 if wire_format == "int8" else 0
        dtypes = {payload, "int64"} | ({"float32"} if scale else set())
        return cls(3, rows * seq_len * (width * item + scale + 8), frozenset(dtypes))

    @classmethod
    def weights(cls, numel: int) -> Accepts:
        """An outer exchange: the stage's flat fp32 weights, theta and (when gamma != beta) phi."""
        return cls(2, 2 * 4 * numel, frozenset({"float32"}), direct_only=True)

    def check(self, metas: Sequence[TensorMeta], verb: str) -> None:
        """Raise Refused unless a request to `verb` may carry tensors `metas`."""
        if not metas:
            return
        if len(metas) > self.max_tensors:
            carries = f"at most {self.max_tensors}" if self.max_tensors else "none"
            raise Refused(
                "undeclared_tensors", f"{verb} carries {carries} tensors; the request announces {len(metas)}"
            )
        other = sorted({m.dtype for m in metas} - self.dtypes) if self.dtypes else []
        if other:
            raise Refused("undeclared_tensors", f"{verb} carries {sorted(self.dtypes)}, not {other}")
        nbytes = sum(m.nbytes for m in metas)
        if nbytes > self.max_bytes:
            raise Refused(
                "too_large",
                f"{verb} carries at most {self.max_bytes} tensor bytes; the request announces {nbytes}",
            )


NONE = Accepts()


def caps_for(microbatches: int) -> TransportConfig:
    """The transport's caps for a peer of a run with `microbatches` per step: a sender keeps a
    stream open per microbatch in flight, and one per resend of a microbatch whose stream broke
    (up to 3 sends, peer/sending.py), beside its probes; so a caller's stream cap grows with M."""
    default = TransportConfig()
    need = 4 * microbatches + 16
    return dataclasses.replace(
        default,
        max_peer_streams=max(default.max_peer_streams, need),
        max_streams=max(default.max_streams, 16 * need),
    )


class Admission:
    """Inbound streams being served, streams kept for reuse, and tensor bytes held, per caller
    and in all, against the caps of a TransportConfig. A new stream's slot is taken before its
    first byte is read, a kept stream's once its next envelope is in; bytes once the envelope is
    checked, until the handler returns."""

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self.streams: dict[str, int] = {}  # caller -> streams being served
        self.kept: dict[str, int] = {}  # caller -> streams kept open between its requests
        self.held: dict[str, int] = {}  # caller -> tensor bytes being received or held
        self.total_streams = self.total_kept = self.total_bytes = 0

    @contextlib.contextmanager
    def keep(self, peer: str) -> Iterator[bool]:
        """Keep one stream of `peer`'s open for its next request, if within the caps (False: it
        closes instead). Pure counting: a kept stream costs a task and the daemon's stream."""
        if (
            self.kept.get(peer, 0) >= self.config.max_peer_kept_streams
            or self.total_kept >= self.config.max_streams
        ):
            yield False
            return
        self.kept[peer] = self.kept.get(peer, 0) + 1
        self.total_kept += 1
        try:
            yield True
        finally:
            self.total_kept -= 1
            self._drop(self.kept, peer, 1)

    @contextlib.contextmanager
    def stream(self, peer: str) -> Iterator[None]:
        """Hold one stream slot of `peer`'s; Refused('busy') if it or all callers have too many."""
        cfg, open_now = self.config, self.streams.get(peer, 0)
        if open_now >= cfg.max_peer_streams:
            raise Refused("busy", f"this peer serves {open_now} streams of yours already; retry shortly")
        if self.total_streams >= cfg.max_streams:
            raise Refused("busy", f"this peer serves {self.total_streams} streams already; retry shortly")
        self.streams[peer] = open_now + 1
        self.total_streams += 1
        try:
            yield
        finally:
            self.total_streams -= 1
            self._drop(self.streams, peer, 1)

    @contextlib.contextmanager
    def reserve(self, peer: str, nbytes: int) -> Iterator[None]:
        """Hold `nbytes` of tensors from `peer`; Refused('busy') over its cap or the total cap."""
        cfg, held = self.config, self.held.get(peer, 0)
        if held + nbytes > cfg.max_peer_inflight_bytes:
            raise Refused("busy", f"receiving {held} bytes of yours already; retry shortly")
        if self.total_bytes + nbytes > cfg.max_inflight_bytes:
            raise Refused("busy", f"receiving {self.total_bytes} bytes already; retry shortly")
        if nbytes == 0:
            yield
            return
        self.held[peer] = held + nbytes
        self.total_bytes += nbytes
        try:
            yield
        finally:
            self.total_bytes -= nbytes
            self._drop(self.held, peer, nbytes)

    @staticmethod
    def _drop(counts: dict[str, int], peer: str, n: int) -> None:
        left = counts[peer] - n
        if left:
            counts[peer] = left
        else:
            del counts[peer]  # no entry per caller that has nothing open: the tables stay small
