"""The RPC schemas: the header of each protocol verb's request and reply, and the envelope that
opens every transport stream.

Named after the verbs: forward, backward, exchange, fetch_state, fetch_chunk, status, records,
neighbourhood, eval. Each is a message of the codec (codec.py); the tensors a header declares
stream beside it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import ClassVar

from noloco_swarm.protocol.codec import Message, TensorMeta, check_counters, check_run_id, wire_format
from noloco_swarm.protocol.plan import exchange_key


@dataclass(frozen=True)
class ForwardHeader(Message):
    """Activations of `samples` leaving stage `hop` for stage `hop + 1`; token ids ride along."""

    TAG: ClassVar[str] = "forward"
    run_id: str
    round: int
    step: int
    hop: int
    sender_rank: int
    samples: tuple[int, ...]
    activations: TensorMeta
    tokens: TensorMeta
    view: str = ""  # digest of the sender's membership view of `round`; a mismatch is refused
    scale: TensorMeta | None = None  # int8 activations' per-row scales (wire_format)
    # Routing around gone replicas (protocol.plan, StepPlan.around): the ranks of stage `hop`
    # whose rows the sender holds as their stand-in (on stage 0: read from their shards), and the
    # ranks of stage hop + 1 it routes around (their rows come to their stand-ins). Both empty on
    # a healthy swarm.
    stands_in_for: tuple[int, ...] = ()
    routes_around: tuple[int, ...] = ()
    # The first `carried` samples are rows of the step before, lost there and fed again with
    # this step's (peer/carry.py); they ride with at least one row of this step. 0 when healthy.
    carried: int = 0

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.round, self.step, self.hop, self.sender_rank)
        _check_samples(self.samples, self.activations, self.tokens, windows=True)
        wire_format(self.activations, self.scale)
        if self.tokens.dtype == "int32" and self.activations.dtype != "bfloat16":
            raise ValueError("int32 token ids (windows) ride only with subspace rows, which are bfloat16")
        if not 0 <= self.carried < len(self.samples):
            raise ValueError(f"carried must be >= 0 and leave a row of this step, got {self.carried}")
        for name in ("stands_in_for", "routes_around"):
            ranks = getattr(self, name)
            if any(r < 0 for r in ranks) or list(ranks) != sorted(set(ranks)):
                raise ValueError(f"{name} must be ascending, distinct ranks >= 0, got {list(ranks)}")
        if self.sender_rank in self.stands_in_for:
            raise ValueError("a sender stands in only for other replicas of its stage, not itself")

    @property
    def tensors(self) -> tuple[TensorMeta, ...]:
        """The tensors that follow, in order: the activations' wire tensors, then the token ids."""
        return (self.activations, *([self.scale] if self.scale else []), self.tokens)


@dataclass(frozen=True)
class BackwardHeader(Message):
    """Gradients w.r.t. the activations of `samples`, returning from stage `hop + 1` to `hop`."""

    TAG: ClassVar[str] = "backward"
    run_id: str
    round: int
    step: int
    hop: int
    sender_rank: int
    samples: tuple[int, ...]
    grad: TensorMeta
    losses: tuple[float, ...] = ()
    scale: TensorMeta | None = None  # int8 gradients' per-row scales (wire_format)
    # Ranks of stage `hop` that failed the answering replica (it stops waiting for their rows):
    # a stage-0 replica that hears of a gone one probes it and stands in for it (peer/detours.py).
    gone: tuple[int, ...] = ()
    # Which of `samples` (indices into it) a later stage lost: their gradient rows are zero and
    # their losses 0.0 stand-ins, to be left out of the sender's losses too.
    lost: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.round, self.step, self.hop, self.sender_rank)
        _check_samples(self.samples, self.grad, None)
        wire_format(self.grad, self.scale)
        if self.losses and len(self.losses) != len(self.samples):
            raise ValueError("losses must have one entry per sample")
        if any(r < 0 for r in self.gone) or list(self.gone) != sorted(set(self.gone)):
            raise ValueError(f"gone must be ascending, distinct ranks >= 0, got {list(self.gone)}")
        if list(self.lost) != sorted(set(self.lost)) or any(
            not 0 <= i < len(self.samples) for i in self.lost
        ):
            raise ValueError(f"lost must be ascending, distinct indices into samples, got {list(self.lost)}")

    @property
    def tensors(self) -> tuple[TensorMeta, ...]:
        """The tensors that follow, in order: the gradients' wire tensors."""
        return (self.grad, *([self.scale] if self.scale else []))


