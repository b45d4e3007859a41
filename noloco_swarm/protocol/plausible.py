"""Is a received tensor fit to use? Pure checks of outer-step weights and pipeline rows, no I/O.

A member that sends finite but absurd weights (theta x 1000, say) poisons every partner that
averages them in: their next activations overflow and the pipeline stalls behind refused rows.
So a receiver checks what it is sent before it uses it (docs/membership.md, "Poisoned outer
steps"):

* **Outer weights** (a partner's theta, its phi when gamma != beta, a DiLoCo shard or mean
  shard): finite, this replica's shape and dtype, and within `outer_bound` of this replica's own
  slow weights phi. The bound is robust because its scale is this replica's *own* progress,
  which no partner controls:

      ||received - phi|| <= factor * (||theta_own - phi|| + drift) + floor * ||phi||

  `drift` is how far our slow weights moved in outer steps we took alone since we last averaged
  with anyone (0 in a healthy run): replicas kept apart (a rejected or cut-off partner) drift
  apart (an honest partner came back after six rounds apart at 39x our own progress that round).
  The floor covers the spread of NoLoCo replicas' slow weights, which own progress alone does
  not: with 4 or more replicas honest partners measured up to `MEASURED_MAX_RATIO` times our own
  progress. Measured with the tiny preset in the simulator (`bench/plausible_ratio.py`, every
  pair of replicas at every outer step; NoLoCo and DiLoCo, H from 1 to 20, 2 to 8 replicas,
  gamma != beta too, warm-up to the end of the cosine), no honest pair needed a floor above
  `MEASURED_FLOOR_NEEDED` of ||phi|| with factor 4 (8 replicas, H = 5, a short run at a high
  learning rate; 4 replicas needed at most 0.039); the default floor (`outer.plausible_floor` =
  0.25) is 4x that, and a theta x 1000 lies ~1000 ||phi|| away (x2, a sign flip or noise the
  size of the weights: ~1-2 ||phi||). A shard is compared with the
  matching slice of phi against the *whole* own progress and ||phi||, which only loosens the
  bound (a slice of an honest difference is never longer than the whole of it).

  What the bound does not stop: a liar that stays inside it moves our slow weights by at most
  beta/n of the bound per round (with the defaults up to ~9% of ||phi||, e.g. a theta x 1.25),
  and may do so round after round; it cannot blow them up at once.

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

from noloco_swarm.protocol.codec import MessageError

REASONS = ("nonfinite", "shape", "dtype", "distance", "rms")
# Measured between honest replicas (module docstring, bench/plausible_ratio.py): the largest
# partner/own progress ratio, and the largest floor (fraction of ||phi||) factor 4 needed.
MEASURED_MAX_RATIO = 9.8
MEASURED_FLOOR_NEEDED = 0.063
DEFAULT_FACTOR = 4.0
DEFAULT_FLOOR = 0.25
# Per-row RMS of activations or gradients above this is refused. Measured over 60 steps of the
# tiny preset (2 stages, batch 4): the rows stage 0 sends on peak at an RMS of 0.6, their
# gradients at 8e-4; large models' outlier channels reach 1e3 in a few features, not in a row's
# RMS. A ten-thousandfold margin: only absurd rows fail.
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


# Elements per float64 slice: no copy the size of the weights, and 1 MiB, below the mmap threshold
# of peer.release_memory = map, so slices are reused from the heap instead of mapped afresh.
SLICE = 1 << 17


def distance(a: torch.Tensor, b: torch.Tensor | None) -> float:
    """||a - b|| (||a|| when b is None), summed in float64 slice by slice; NaN/inf propagate."""
    x, y = a.reshape(-1), (b.reshape(-1) if b is not None else None)
    total = 0.0
    for start in range(0, x.numel(), SLICE):
        d = x[start : start + SLICE].double()
        if y is not None:
            d = d - y[start : start + SLICE].double()
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
