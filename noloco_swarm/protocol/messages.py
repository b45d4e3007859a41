"""Frozen, versioned message and DHT-record schemas, and their msgpack codec.

Every message is a frozen dataclass registered under a short tag. `encode` writes
`{"v": PROTOCOL_VERSION, "t": tag, "b": {field: value}}` with msgpack; `decode` checks the
version, the tag, every field's presence and type (from the annotations), and the class's own
`__post_init__` rules, and raises `MessageError` for anything else. A peer treats that error as
"they sent garbage" and drops the message; it never crashes or touches state.

Tensor bytes travel beside these headers (streamed in parts); `TensorMeta` describes them and
`decode_tensor` checks shape, dtype, size and finiteness before any of them is used.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

import msgpack
import torch

# 2: forward and backward rows in a wire format (fp32, bf16, int8 + scale); 3: forward headers say
# which gone replicas their rows are routed around; 4: stage 0 stands in for its gone replicas
# (a version-3 stage 1 would refuse their rows), told of them in backward headers (`gone`);
# 5: backward headers name the rows a later stage lost (`lost`), and forward headers the rows of
# the step before that stage 0 feeds again (`carried`); 6: status answers say which microbatch
# a receiver collected last (`collected`), so a peer that fell behind sends it nothing stale
PROTOCOL_VERSION = 6
MAX_MESSAGE_BYTES = 1 << 20  # headers only; tensor payloads are streamed separately
MAX_SEQUENCE = 1 << 16
MAX_STRING = 4096
MAX_DIMS = 8
MAX_TENSOR_ELEMENTS = 1 << 34


class MessageError(ValueError):
    """A received message or tensor is malformed: the sender's fault, never ours."""


_REGISTRY: dict[str, type[Message]] = {}
M = TypeVar("M", bound="Message")


class Message:
    """Base of every wire message and DHT record; subclasses are frozen dataclasses with a TAG."""

    TAG: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.TAG:
            raise TypeError(f"{cls.__name__} needs a TAG")
        if cls.TAG in _REGISTRY:
            raise TypeError(f"tag {cls.TAG!r} is used by {_REGISTRY[cls.TAG].__name__}")
        _REGISTRY[cls.TAG] = cls


def encode(message: Message) -> bytes:
    """Serialise a message with its version and tag."""
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "t": message.TAG, "b": message}, use_bin_type=True, default=_to_wire
    )


def decode(data: bytes, expected: type[M] | None = None) -> M:
    """Parse and validate bytes into a message; `expected` narrows the accepted type."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MessageError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        raw = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES, max_array_len=MAX_SEQUENCE
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise MessageError(f"not a msgpack message: {e}") from e
    if not isinstance(raw, dict) or set(raw) != {"v", "t", "b"}:
        raise MessageError("message must be a map with exactly the keys v, t, b")
    if raw["v"] != PROTOCOL_VERSION:
        raise MessageError(
            f"protocol version {raw['v']!r} is not ours ({PROTOCOL_VERSION}); upgrade one side"
        )
    cls = _REGISTRY.get(raw["t"]) if isinstance(raw["t"], str) else None
    if cls is None:
        raise MessageError(f"unknown message type {raw['t']!r}")
    if expected is not None and cls is not expected:
        raise MessageError(f"expected a {expected.TAG!r} message, got {cls.TAG!r}")
    return _build(cls, raw["b"])  # type: ignore[return-value]


def _to_wire(value: object) -> dict[str, object]:
    """A message (or a dataclass field of one) as the map of its fields, in field order: msgpack
    calls this for every dataclass it meets (and packs tuples as lists itself)."""
    names = _names(type(value)) if dataclasses.is_dataclass(value) else None
    if names is None:
        raise TypeError(f"cannot put a {type(value).__name__} on the wire")
    return {name: getattr(value, name) for name in names}


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


# A field's decoder: (wire value, where it is, for errors) -> the checked value.
Decoder = Callable[[object, str], object]


def _build(cls: type, body: object) -> Any:
    if not isinstance(body, dict):
        raise MessageError(f"{cls.__name__}: body must be a map")
    fields_ = _layout(cls)
    if len(body) != len(fields_) or not all(name in body for name, _, _ in fields_):
        names = {name for name, _, _ in fields_}
        missing, extra = names - set(body), set(body) - names
        raise MessageError(
            f"{cls.__name__}: missing fields {sorted(missing)}, unknown fields {sorted(extra)}"
        )
    values = {name: decoder(body[name], where) for name, where, decoder in fields_}
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        raise MessageError(f"{cls.__name__}: {e}") from e


@functools.cache
def _layout(cls: type) -> tuple[tuple[str, str, Decoder], ...]:
    """A message class's fields, resolved once: (name, where (for errors), decoder). Resolving the
    annotations and walking the type of every field on each message was most of decoding's time
    (a peer decodes a few headers per microbatch)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, f"{cls.__name__}.{f.name}", _decoder(hints[f.name])) for f in dataclasses.fields(cls)
    )


