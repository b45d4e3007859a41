"""The message codec: frozen, versioned message schemas encoded with msgpack, and tensor metas.

Every message is a frozen dataclass registered under a short tag: the DHT records (records.py)
and the RPC schemas (rpc.py). `encode` writes `{"v": PROTOCOL_VERSION, "t": tag, "b": {field:
value}}` with msgpack; `decode` checks the version, the tag, every field's presence and type (from
the annotations), and the class's own `__post_init__` rules, and raises `MessageError` for
anything else. A peer treats that error as "they sent garbage" and drops the message; it never
crashes or touches state.

Tensor bytes travel beside these headers (streamed in parts); `TensorMeta` describes them and
`decode_tensor` checks shape, dtype, size and finiteness before any of them is used.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

import msgpack
import torch

# 2: forward and backward rows in a wire format (fp32, bf16, int8 + scale); 3: forward headers say
# which gone replicas their rows are routed around; 4: stage 0 stands in for its gone replicas
# (a version-3 stage 1 would refuse their rows), told of them in backward headers (`gone`);
# 5: backward headers name the rows a later stage lost (`lost`), and forward headers the rows of
# the step before that stage 0 feeds again (`carried`); 6: status answers say which microbatch
# a receiver collected last (`collected`), so a peer that fell behind sends it nothing stale;
# 7: forward rows in the subspace format (bf16 coefficients with int32 token windows);
# 8: an exchange's confirmation and receipt say how fast the other side's tensors arrived (`rate`);
# 9: a caller that avoids its callee says so (`rpc_decline`), which a version-8 peer would refuse;
# 10: members pass each other their sealed membership records (`rpc_records`);
# 11: a donor serves a joiner the state of the boundary before its round (a manifest's `round` is
# that of its view, and a joiner asks for its entry view apart: `StateRequest.admitted`);
# 12: a boundary builds its view from the records members passed alone (a version-11 peer also
# reads the directory, and could build another), and a non-member's others' records are refused;
# 13: heartbeats go to a key per bucket of members, gone reports to a key per accused peer
# (peer/directory.py): a version-12 peer would find none of them
# 14: a probed peer says whom it routes rows around (`PeerStatus.routes_around`, `stands_in`),
# fields a version-13 peer would refuse
# 15: a joiner may announce a later round while it downloads, and its donors keep the snapshot it
# downloads until then (peer/postpone.py): a version-14 donor would refuse it its view there
PROTOCOL_VERSION = 15
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


# Activations and their gradients cross in one of three elementwise formats (protocol/wire.py,
# `wire.activations`): the payload's dtype names it, and int8 rows carry a float32 scale per row of
# the last dimension. Subspace rows are bf16 too (k per token), told apart by their int32 ids.
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


def check_run_id(run_id: str) -> None:
    if not run_id or len(run_id) > 128 or not all(c.isalnum() or c in "-_." for c in run_id):
        raise ValueError(f"run id {run_id!r} must be 1-128 characters of letters, digits, '-', '_', '.'")


def check_counters(*counters: int) -> None:
    if any(c < 0 for c in counters):
        raise ValueError(f"counters must be >= 0, got {counters}")