@dataclass(frozen=True)
class ExchangeHeader(Message):
    """Opens an outer exchange: which weights follow (theta, or theta and phi), in parts.

    Phase 0 is a whole-vector exchange (NoLoCo's pairs, DiLoCo with two replicas). DiLoCo with
    more replicas all-reduces in two phases: 1 sends each member the shard of theta it averages
    ("theta_shard"), 2 sends everyone the averaged shard this member owns ("mean_shard").
    """

    TAG: ClassVar[str] = "exchange"
    run_id: str
    round: int
    step: int
    stage: int
    sender_rank: int
    parts: tuple[str, ...]
    meta: TensorMeta
    chunk_bytes: int
    phase: int = 0

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.round, self.step, self.stage, self.sender_rank)
        allowed = {0: (("theta",), ("theta", "phi")), 1: (("theta_shard",),), 2: (("mean_shard",),)}
        if self.phase not in allowed or self.parts not in allowed[self.phase]:
            raise ValueError(f"phase {self.phase} cannot carry parts {self.parts}")
        if len(self.meta.shape) != 1:
            raise ValueError("exchanged weights travel as one flat vector")
        if not 1 <= self.chunk_bytes <= 64 << 20:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} is outside 1 B .. 64 MiB")

    @property
    def key(self) -> tuple[int, ...]:
        """The exchange this header belongs to: (round, step), plus the phase after phase 0.
        Keys order in time: (r, t) < (r, t, 1) < (r, t, 2) < (r, t + H)."""
        return exchange_key(self.round, self.step, self.phase)


@dataclass(frozen=True)
class Decline(Message):
    """The caller of an exchange will not call: it avoids the callee (it rejected the callee's
    outer weights lately) or reaches it only through a relay, and the callee may step without it
    at once. Names the exchange as its header
    would; answered with an Ack."""

    TAG: ClassVar[str] = "decline"
    run_id: str
    round: int
    step: int
    stage: int
    phase: int = 0

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.round, self.step, self.stage)
        if self.phase not in (0, 1, 2):
            raise ValueError(f"an exchange has phases 0, 1 and 2, not {self.phase}")

    @property
    def key(self) -> tuple[int, ...]:
        return exchange_key(self.round, self.step, self.phase)


@dataclass(frozen=True)
class StateRequest(Message):
    """A peer joining at `round` asks a live replica of `stage` for the manifest of the state it
    keeps for it: of the boundary before `round` if the replica read the joiner's announcement
    there, else of `round`'s own. With `admitted` (the joiner holds that state already) the
    replica answers once it has built its view of `round`, which must admit the joiner."""

    TAG: ClassVar[str] = "fetch_state"
    run_id: str
    stage: int
    round: int = 0
    admitted: bool = False

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.stage, self.round)


STATE_PARTS = ("phi", "delta", "exp_avg", "exp_avg_sq")
MAX_CHUNK_ELEMENTS = 16 << 20  # 64 MiB of fp32: no state chunk (one reply) is bigger