@functools.cache
def _decoder(hint: Any) -> Decoder:
    """The decoder of values of type `hint` (bool, int, float, str, bytes, a dataclass, Optional
    and tuples of these); TypeError for any other type (a schema bug, not bad input)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        inner = [o for o in options if o is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"{hint!r}: only Optional[X] unions are supported")
        item = _decoder(inner[0])
        if type(None) not in options:
            return item
        return lambda value, where: None if value is None else item(value, where)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return _sequence_of(args[0])
        return _record_of(args)
    if hint in _SCALARS:
        return _SCALARS[hint]
    if dataclasses.is_dataclass(hint):
        return lambda value, where: _build(hint, value)
    raise TypeError(f"unsupported field type {hint!r}")


def _list(value: object, where: str) -> list[object]:
    if not isinstance(value, list | tuple) or len(value) > MAX_SEQUENCE:
        raise MessageError(f"{where}: expected a list")
    return value  # type: ignore[return-value]


def _sequence_of(hint: Any) -> Decoder:
    item = _decoder(hint)
    exact = hint if hint in (int, float) else None  # items of exactly this type need no checks

    def decode(value: object, where: str) -> tuple[object, ...]:
        items = _list(value, where)
        if (
            exact is not None
            and all(type(v) is exact for v in items)
            and (exact is not float or all(map(math.isfinite, items)))
        ):
            return tuple(items)
        inner = f"{where}[]"
        return tuple(item(v, inner) for v in items)

    return decode


def _record_of(hints: tuple[Any, ...]) -> Decoder:
    items = [_decoder(h) for h in hints]

    def decode(value: object, where: str) -> tuple[object, ...]:
        values = _list(value, where)
        if len(values) != len(items):
            raise MessageError(f"{where}: expected {len(items)} items, got {len(values)}")
        return tuple(item(v, f"{where}[{i}]") for i, (item, v) in enumerate(zip(items, values, strict=True)))

    return decode


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise MessageError(f"{where}: expected a bool, got {type(value).__name__}")
    return value


def _int(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise MessageError(f"{where}: expected an int, got {type(value).__name__}")
    return value


def _float(value: object, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise MessageError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _str(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_STRING:
        raise MessageError(f"{where}: expected a string of at most {MAX_STRING} characters")
    return value


def _bytes(value: object, where: str) -> bytes:
    if not isinstance(value, bytes):
        raise MessageError(f"{where}: expected bytes")
    return value


_SCALARS: dict[type, Decoder] = {bool: _bool, int: _int, float: _float, str: _str, bytes: _bytes}


# ---------------------------------------------------------------------------------------------
# Tensors

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
}


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor whose raw bytes travel beside a header."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if len(self.shape) > MAX_DIMS or any(d < 0 for d in self.shape):
            raise ValueError(f"bad shape {self.shape}")
        if self.numel > MAX_TENSOR_ELEMENTS:
            raise ValueError(f"tensor of {self.numel} elements is over the limit")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _DTYPES[self.dtype].itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        name = str(tensor.dtype).removeprefix("torch.")
        return cls(shape=tuple(tensor.shape), dtype=name)


# Activations and their gradients cross in one of three formats (protocol/wire.py, `wire.activations`):
# the payload's dtype names it, and int8 rows carry a float32 scale per row of the last dimension.
WIRE_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}


def wire_format(payload: TensorMeta, scale: TensorMeta | None) -> str:
    """The wire format that a header's payload and scale metas describe; ValueError if none."""
    fmt = next((f for f, dtype in WIRE_DTYPES.items() if dtype == payload.dtype), None)
    if fmt is None:
        raise ValueError(f"rows travel as {sorted(WIRE_DTYPES.values())}, not {payload.dtype}")
    if fmt != "int8":
        if scale is not None:
            raise ValueError(f"{fmt} rows carry no scale")
    elif scale is None or scale.dtype != "float32" or not payload.shape or scale.shape != payload.shape[:-1]:
        raise ValueError(
            f"int8 rows of shape {payload.shape} need a float32 scale of shape {payload.shape[:-1]}"
        )
    return fmt


