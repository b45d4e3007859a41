"""The subspace wire format's math: a residual in F[t] + span(U) sent as k coefficients per token.

With `model.subspace_rank = k` every write into the residual stream before the last stage lies in
span(U), U a fixed d x k orthonormal basis, on top of a frozen token table F (V x d); both come from
the run seed (model/subspace.py), identical on every peer. So at a stage boundary the residual of
token t is x = F[t] + U c, and a sender sends c = U^T (x - F[t]) as bf16 with the token ids; the
receiver rebuilds x = U c + F[t]. Gradients go back as U^T g (bf16) and the sender uses U U^T g,
which is exact for its parameters: its output can only move inside F[t] + span(U). (Pluralis'
"Protocol Models", arXiv 2506.01260, and its public code: node0, agora, ProtocolNanoGPT.)

Pure functions on CPU tensors. Each is a matmul per token, so a row's result could depend on the
batch it is computed in (BLAS blocks by shape); the simulator therefore round-trips rows in the same
groups a peer sends them in (one message per sender and receiver), and gets the peer's bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noloco_swarm.protocol.codec import MessageError

# The largest part of a sender's residual (relative, per token) allowed outside F[t] + span(U).
# A constrained model leaves only fp32 rounding there: each residual add and the subtraction of
# F[t] round at 2^-24 ~ 6e-8 of |x|, and |x| / |x - F[t]| is about sqrt(d / k) at init, so dozens of
# layers stay near 1e-5. A write that is not constrained leaves ~sqrt(1 - k/d), and one that went
# through bf16 unprojected 2^-9 ~ 2e-3: 1e-4 sits between them with room on both sides.
SEND_TOLERANCE = 1e-4


class OutsideSubspace(ValueError):
    """A sender's activations leave F[t] + span(U): its model is not constrained as the run says,
    and sending k coefficients would silently drop the rest."""


@dataclass(frozen=True, eq=False)
class Subspace:
    """The run's fixed basis U and token table F, float32 on the CPU."""

    basis: torch.Tensor
    """U: (hidden, k), orthonormal columns."""
    table: torch.Tensor
    """F: (vocab, hidden), frozen."""

    def __post_init__(self) -> None:
        u, f = self.basis, self.table
        if u.dtype != torch.float32 or f.dtype != torch.float32 or u.dim() != 2 or f.dim() != 2:
            raise ValueError(
                f"need float32 U (d, k) and F (V, d), got {u.dtype} {u.shape}, {f.dtype} {f.shape}"
            )
        if f.shape[1] != u.shape[0] or not 0 < u.shape[1] <= u.shape[0]:
            raise ValueError(
                f"U {tuple(u.shape)} and F {tuple(f.shape)} do not fit: need U (d, k <= d), F (V, d)"
            )

    @property
    def rank(self) -> int:
        return self.basis.shape[1]

    @property
    def hidden(self) -> int:
        return self.basis.shape[0]

    @property
    def vocab(self) -> int:
        return self.table.shape[0]


def outside(space: Subspace, x: torch.Tensor, ids: torch.Tensor) -> float:
    """The largest per-token ||y - U U^T y|| / ||y|| with y = x - F[ids] (0 for rows of zeros)."""
    y = (x - space.table[ids]).reshape(-1, space.hidden)
    if not y.numel():
        return 0.0
    off = y - (y @ space.basis) @ space.basis.T
    ratio = off.norm(dim=-1) / y.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return float(ratio.max())


@torch.no_grad()
def encode_rows(space: Subspace, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """c = U^T (x - F[ids]) as bf16, (..., k), for float32 activations x (..., d) of tokens `ids`.

    Raises OutsideSubspace if x is not in F[ids] + span(U) (SEND_TOLERANCE). Non-finite rows are
    not judged: they stay non-finite and the receiver refuses them, as in every format."""
    _check_rows(space, x, ids)
    if bool(torch.isfinite(x).all()):
        off = outside(space, x, ids)
        if off > SEND_TOLERANCE:
            raise OutsideSubspace(
                f"activations leave the subspace: {off:.3g} of a token's residual lies outside "
                f"F[t] + span(U) (at most {SEND_TOLERANCE:g}); the stage's writes into the residual "
                "are not constrained to the run's basis (model.subspace_rank), refusing to send them"
            )
    return ((x - space.table[ids]) @ space.basis).to(torch.bfloat16)


@torch.no_grad()
def decode_rows(space: Subspace, c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x = U c + F[ids] in float32 from received coefficients; MessageError for a malformed c."""
    check_coefficients(space, c, tuple(ids.shape))
    return _finite(rebuild_rows(space, c, ids))


def rebuild_rows(space: Subspace, c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """U c + F[ids] in float32, unchecked (the simulator's side of the wire)."""
    return c.to(torch.float32) @ space.basis.T + space.table[ids]


@torch.no_grad()
def encode_grads(space: Subspace, g: torch.Tensor) -> torch.Tensor:
    """U^T g as bf16, (..., k), for float32 gradients g (..., d) w.r.t. the received residual."""
    if g.dtype != torch.float32 or not g.dim() or g.shape[-1] != space.hidden:
        raise ValueError(f"gradients must be float32 (..., {space.hidden}), got {g.dtype} {tuple(g.shape)}")
    return (g @ space.basis).to(torch.bfloat16)


@torch.no_grad()
def decode_grads(space: Subspace, c: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """U U^T g in float32, (*rows, d), from the received U^T g; MessageError for a malformed c."""
    check_coefficients(space, c, rows)
    return _finite(rebuild_grads(space, c))


def rebuild_grads(space: Subspace, c: torch.Tensor) -> torch.Tensor:
    """U c in float32, unchecked (the simulator's side of the wire)."""
    return c.to(torch.float32) @ space.basis.T


def check_coefficients(space: Subspace, c: torch.Tensor, rows: tuple[int, ...]) -> None:
    """Received coefficients must be bf16 of shape (*rows, k) and finite."""
    if c.dtype != torch.bfloat16 or tuple(c.shape) != (*rows, space.rank):
        raise MessageError(
            f"subspace rows must travel as bfloat16 {(*rows, space.rank)}, got {c.dtype} {tuple(c.shape)}"
        )
    if c.numel() and not bool(torch.isfinite(c).all()):
        raise MessageError("subspace rows hold NaN or infinite values")


def _finite(x: torch.Tensor) -> torch.Tensor:
    # Finite bf16 coefficients near its largest values can sum past float32's range in U c.
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise MessageError("subspace rows overflow float32 when rebuilt (coefficients near bf16's range)")
    return x


def check_ids(ids: torch.Tensor, rows: int, width: int, vocab: int) -> torch.Tensor:
    """Received token ids: int32 (rows, width) within the vocabulary; returned as int64."""
    if ids.dtype != torch.int32 or tuple(ids.shape) != (rows, width):
        raise MessageError(
            f"token ids must travel as int32 ({rows}, {width}), got {ids.dtype} {tuple(ids.shape)}"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise MessageError(f"token ids must lie in [0, {vocab})")
    return ids.to(torch.int64)


def _check_rows(space: Subspace, x: torch.Tensor, ids: torch.Tensor) -> None:
    if x.dtype != torch.float32 or tuple(x.shape) != (*ids.shape, space.hidden):
        raise ValueError(
            f"activations must be float32 {(*ids.shape, space.hidden)} for token ids {tuple(ids.shape)}, "
            f"got {x.dtype} {tuple(x.shape)}"
        )
    if ids.dtype != torch.int64:
        raise ValueError(f"token ids must be int64, got {ids.dtype}")