def _is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class StateManifest(Message):
    """The state a replica keeps for a joiner: what it held at inner step `step`, a round boundary
    (after the outer step there).

    The state is STATE_PARTS, each a flat fp32 vector of `numel` values (phi: the weights, = theta
    at a boundary; delta: outer momentum; the AdamW moments), cut into chunks of `chunk_elements`
    values that never straddle two parts (protocol/chunks.py). `chunks` is each chunk's BLAKE3, in
    order. `view` is the server's membership of `round` (sorted peer ids per stage): the round
    the state starts, or the joiner's round when the joiner asks for its entry view. `state_hash`
    is the hash of the weights phi loads into. `snapshot` names the state's content, so two
    replicas that hold the same bytes (and counters) announce the same snapshot.
    """

    TAG: ClassVar[str] = "state_manifest"
    run_id: str
    stage: int
    round: int
    step: int
    view: tuple[tuple[str, ...], ...]
    adam_step: int
    state_hash: str
    numel: int
    chunk_elements: int
    chunks: tuple[str, ...]

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.stage, self.round, self.step, self.adam_step)
        if not 0 <= self.stage < len(self.view):
            raise ValueError(f"stage {self.stage} is outside the view's {len(self.view)} stages")
        if self.numel < 1 or not 1 <= self.chunk_elements <= MAX_CHUNK_ELEMENTS:
            raise ValueError(f"bad layout: {self.numel} values per part in chunks of {self.chunk_elements}")
        per_part = -(-self.numel // self.chunk_elements)
        if len(self.chunks) != len(STATE_PARTS) * per_part:
            raise ValueError(f"{len(self.chunks)} chunk hashes, the layout has {len(STATE_PARTS) * per_part}")
        if not all(_is_digest(h) for h in (self.state_hash, *self.chunks)):
            raise ValueError("hashes must be 64 lowercase hex digits (BLAKE3, sha256)")

    @property
    def snapshot(self) -> str:
        """sha256 of the state's content: layout, counters and chunk hashes (not who serves it)."""
        head = f"{self.numel}/{self.chunk_elements}/{self.step}/{self.adam_step}/{self.state_hash}/"
        return hashlib.sha256(head.encode() + "".join(self.chunks).encode()).hexdigest()


@dataclass(frozen=True)
class ChunkRequest(Message):
    """A joiner asks for chunk `index` of the snapshot named `snapshot` (from the server's manifest)."""

    TAG: ClassVar[str] = "fetch_chunk"
    run_id: str
    stage: int
    round: int
    snapshot: str
    index: int

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.stage, self.round, self.index)
        if not _is_digest(self.snapshot):
            raise ValueError("snapshot must be a manifest's sha256 digest")


@dataclass(frozen=True)
class StateChunk(Message):
    """Chunk `index` of snapshot `snapshot`: one flat fp32 tensor of `meta`'s shape follows."""

    TAG: ClassVar[str] = "state_chunk"
    run_id: str
    stage: int
    round: int
    snapshot: str
    index: int
    meta: TensorMeta

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.stage, self.round, self.index)
        if not _is_digest(self.snapshot):
            raise ValueError("snapshot must be a manifest's sha256 digest")
        if len(self.meta.shape) != 1 or self.meta.dtype != "float32" or self.meta.numel > MAX_CHUNK_ELEMENTS:
            raise ValueError(
                f"a state chunk is flat float32 of at most {MAX_CHUNK_ELEMENTS}, got {self.meta}"
            )


@dataclass(frozen=True)
class StatusRequest(Message):
    """Ask a peer where it is: answered with a PeerStatus."""

    TAG: ClassVar[str] = "status"
    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)