def decode_tensor(
    meta: TensorMeta, payload: bytes | bytearray | memoryview, *, finite: bool = True
) -> torch.Tensor:
    """A tensor from raw bytes, checked against its meta (size) and, for floats, for NaN/inf."""
    if len(payload) != meta.nbytes:
        raise MessageError(f"tensor payload has {len(payload)} bytes, {meta} needs {meta.nbytes}")
    dtype = _DTYPES[meta.dtype]
    if meta.numel == 0:
        return torch.empty(meta.shape, dtype=dtype)
    tensor = torch.frombuffer(bytearray(payload), dtype=dtype).reshape(meta.shape)
    if finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise MessageError("tensor holds NaN or infinite values")
    return tensor


def check_tensor(tensor: torch.Tensor, meta: TensorMeta, *, finite: bool = True) -> torch.Tensor:
    """Check an already-assembled tensor against the meta we expected to receive."""
    if tuple(tensor.shape) != meta.shape or tensor.dtype != _DTYPES[meta.dtype]:
        raise MessageError(f"tensor is {tensor.dtype} {tuple(tensor.shape)}, expected {meta}")
    if finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise MessageError("tensor holds NaN or infinite values")
    return tensor


# ---------------------------------------------------------------------------------------------
# DHT records

Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class RunManifest(Message):
    """A run's identity and configuration, stored in the DHT under the run id.

    `config` is the run's flattened config tree as sorted (key, repr) pairs; `config_hash` is its
    sha256, so a joining peer compares one string and can print the first differing key.
    """

    TAG: ClassVar[str] = "manifest"
    run_id: str
    config: tuple[tuple[str, str], ...]
    config_hash: str

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        keys = [k for k, _ in self.config]
        if keys != sorted(set(keys)):
            raise ValueError("config keys must be sorted and unique")
        if self.config_hash != config_digest(self.config):
            raise ValueError("config_hash does not match config")

    @classmethod
    def create(cls, run_id: str, flat_config: dict[str, Scalar]) -> RunManifest:
        pairs = tuple(sorted((str(k), repr(v)) for k, v in flat_config.items()))
        return cls(run_id=run_id, config=pairs, config_hash=config_digest(pairs))

    def differences(self, other: RunManifest) -> list[str]:
        """Human-readable differences, for the error a mismatched peer prints."""
        mine, theirs = dict(self.config), dict(other.config)
        return [
            f"{k}: {mine.get(k, '<absent>')} != {theirs.get(k, '<absent>')}"
            for k in sorted(set(mine) | set(theirs))
            if mine.get(k) != theirs.get(k)
        ]


