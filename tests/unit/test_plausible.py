"""protocol/plausible.py: which received outer weights and rows are fit to use, and avoidance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_swarm.peer import failpoints
from noloco_swarm.protocol import plausible
from noloco_swarm.protocol.config import OuterConfig
from noloco_swarm.protocol.plausible import Avoidance, Implausible, check_outer, check_rows, own_progress

FACTOR, FLOOR = plausible.DEFAULT_FACTOR, plausible.DEFAULT_FLOOR


def replica(seed: int, n: int = 1000, step: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi, theta): slow weights, and fast weights one honest round of size `step` away."""
    g = torch.Generator().manual_seed(seed)
    phi = torch.randn(n, generator=g)
    return phi, phi + step * torch.randn(n, generator=g)


def judge(received: torch.Tensor, phi: torch.Tensor, theta: torch.Tensor, **kw: float) -> plausible.Verdict:
    own, phi_norm = own_progress(theta, phi)
    return check_outer(
        received, phi, own, phi_norm, factor=kw.get("factor", FACTOR), floor=kw.get("floor", FLOOR)
    )


@given(seed=st.integers(0, 2**16), spread=st.floats(0.2, 3.0), step=st.floats(1e-4, 1.0))
@settings(max_examples=60, deadline=None)
def test_an_honest_partner_within_the_measured_ratio_is_accepted_and_nothing_is_changed(
    seed: int, spread: float, step: float
) -> None:
    """A partner that moved `spread` times as far as we did (up to the measured honest maximum's
    neighbourhood) passes, and the check leaves every tensor as it was."""
    phi, theta = replica(seed, step=step)
    g = torch.Generator().manual_seed(seed + 1)
    direction = torch.randn(phi.shape, generator=g)
    own = float((theta - phi).norm())
    partner = phi + direction / direction.norm() * own * spread
    copies = [t.clone() for t in (phi, theta, partner)]
    verdict = judge(partner, phi, theta)
    # The ratio is that of the float32 tensors as stored (phi + a step of 1e-4 rounds each element
    # to float32, a relative error up to about 1e-3 of the step): compare with that exactly, and
    # with the intended spread loosely.
    stored = plausible.distance(partner, phi) / plausible.distance(theta, phi)
    assert verdict.ok and verdict.ratio == pytest.approx(stored, rel=1e-9)
    assert verdict.ratio == pytest.approx(spread, rel=1e-2)
    assert all(torch.equal(a, b) for a, b in zip(copies, (phi, theta, partner), strict=True))


@given(seed=st.integers(0, 2**16), scale=st.sampled_from([-1.0, 2.0, 10.0, 1000.0, 1e6]))
@settings(max_examples=40, deadline=None)
def test_scaled_weights_are_rejected_with_their_ratio(seed: int, scale: float) -> None:
    phi, theta = replica(seed)
    verdict = judge(theta * scale, phi, theta)
    assert not verdict.ok and verdict.reason == "distance"
    assert verdict.ratio > FACTOR
    with pytest.raises(Implausible) as e:
        verdict.raise_if_rejected()
    assert e.value.reason == "distance" and e.value.ratio == pytest.approx(verdict.ratio)


def test_the_bound_is_factor_times_own_progress_plus_the_relative_floor() -> None:
    phi, theta = replica(0)
    own, phi_norm = own_progress(theta, phi)
    bound = plausible.outer_bound(own, phi_norm, factor=FACTOR, floor=FLOOR)
    assert bound == pytest.approx(FACTOR * own + FLOOR * phi_norm)
    unit = torch.zeros_like(phi)
    unit[0] = 1.0
    assert judge(phi + unit * bound * 0.999, phi, theta).ok
    assert not judge(phi + unit * bound * 1.001, phi, theta).ok
    # No progress of our own (a first round with lr 0): the floor alone admits a partner near phi.
    assert judge(phi + unit * FLOOR * phi_norm * 0.5, phi, phi).ok
    assert not judge(phi + unit * FLOOR * phi_norm * 2, phi, phi).ok


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (lambda t: torch.where(torch.arange(t.numel()) == 7, torch.tensor(float("nan")), t), "nonfinite"),
        (lambda t: torch.where(torch.arange(t.numel()) == 7, torch.tensor(float("inf")), t), "nonfinite"),
        (lambda t: t[:-1], "shape"),
        (lambda t: t.reshape(10, -1), "shape"),
        (lambda t: t.double(), "dtype"),
        (lambda t: t.half(), "dtype"),
    ],
)
def test_non_finite_misshapen_and_mistyped_weights_are_rejected(bad, reason: str) -> None:
    phi, theta = replica(3)
    verdict = judge(bad(theta), phi, theta)
    assert not verdict.ok and verdict.reason == reason and math.isinf(verdict.ratio)
    with pytest.raises(Implausible) as e:
        verdict.raise_if_rejected()
    assert e.value.reason == reason and e.value.ratio is None