@dataclass(frozen=True)
class PeerStatus(Message):
    """A peer's progress, for joiners picking their round and for `noloco status`."""

    TAG: ClassVar[str] = "peer_status"
    run_id: str
    peer_id: str
    stage: int
    step: int
    round: int
    rank: int
    outer_steps: int
    tokens: int
    loss: float | None = None
    resuming: bool = False  # restarted from a checkpoint and waiting for its round's other members
    resumed_from: int | None = None  # the checkpoint's step this peer's swarm restarted from
    # (step, microbatch) of the last rows it took out of collection: it takes no new rows of that
    # microbatch or an earlier one (empty: none yet, or not a stage that receives rows).
    collected: tuple[int, ...] = ()
    # The round this process joins at while it holds no view (a new peer, or one restarted under
    # the same id): an older membership of its id exchanges nothing before it, and will not call.
    joining_at: int | None = None
    # Whom it routes rows around in round `around_round` of its views (-1: none said), as its
    # forward headers say: the ranks of the next stage that failed it (it sends their rows to
    # stand-ins until the boundary that weighs its reports), and on stage 0 the ranks of its own
    # stage it stands in for. A receiver waiting for its rows learns from this what it will send.
    around_round: int = -1
    routes_around: tuple[int, ...] = ()
    stands_in: tuple[int, ...] = ()
    # The (step, microbatch) whose rows it sent on last (empty: none yet), and the ranks of the
    # next stage it sent them to: a receiver not among them gets nothing of that microbatch.
    sent: tuple[int, ...] = ()
    sent_to: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.stage, self.step, self.round, self.outer_steps, self.tokens, *self.collected)
        check_counters(*self.routes_around, *self.stands_in, *self.sent, *self.sent_to)
        if len(self.sent) not in (0, 2):
            raise ValueError(f"sent is a (step, microbatch) pair, got {self.sent}")
        if self.around_round < -1:
            raise ValueError(f"around_round must be >= -1, got {self.around_round}")
        if self.joining_at is not None:
            check_counters(self.joining_at)
        if len(self.collected) not in (0, 2):
            raise ValueError(f"collected is a (step, microbatch) pair, got {self.collected}")


@dataclass(frozen=True)
class PassedRecords(Message):
    """Membership records passed between members (peer/passing.py), as a request and as its reply:
    encoded `records.Sealed`, each checked on its own (a bad one is skipped, not the rest).
    `session` names the sender's process, so a receiver that sees a new one knows the sender
    restarted and has forgotten what it was passed."""

    TAG: ClassVar[str] = "records"
    run_id: str
    session: bytes
    records: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if len(self.session) != SESSION_BYTES:
            raise ValueError(f"session must be {SESSION_BYTES} bytes, got {len(self.session)}")


SESSION_BYTES = 8


@dataclass(frozen=True)
class NeighbourhoodRequest(Message):
    """A joiner of `stage` asks a member whom to join with (peer/neighbourhood.py): answered with a
    Neighbourhood, or refused by a peer that holds no view."""

    TAG: ClassVar[str] = "neighbourhood"
    run_id: str
    stage: int

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.stage)


@dataclass(frozen=True)
class Neighbourhood(Message):
    """A member's answer to a joiner of `stage`: its latest view (`round`, `view`: sorted peer ids
    per stage), the announced addresses it knows of the members of `stage` and the stages next to
    it (`peers[i]` at `addresses[i]`, the member itself among them), the sealed announcements
    of the joiners it holds (records.Sealed, each checked on its own by the joiner), and the
    members of its view it holds for gone since the view's round began (reported, or failed it):
    the view drops them only at a later boundary, and --stage auto must not count them."""

    TAG: ClassVar[str] = "neighbourhood_reply"
    run_id: str
    stage: int
    round: int
    view: tuple[tuple[str, ...], ...]
    peers: tuple[str, ...] = ()
    addresses: tuple[tuple[str, ...], ...] = ()
    joining: tuple[bytes, ...] = ()
    gone: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.stage, self.round)
        if not 0 <= self.stage < len(self.view):
            raise ValueError(f"stage {self.stage} is outside the view's {len(self.view)} stages")
        if len(self.peers) != len(self.addresses):
            raise ValueError(f"{len(self.peers)} peers with {len(self.addresses)} address lists")


@dataclass(frozen=True)
class ErrorReply(Message):
    """A refusal with a reason a volunteer can act on."""

    TAG: ClassVar[str] = "error"
    code: str
    reason: str