def config_digest(pairs: tuple[tuple[str, str], ...]) -> str:
    h = hashlib.sha256()
    for key, value in pairs:
        h.update(key.encode() + b"\0" + value.encode() + b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class PeerAnnouncement(Message):
    """A peer's heartbeat record: which stage it serves, from which round, and where to reach it."""

    TAG: ClassVar[str] = "announce"
    run_id: str
    peer_id: str
    stage: int
    joined_round: int
    addresses: tuple[str, ...] = field(default=())
    device: str = "cpu"
    step: int = 0  # inner steps this peer has completed (refreshed by every heartbeat)
    ticket: bytes = b""  # an encoded JoinTicket: what a closed run asks of its members

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        if not self.peer_id:
            raise ValueError("peer_id must not be empty")
        if self.stage < 0 or self.joined_round < 0 or self.step < 0:
            raise ValueError("stage, joined_round and step must be >= 0")


@dataclass(frozen=True)
class JoinTicket(Message):
    """The authority of a closed run lets `peer_id` serve in `run_id` until `expires` (unix
    seconds): `signature` is its RSA signature of `signed_bytes()` (peer/tickets.py)."""

    TAG: ClassVar[str] = "ticket"
    run_id: str
    peer_id: str
    expires: float
    signature: bytes = b""

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        if not self.peer_id:
            raise ValueError("peer_id must not be empty")
        if not math.isfinite(self.expires):
            raise ValueError("expires must be a finite time")

    def signed_bytes(self) -> bytes:
        """What the authority signs: every field but the signature, unambiguously."""
        return encode(dataclasses.replace(self, signature=b""))


@dataclass(frozen=True)
class GoneReport(Message):
    """A member's note in the DHT that `peer_id` failed it in `round`: it leaves the next view.

    A peer that is reported gone but alive finds itself outside the next view and joins again,
    announcing a later round (a report only removes memberships that began at or before its round).
    """

    TAG: ClassVar[str] = "gone"
    run_id: str
    peer_id: str
    reporter: str
    round: int

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        if not self.peer_id or not self.reporter:
            raise ValueError("peer_id and reporter must not be empty")
        _check_counters(self.round)


# ---------------------------------------------------------------------------------------------
# RPC headers (named after the protocol verbs: forward, backward, exchange, fetch_state, fetch_chunk)


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
        _check_run_id(self.run_id)
        _check_counters(self.round, self.step, self.hop, self.sender_rank)
        _check_samples(self.samples, self.activations, self.tokens)
        wire_format(self.activations, self.scale)
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
        _check_run_id(self.run_id)
        _check_counters(self.round, self.step, self.hop, self.sender_rank)
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
        _check_run_id(self.run_id)
        _check_counters(self.round, self.step, self.stage, self.sender_rank)
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
        return (self.round, self.step) if self.phase == 0 else (self.round, self.step, self.phase)


@dataclass(frozen=True)
class StateRequest(Message):
    """A joining peer asks a live replica of `stage` for the manifest of its state at `round`."""

    TAG: ClassVar[str] = "fetch_state"
    run_id: str
    stage: int
    round: int = 0

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        _check_counters(self.stage, self.round)


STATE_PARTS = ("phi", "delta", "exp_avg", "exp_avg_sq")
MAX_CHUNK_ELEMENTS = 16 << 20  # 64 MiB of fp32: no state chunk (one reply) is bigger


def _is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class StateManifest(Message):
    """What a replica holds at the start of `round` (after the outer step), for a joiner.

    The state is STATE_PARTS, each a flat fp32 vector of `numel` values (phi: the weights, = theta
    at a boundary; delta: outer momentum; the AdamW moments), cut into chunks of `chunk_elements`
    values that never straddle two parts (protocol/chunks.py). `chunks` is each chunk's BLAKE3, in
    order. `view` is the server's membership of `round` (sorted peer ids per stage), `state_hash`
    the hash of the weights phi loads into. `snapshot` names the state's content, so two replicas
    that hold the same bytes (and counters) announce the same snapshot.
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
        _check_run_id(self.run_id)
        _check_counters(self.stage, self.round, self.step, self.adam_step)
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
        _check_run_id(self.run_id)
        _check_counters(self.stage, self.round, self.index)
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
        _check_run_id(self.run_id)
        _check_counters(self.stage, self.round, self.index)
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
        _check_run_id(self.run_id)


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

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        _check_counters(self.stage, self.step, self.round, self.outer_steps, self.tokens, *self.collected)
        if len(self.collected) not in (0, 2):
            raise ValueError(f"collected is a (step, microbatch) pair, got {self.collected}")


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


def _check_run_id(run_id: str) -> None:
    if not run_id or len(run_id) > 128 or not all(c.isalnum() or c in "-_." for c in run_id):
        raise ValueError(f"run id {run_id!r} must be 1-128 characters of letters, digits, '-', '_', '.'")


def _check_counters(*counters: int) -> None:
    if any(c < 0 for c in counters):
        raise ValueError(f"counters must be >= 0, got {counters}")


def _check_samples(samples: tuple[int, ...], data: TensorMeta, tokens: TensorMeta | None) -> None:
    # Rows travel in (position, origin) order, so sample indices never decrease; one repeats when
    # rows of two stage-0 origins reach one replica (uneven replica counts, see protocol.plan).
    if not samples or samples[0] < 0 or list(samples) != sorted(samples):
        raise ValueError("samples must be a non-empty, ascending list of non-negative indices")
    if not data.shape or data.shape[0] != len(samples):
        raise ValueError(f"tensor {data.shape} does not have one row per sample ({len(samples)})")
    if tokens is not None:
        if tokens.dtype != "int64" or len(tokens.shape) != 2 or tokens.shape[0] != len(samples):
            raise ValueError(f"token ids must be int64 (samples, seq), got {tokens}")
        if len(data.shape) >= 2 and data.shape[1] != tokens.shape[1]:
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
        _check_run_id(self.run_id)
        _check_counters(self.step, self.hop, self.rank, self.batch)
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
