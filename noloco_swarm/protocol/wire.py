"""The wire format of activations and their gradients between pipeline stages (`wire.activations`).

Pure functions: `encode` turns a float32 tensor into the tensors that cross the wire, `decode`
checks received ones and turns them back into float32, and `round_trip` is the two together,
which is what the simulator applies at the points where a peer sends and receives. Every
operation here is elementwise or a per-row maximum, so the round trip of a row does not depend on
which other rows travel with it: a peer that sends a replica's rows in several messages and the
simulator that round-trips them as one batch get the same bits.

  fp32  exact: the tensor itself.
  bf16  half the bytes: round to nearest even (torch's conversion). A value beyond bfloat16's
        range (above 3.39e38, where training has long diverged) becomes inf and is refused.
  int8  a quarter of the bytes, plus one float32 scale per row of the last dimension (per sample
        and sequence position: one vector of `hidden_size` values). Symmetric, round to nearest
        (ties to even): scale = max|x| / 127, q = round(x / scale) in [-127, 127], x' = q * scale,
        so |x - x'| <= scale / 2 for every value of a row whose scale is a normal float. A zero
        row has scale 0 and decodes to zeros. The scale is capped so that 127 * scale stays
        finite, which costs rows near float32's largest value a rounding step at their maximum.

  subspace  k bf16 numbers per token plus the token ids as int32, for a model whose writes into
        the residual stay in F[t] + span(U) (`model.subspace_rank = k`; protocol/subspace.py).
        Not elementwise: it needs the run's basis and the rows' token ids, so it is reached
        through `Boundary`, which the simulator and the peer both use for every format.

Non-finite inputs stay non-finite in every format (a NaN or inf row gives a NaN or inf scale),
so a receiver refuses them as it refuses any non-finite tensor. Validation runs in fp32 whatever
this says: the format is the transport's, the model under evaluation is the trained one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from noloco_swarm.protocol import subspace
from noloco_swarm.protocol.codec import WIRE_DTYPES, MessageError, TensorMeta
from noloco_swarm.protocol.subspace import Subspace

WireFormat = Literal["fp32", "bf16", "int8", "subspace"]
FORMATS: tuple[str, ...] = tuple(WIRE_DTYPES)  # the elementwise formats of encode / decode
SUBSPACE = "subspace"
ACTIVATION_FORMATS: tuple[str, ...] = (*FORMATS, SUBSPACE)  # every value of wire.activations

Q_MAX = 127  # symmetric int8: -128 is never produced, and refused on receipt
_F32_MAX = torch.finfo(torch.float32).max


def _largest_scale() -> float:
    """The largest float32 scale s with 127 * s finite in float32 (just below max / 127)."""
    s = torch.tensor(_F32_MAX / Q_MAX, dtype=torch.float32)
    while not torch.isfinite(s * Q_MAX):
        s = torch.nextafter(s, torch.zeros_like(s))
    return float(s)


MAX_SCALE = _largest_scale()


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"wire format must be one of {FORMATS}, got {fmt!r}")


def metas(shape: Sequence[int], fmt: str) -> tuple[TensorMeta, ...]:
    """The metas of the wire tensors that carry a float32 tensor of `shape` in `fmt`, in order."""
    check_format(fmt)
    shape = tuple(shape)
    payload = TensorMeta(shape, WIRE_DTYPES[fmt])
    return (payload, TensorMeta(shape[:-1], "float32")) if fmt == "int8" else (payload,)


def nbytes(shape: Sequence[int], fmt: str) -> int:
    """Bytes on the wire for a float32 tensor of `shape` in `fmt` (scales included)."""
    return sum(m.nbytes for m in metas(shape, fmt))


@torch.no_grad()
def encode(x: torch.Tensor, fmt: str) -> list[torch.Tensor]:
    """The tensors that carry float32 `x` in `fmt` (fp32: `x` itself, not a copy)."""
    check_format(fmt)
    if x.dtype != torch.float32:
        raise ValueError(f"the wire carries float32 tensors, got {x.dtype}")
    if fmt == "fp32":
        return [x]
    if fmt == "bf16":
        return [x.to(torch.bfloat16)]
    if x.dim() == 0:
        raise ValueError("int8 needs rows: a tensor of at least one dimension")
    if x.shape[-1] == 0:
        return [torch.zeros(x.shape, dtype=torch.int8), torch.zeros(x.shape[:-1])]
    scale = x.abs().amax(dim=-1) / Q_MAX
    scale = torch.where(torch.isinf(scale), scale, scale.clamp(max=MAX_SCALE))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)  # a zero row stays 0
    q = torch.div(x, safe).round_().clamp_(-Q_MAX, Q_MAX).to(torch.int8)
    return [q, scale]


def decode(
    parts: Sequence[torch.Tensor], fmt: str, shape: Sequence[int] | None = None, *, check_finite: bool = True
) -> torch.Tensor:
    """Float32 from received wire tensors; MessageError for anything `encode` could not have sent.

    With `shape`, the tensor must have that shape. fp32 returns the received tensor itself.
    `check_finite=False` skips the NaN/inf pass over a float payload, for callers whose transport
    checked every received float already (int8's scales are checked whatever it says)."""
    check_format(fmt)
    try:
        got = tuple(TensorMeta.of(p) for p in parts)
    except ValueError as e:  # a dtype no wire format uses
        raise MessageError(f"{fmt} rows cannot travel as {[p.dtype for p in parts]}: {e}") from e
    expected_shape = tuple(shape) if shape is not None else (tuple(parts[0].shape) if parts else ())
    if got != metas(expected_shape, fmt):
        raise MessageError(f"{fmt} rows must travel as {metas(expected_shape, fmt)}, got {got}")
    if fmt == "int8":
        q, scale = parts
        if q.numel() and int(q.min()) < -Q_MAX:
            raise MessageError(f"int8 rows hold {int(q.min())}; symmetric int8 stays within +-{Q_MAX}")
        if scale.numel() and not (bool(torch.isfinite(scale).all()) and float(scale.min()) >= 0):
            raise MessageError("int8 scales must be finite and >= 0")
        if scale.numel() and float(scale.max()) > MAX_SCALE:  # 127 * scale would overflow
            raise MessageError(
                f"an int8 scale of {float(scale.max()):.3g} overflows float32 (max {MAX_SCALE:.3g})"
            )
        return _dequantize(q, scale)
    (payload,) = parts
    if check_finite and payload.numel() and not bool(torch.isfinite(payload).all()):
        raise MessageError(f"{fmt} rows hold NaN or infinite values")
    return payload if fmt == "fp32" else payload.to(torch.float32)


@torch.no_grad()
def round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the receiver of `x` computes with: decode(encode(x)), without decode's checks (fp32: `x`).

    The simulator's side of the wire; a non-finite `x` comes back non-finite."""
    check_format(fmt)
    if fmt == "fp32":
        return x
    parts = encode(x, fmt)
    if fmt == "bf16":
        return parts[0].to(torch.float32)
    return _dequantize(*parts)


def _dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in float32, in one pass (int8 promotes to float32 exactly)."""
    return torch.mul(q, scale.unsqueeze(-1))


@dataclass(frozen=True, eq=False)
class Boundary:
    """What crosses a stage boundary in the run's format: activation rows with the token ids that
    ride along (forward), and their gradients (backward). `space`: the run's U and F, for subspace.

    The ids that ride along are the rows' targets (int64, one per position), which the last stage
    needs for its loss; under subspace they are the rows' windows (one more id: the inputs and the
    targets), sent as int32, since the receiver also needs the input ids to add F[t] back.
    """

    fmt: str
    space: Subspace | None = None

    def __post_init__(self) -> None:
        if self.fmt not in ACTIVATION_FORMATS:
            raise ValueError(f"wire format must be one of {ACTIVATION_FORMATS}, got {self.fmt!r}")
        if (self.fmt == SUBSPACE) != (self.space is not None):
            raise ValueError("the subspace format needs the run's basis and table, and only it does")

    @property
    def windows(self) -> bool:
        """Whether the ids that ride along are whole windows (T + 1 ids) rather than targets."""
        return self.space is not None

    def ids(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The ids that ride along with stage 0's rows, from their input ids and targets (B, T)."""
        if not self.windows:
            return targets
        return torch.cat([inputs[:, :1].to(targets.device), targets], dim=1)

    def targets(self, ids: torch.Tensor) -> torch.Tensor:
        """The last stage's targets from the ids that rode along."""
        return ids[:, 1:] if self.windows else ids

    def ids_to_wire(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids as they cross: int64 targets, or int32 windows (never floats)."""
        return ids.to(torch.int32).contiguous() if self.windows else ids.contiguous()

    def ids_from_wire(self, ids: torch.Tensor, rows: int, seq_len: int, vocab: int) -> torch.Tensor:
        """Received ids, checked (dtype, shape, vocabulary), as int64; MessageError if malformed."""
        if self.windows:
            return subspace.check_ids(ids, rows, seq_len + 1, vocab)
        if ids.dtype != torch.int64 or tuple(ids.shape) != (rows, seq_len):
            raise MessageError(
                f"token ids must be int64 ({rows}, {seq_len}), got {ids.dtype} {tuple(ids.shape)}"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise MessageError(f"token ids must lie in [0, {vocab})")
        return ids

    def width(self, hidden: int) -> int:
        """Numbers per token on the wire: the hidden size, or the subspace's rank."""
        return self.space.rank if self.space is not None else hidden

    def encode_rows(self, x: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
        """The wire tensors of float32 activations x (on the CPU) whose ids rode along as `ids`."""
        if self.space is None:
            return encode(x, self.fmt)
        return [subspace.encode_rows(self.space, x, ids[:, :-1])]

    def decode_rows(
        self, parts: Sequence[torch.Tensor], ids: torch.Tensor, *, check_finite: bool = True
    ) -> torch.Tensor:
        """Float32 activations from their wire tensors and checked ids; MessageError if malformed."""
        if self.space is None:
            return decode(parts, self.fmt, check_finite=check_finite)
        if len(parts) != 1:
            raise MessageError(f"subspace rows travel as one tensor, got {len(parts)}")
        return subspace.decode_rows(self.space, parts[0], ids[:, :-1])

    def rows_round_trip(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """What the receiver of activations x computes with (the simulator's side of the wire)."""
        if self.space is None:
            return round_trip(x, self.fmt)
        inputs = ids[:, :-1]
        return subspace.rebuild_rows(self.space, subspace.encode_rows(self.space, x, inputs), inputs)

    def encode_grads(self, g: torch.Tensor) -> list[torch.Tensor]:
        """The wire tensors of float32 gradients w.r.t. received activations (on the CPU)."""
        if self.space is None:
            return encode(g, self.fmt)
        return [subspace.encode_grads(self.space, g)]

    def decode_grads(
        self, parts: Sequence[torch.Tensor], shape: Sequence[int], *, check_finite: bool = True
    ) -> torch.Tensor:
        """Float32 gradients of the activations of `shape` we sent, from their wire tensors;
        MessageError if malformed."""
        if self.space is None:
            return decode(parts, self.fmt, shape, check_finite=check_finite)
        if len(parts) != 1:
            raise MessageError(f"subspace gradients travel as one tensor, got {len(parts)}")
        return subspace.decode_grads(self.space, parts[0], tuple(shape[:-1]))

    def grads_round_trip(self, g: torch.Tensor) -> torch.Tensor:
        """What the sender of activations computes with when g comes back (U U^T g under subspace)."""
        if self.space is None:
            return round_trip(g, self.fmt)
        return subspace.rebuild_grads(self.space, subspace.encode_grads(self.space, g))

    def nbytes(self, rows: int, seq_len: int, hidden: int, *, ids: bool) -> int:
        """Bytes on the wire of `rows` rows of activations (with their ids: `ids`) or gradients."""
        payload = nbytes((rows, seq_len, self.width(hidden)), "bf16" if self.windows else self.fmt)
        if not ids:
            return payload
        return payload + rows * (seq_len + 1) * 4 if self.windows else payload + rows * seq_len * 8