def test_replicas_that_stepped_alone_are_judged_with_the_drift_since_they_last_averaged() -> None:
    """Two replicas kept apart for rounds (one rejected the other, or the link was cut) drift
    apart by more than one round's progress; our slow weights' drift since we last averaged
    widens the bound by as much, so an honest partner is taken back, while x1000 still is not."""
    phi, theta = replica(7, step=0.01)
    g = torch.Generator().manual_seed(8)
    drift = 0.5 * float(phi.norm())  # far past the floor and four rounds of our own progress
    partner = phi + torch.randn(phi.shape, generator=g) / phi.numel() ** 0.5 * drift
    assert not judge(partner, phi, theta).ok
    own, phi_norm = own_progress(theta, phi)
    back = check_outer(partner, phi, own, phi_norm, factor=FACTOR, floor=FLOOR, drift=drift)
    assert back.ok and back.ratio < 1.5
    poisoned = check_outer(theta * 1000, phi, own, phi_norm, factor=FACTOR, floor=FLOOR, drift=drift)
    assert not poisoned.ok


def test_a_shard_is_judged_against_the_matching_slice_of_phi_and_the_whole_own_norm() -> None:
    phi, theta = replica(5, n=1200)
    own, phi_norm = own_progress(theta, phi)
    shard = slice(400, 800)
    ok = check_outer(theta[shard], phi[shard], own, phi_norm, factor=FACTOR, floor=FLOOR)
    bad = check_outer(theta[shard] * 1000, phi[shard], own, phi_norm, factor=FACTOR, floor=FLOOR)
    assert ok.ok and not bad.ok and bad.reason == "distance"


def test_distances_are_exact_in_float64_over_slices() -> None:
    """The float64 slice sums agree with a float64 norm, across the slice boundary too."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(plausible.SLICE + 17, generator=g), torch.randn(plausible.SLICE + 17, generator=g)
    assert plausible.distance(a, b) == pytest.approx(float((a.double() - b.double()).norm()), rel=1e-12)
    assert own_progress(a, b)[1] == pytest.approx(float(b.double().norm()), rel=1e-12)


def test_rows_of_absurd_size_or_non_finite_are_rejected() -> None:
    rows = torch.randn(4, 8, 16)
    check_rows(rows, "activations")  # healthy: no error
    check_rows(torch.zeros(0, 8, 16), "activations")
    huge = rows.clone()
    huge[2] *= plausible.MAX_ROW_RMS * 10
    with pytest.raises(Implausible) as e:
        check_rows(huge, "activations")
    assert e.value.reason == "rms"
    overflow = rows.clone()
    overflow[1, 0, 0] = 3e38  # finite, but its square overflows float32: still far over the bound
    with pytest.raises(Implausible) as e:
        check_rows(overflow, "gradients")
    assert e.value.reason == "rms"
    nan = rows.clone()
    nan[3, 1, 1] = float("nan")
    with pytest.raises(Implausible) as e:
        check_rows(nan, "gradients")
    assert e.value.reason == "nonfinite"


def test_a_rejected_peer_is_avoided_for_the_configured_outer_steps_then_forgiven() -> None:
    H = 5
    avoid = Avoidance()
    avoid.avoid("p", step=10, rounds=2, inner_steps=H)
    assert [avoid.avoided("p", t) for t in (15, 20, 25)] == [True, True, False]
    assert not avoid.avoided("q", 15)
    assert "p" not in avoid.until  # forgotten once expired
    avoid.avoid("p", step=10, rounds=0, inner_steps=H)  # 0: every exchange judged afresh
    assert not avoid.avoided("p", 15)
    avoid.avoid("p", step=10, rounds=3, inner_steps=H)
    avoid.avoid("p", step=15, rounds=1, inner_steps=H)  # a later, shorter rejection never shortens it
    assert avoid.until["p"] == 25


def test_the_config_refuses_a_disabled_check() -> None:
    with pytest.raises(ValueError, match="plausible_factor"):
        OuterConfig(plausible_factor=0.0)
    with pytest.raises(ValueError, match="avoid_rounds"):
        OuterConfig(avoid_rounds=-1)
    default = OuterConfig()  # admits every honest pair measured, with a margin
    assert (
        default.plausible_factor == FACTOR and default.plausible_floor >= 3 * plausible.MEASURED_FLOOR_NEEDED
    )


def test_poison_failpoints_corrupt_what_is_sent_once_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        failpoints,
        "_left",
        failpoints.parse(
            "poison_scale:rpc_exchange=1,poison_nan:rpc_exchange@1=1,poison_shape:rpc_exchange@2=1"
        ),
    )
    monkeypatch.setattr(failpoints, "_poisoned", {})
    theta = torch.arange(1.0, 10.0)
    sent = [failpoints.poison("rpc_exchange", (k,), (theta,))[0] for k in range(4)]
    assert torch.equal(sent[0], theta * 1000)
    assert sent[1].isnan().sum() in range(1, 5) and sent[1].shape == theta.shape
    assert sent[2].shape == (8,)
    assert sent[3] is theta  # nothing more fires: the true weights, not a copy
    again = failpoints.poison("rpc_exchange", (1,), (theta,))[0]  # a call made again: the same poison
    assert again.isnan().any()
    assert torch.equal(theta, torch.arange(1.0, 10.0))  # our own weights are never touched