@dataclass(frozen=True)
class Ack(Message):
    """A reply with no fields of its own: "done", plus whatever tensors its envelope announces."""

    TAG: ClassVar[str] = "ack"
    note: str = ""
    # An exchange's confirmation and receipt: bytes/s the other side's tensors arrived at, as
    # measured here (peer/net/uplink.py); 0: not measured.
    rate: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.rate < math.inf:
            raise ValueError(f"rate must be a finite number of bytes/s >= 0, got {self.rate}")


# ---------------------------------------------------------------------------------------------
# Transport framing

REPLY_VERB = "reply"
MAX_ENVELOPE_TENSORS = 64


@dataclass(frozen=True)
class Envelope(Message):
    """Opens one direction of a transport stream: verb, encoded header, and the tensors that follow.

    The receiver checks `tensors` against its byte limit and against the metas the header declares,
    allocates one buffer per tensor, and then reads exactly `nbytes` raw little-endian bytes into them.
    """

    TAG: ClassVar[str] = "envelope"
    verb: str
    header: bytes
    tensors: tuple[TensorMeta, ...] = ()

    def __post_init__(self) -> None:
        name = self.verb.removeprefix("rpc_")
        if self.verb != REPLY_VERB and (
            name == self.verb or not name.replace("_", "").isalnum() or not name.isascii()
        ):
            raise ValueError(f"verb {self.verb!r} must be {REPLY_VERB!r} or rpc_<name>")
        if len(self.tensors) > MAX_ENVELOPE_TENSORS:
            raise ValueError(f"{len(self.tensors)} tensors is over the limit of {MAX_ENVELOPE_TENSORS}")

    @property
    def nbytes(self) -> int:
        """Raw tensor bytes that follow this envelope on the stream."""
        return sum(meta.nbytes for meta in self.tensors)


def _check_samples(
    samples: tuple[int, ...], data: TensorMeta, tokens: TensorMeta | None, *, windows: bool = False
) -> None:
    """`windows`: the token ids may also be int32 windows, one id more than positions (the
    subspace format's inputs and targets, protocol/wire.py Boundary)."""
    # Rows travel in (position, origin) order, so sample indices never decrease; one repeats when
    # rows of two stage-0 origins reach one replica (uneven replica counts, see protocol.plan).
    if not samples or samples[0] < 0 or list(samples) != sorted(samples):
        raise ValueError("samples must be a non-empty, ascending list of non-negative indices")
    if not data.shape or data.shape[0] != len(samples):
        raise ValueError(f"tensor {data.shape} does not have one row per sample ({len(samples)})")
    if tokens is not None:
        dtypes = ("int64", "int32") if windows else ("int64",)
        if tokens.dtype not in dtypes or len(tokens.shape) != 2 or tokens.shape[0] != len(samples):
            raise ValueError(f"token ids must be int64 (samples, seq) or int32 windows, got {tokens}")
        extra = 1 if tokens.dtype == "int32" else 0  # a window holds the inputs' first id too
        if len(data.shape) >= 2 and data.shape[1] + extra != tokens.shape[1]:
            raise ValueError("activations and token ids disagree on sequence length")


# ---------------------------------------------------------------------------------------------
# Evaluation along a replica's own fixed path (each stage-s replica q sends to replica q of s+1)


@dataclass(frozen=True)
class EvalHeader(Message):
    """Validation activations (and their token ids) for the next stage of the same-rank path."""

    TAG: ClassVar[str] = "eval"
    run_id: str
    step: int
    hop: int
    rank: int
    batch: int
    activations: TensorMeta
    tokens: TensorMeta

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_counters(self.step, self.hop, self.rank, self.batch)
        _check_samples(
            tuple(range(self.activations.shape[0] if self.activations.shape else 0)),
            self.activations,
            self.tokens,
        )


@dataclass(frozen=True)
class EvalReply(Message):
    """Per-sample mean token losses of an evaluated batch, from the last stage."""

    TAG: ClassVar[str] = "eval_reply"
    losses: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.losses:
            raise ValueError("an eval reply needs at least one loss")
