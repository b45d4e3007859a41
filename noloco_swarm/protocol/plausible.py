"""Is a received tensor fit to use? Pure checks of outer-step weights and pipeline rows, no I/O.

A member that sends finite but absurd weights (theta x 1000, say) poisons every partner that
averages them in: their next activations overflow and the pipeline stalls behind refused rows.
So a receiver checks what it is sent before it uses it (docs/membership.md, "Poisoned outer
steps"):

* **Outer weights** (a partner's theta, its phi when gamma != beta, a DiLoCo shard or mean
  shard): finite, this replica's shape and dtype, and within `outer_bound` of this replica's own
  slow weights phi. The bound is robust because it is measured against this replica's *own*
  progress, which no partner controls:

      ||received - phi|| <= factor * ||theta_own - phi|| + floor * ||phi||

  Honest partners start each round from nearby slow weights and move by similar amounts, so
  their distance stays near our own pseudo-gradient norm. Measured with the tiny preset in the
  simulator (bench command in docs/membership.md), the ratio ||theta_partner - phi|| /
  ||theta_own - phi|| over 6,000+ honest pairs (NoLoCo and DiLoCo, H from 1 to 50, 2 to 8
  replicas, gamma != beta too, warm-up and the cosine tail) peaked at `MEASURED_MAX_RATIO`; the
  default factor (`outer.plausible_factor` = 4) leaves a margin of more than 2x above it, and the
  floor (`outer.plausible_floor`, 1e-3 of ||phi||) keeps tiny late updates (the end of the cosine
  schedule) from rejecting a partner whose slow weights differ from ours by a hair. A shard is
  compared with the matching slice of phi against the *whole* own norm, which only loosens the
  bound (a slice of an honest difference is never longer than the whole of it).

  What the bound does not stop: a liar that stays inside it moves our slow weights by at most
  beta/n times `factor` honest steps per round; it cannot blow them up.

* **Pipeline rows** (activations forward, their gradients back): finite (the transport checks as
  they land) and each row's RMS at most `MAX_ROW_RMS`, far above anything a healthy run shows.

A rejected tensor is reported as `Implausible` (a MessageError: the sender's fault), whose
`reason` is one of REASONS; the peer leaves that member out of the step and avoids it for
`outer.avoid_rounds` outer steps (`Avoidance`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from noloco_swarm.protocol.messages import MessageError

REASONS = ("nonfinite", "shape", "dtype", "distance", "rms")
# The largest partner/own distance ratio seen between honest replicas (module docstring).
MEASURED_MAX_RATIO = 1.6
DEFAULT_FACTOR = 4.0
DEFAULT_FLOOR = 1e-3
# Per-row RMS of activations or gradients above this is refused. A healthy tiny run's hidden
# states have an RMS of order 1 (RMSNorm'd inputs plus residual updates), their gradients far
# less; large models' outlier channels reach 1e3 in a few features, not in a row's RMS.
MAX_ROW_RMS = 1e4


class Implausible(MessageError):
    """A received tensor fails a plausibility check; `reason` is one of REASONS, `ratio` (for
    "distance") how far past our own progress it was: ||received - phi|| / ||theta_own - phi||."""

    def __init__(self, reason: str, detail: str, ratio: float | None = None) -> None:
        assert reason in REASONS, reason
        super().__init__(detail)
        self.reason, self.ratio = reason, ratio


@dataclass(frozen=True)
class Verdict:
    """The outcome of `check_outer`: accepted or not, the distance ratio, and why not."""

    ok: bool
    ratio: float  # ||received - phi|| / ||theta_own - phi|| (inf for a non-finite or misfit tensor)
    reason: str = ""  # one of REASONS when not ok
    detail: str = ""

    def raise_if_rejected(self) -> None:
        if not self.ok:
            raise Implausible(self.reason, self.detail, None if math.isinf(self.ratio) else self.ratio)


def outer_bound(
    own_norm: float, phi_norm: float, *, factor: float, floor: float, drift: float = 0.0
) -> float:
    """The largest plausible ||received - phi||: `factor` times our own progress since we last
    averaged (this round's ||theta_own - phi|| plus the `drift` of our slow weights in outer steps
    taken alone since), plus `floor` times ||phi|| (the spread of replicas' slow weights)."""
    return factor * (own_norm + drift) + floor * phi_norm


@torch.no_grad()
def check_outer(
    received: torch.Tensor,
    phi: torch.Tensor,
    own_norm: float,
    phi_norm: float,
    *,
    factor: float,
    floor: float,
    drift: float = 0.0,
) -> Verdict:
    """Whether a received outer-step tensor may be averaged in (reads, never alters, its inputs).

    `phi` is this replica's slow weights, or the slice of them a shard covers; `own_norm` is
    ||theta_own - phi|| and `phi_norm` ||phi||, both over the whole stage (`own_progress`);
    `drift`, how far our slow weights moved in outer steps taken alone since we last averaged
    with a partner (0 in a healthy run). `ratio` is the distance over `own_norm + drift`.
    """
    if received.dtype != phi.dtype:
        return Verdict(False, math.inf, "dtype", f"sent {received.dtype}, this replica holds {phi.dtype}")
    if received.shape != phi.shape:
        return Verdict(
            False,
            math.inf,
            "shape",
            f"sent shape {tuple(received.shape)}, this replica holds {tuple(phi.shape)}",
        )
    far = distance(received, phi)
    if not math.isfinite(far):
        return Verdict(False, math.inf, "nonfinite", "sent NaN or infinite values")
    scale = own_norm + drift
    ratio = far / scale if scale > 0 else (0.0 if far == 0 else math.inf)
    bound = outer_bound(own_norm, phi_norm, factor=factor, floor=floor, drift=drift)
    if far > bound:
        return Verdict(
            False,
            ratio,
            "distance",
            f"its distance to our slow weights, {far:.4g}, is {ratio:.3g}x our own progress "
            f"{scale:.4g} (bound {bound:.4g}: outer.plausible_factor={factor:g}, "
            f"outer.plausible_floor={floor:g} of |phi| {phi_norm:.4g})",
        )
    return Verdict(True, ratio)


@torch.no_grad()
def own_progress(theta: torch.Tensor, phi: torch.Tensor) -> tuple[float, float]:
    """(||theta - phi||, ||phi||) of this replica, in float64: the scale `check_outer` compares with."""
    return distance(theta, phi), distance(phi, None)


_CHUNK = 1 << 20  # elements per float64 slice: exact enough, and no copy the size of the weights


def distance(a: torch.Tensor, b: torch.Tensor | None) -> float:
    """||a - b|| (||a|| when b is None), summed in float64 slice by slice; NaN/inf propagate."""
    x, y = a.reshape(-1), (b.reshape(-1) if b is not None else None)
    total = 0.0
    for start in range(0, x.numel(), _CHUNK):
        d = x[start : start + _CHUNK].double()
        if y is not None:
            d = d - y[start : start + _CHUNK].double()
        total += float(d.square().sum())
    return math.sqrt(total)


@torch.no_grad()
def check_rows(rows: torch.Tensor, what: str, limit: float = MAX_ROW_RMS) -> None:
    """Raise Implausible if a row (first dimension) of received activations or gradients is not
    finite or has an RMS above `limit`."""
    if rows.numel() == 0 or not rows.is_floating_point():
        return
    flat = rows.reshape(rows.shape[0], -1)
    # float32 norms, no copy of the rows: a norm that overflows is far over any sane bound anyway.
    rms = torch.linalg.vector_norm(flat.float(), dim=1) / math.sqrt(flat.shape[1])
    worst = float(rms.max())
    if math.isnan(worst) or (math.isinf(worst) and not bool(torch.isfinite(flat).all())):
        raise Implausible("nonfinite", f"{what} hold NaN or infinite values")
    if worst > limit:
        raise Implausible("rms", f"a row of {what} has an RMS of {worst:.3g}, over the bound {limit:g}")


@dataclass
class Avoidance:
    """Peers whose outer weights were rejected, and the last outer step (boundary) at which each
    is still avoided: not called, its calls refused. Steps are passed in (no clock)."""

    until: dict[str, int] = field(default_factory=dict)

    def avoid(self, peer: str, step: int, rounds: int, inner_steps: int) -> None:
        """Rejected at the outer step of boundary `step`: avoid it at the next `rounds` ones."""
        if rounds > 0:
            self.until[peer] = max(self.until.get(peer, 0), step + rounds * inner_steps)

    def avoided(self, peer: str, step: int) -> bool:
        """Is `peer` avoided at the outer step of boundary `step`? (Forgets expired entries.)"""
        last = self.until.get(peer)
        if last is not None and step > last:
            del self.until[peer]
            return False
        return last is not None
