"""The wall-clock model against cases worked out by hand (seconds of the model, not of any run)."""

from __future__ import annotations

import math

import pytest

from noloco_swarm.model.presets import count_parameters, get_preset, layer_parameters
from noloco_swarm.sim.flows import Graph, Task, max_min_rates
from noloco_swarm.sim.wallclock import (
    Link,
    Schedule,
    StageCost,
    Swarm,
    compute_bound_tokens_per_s,
    exchange_bytes,
    preset_stages,
    resource_bound_s,
    simulate,
    stage_flops_per_token,
    wire_bytes,
)

FAST = Link.symmetric(math.inf)
MB = 1e6  # bytes per second of an 8 Mbit/s link


def swarm(stages: list[StageCost], link: Link = FAST, **kw: int) -> Swarm:
    fields: dict = {"replicas": 1, "batch": 4, "seq_len": 10, "hidden": 100, "inner_steps": 4} | kw
    return Swarm(tuple(stages), link=link, **fields)


def test_wire_bytes_per_format() -> None:
    # 10 tokens x 100 channels: 4/2/1 bytes per element, int8 with one 4-byte scale per token,
    # and 8 bytes of token id per token going forward.
    assert wire_bytes(1, 10, 100, "fp32", token_ids=True) == 10 * (400 + 8)
    assert wire_bytes(1, 10, 100, "bf16", token_ids=False) == 10 * 200
    assert wire_bytes(2, 10, 100, "int8", token_ids=False) == 2 * 10 * (100 + 4)


def test_one_batch_in_flight_over_one_hop_is_compute_plus_two_transfers_plus_a_round_trip() -> None:
    link = Link.symmetric(8, rtt_s=0.1)  # 1e6 bytes/s
    stages = [StageCost(0.1, 0.2, params=0), StageCost(0.3, 0.6, params=0)]
    sw = swarm(stages, link, batch=1)
    t = simulate(sw, Schedule(microbatches=1))
    act, grad = wire_bytes(1, 10, 100, "fp32", True) / MB, wire_bytes(1, 10, 100, "fp32", False) / MB
    compute = 0.1 + (0.3 + 0.6) + 0.2
    assert t.step_s == pytest.approx(compute + act + grad + 0.1)
    assert t.period_s == pytest.approx(4 * t.step_s)  # D = 1: the exchange has no partner
    assert t.tokens_per_s == pytest.approx(10 / t.step_s)


def test_compute_bound_pipeline_with_a_flush_takes_m_plus_p_minus_one_slots() -> None:
    # P = 2, forward 1 s and backward 2 s per sample, one sample per microbatch, free links.
    # Stage 1 (forward and backward, 3 s) is the bottleneck: 1 s of fill, 4 x 3 s, 2 s of drain.
    stages = [StageCost(1.0, 2.0, params=0), StageCost(1.0, 2.0, params=0)]
    t = simulate(swarm(stages), Schedule(microbatches=4))
    assert t.step_s == pytest.approx(1 + 4 * 3 + 2)
    assert t.utilisation == pytest.approx(12 / 15)
    assert t.busy == pytest.approx((12 / 15, 12 / 15))  # both stages compute 12 s of each 15


def test_uneven_microbatches_fill_and_drain_with_their_own_sizes() -> None:
    # The same pipeline with B = 4 cut 1,2,1: 1 s of fill (stage 0's forward of one sample),
    # stage 1's 3 + 6 + 3 s back to back (microbatch 1's rows are in after 3 s, as it finishes
    # microbatch 0). Stage 0's backward of microbatch 1 (4 s) starts at 10, when its gradients
    # return, and outlasts stage 1's last 3 s: it ends at 14, and the last sample's 2 s follow.
    stages = [StageCost(1.0, 2.0, params=0), StageCost(1.0, 2.0, params=0)]
    t = simulate(swarm(stages), Schedule(microbatches=3, microbatch_sizes=(1, 2, 1)))
    assert t.step_s == pytest.approx(10 + 4 + 2)
    # Sizes equal to the even split are the even split; sizes must cut the batch.
    even = simulate(swarm(stages), Schedule(microbatches=2))
    assert simulate(swarm(stages), Schedule(microbatches=2, microbatch_sizes=(2, 2))) == even
    with pytest.raises(ValueError, match="must be 2 sizes of at least 1 that sum to the batch of 4"):
        simulate(swarm(stages), Schedule(microbatches=2, microbatch_sizes=(1, 2)))
    with pytest.raises(ValueError, match="need 3 microbatch sizes"):
        Schedule(microbatches=3, microbatch_sizes=(2, 2))


def test_many_microbatches_are_bounded_by_the_slowest_resource() -> None:
    # Negligible compute; stage 0's uplink carries 1 s of activations per step and stage 1's
    # uplink 1 s of gradients, on different links, so a deep pipeline nears 1 s per step.
    hidden, seq, batch = 100, 10, 64
    rate_mbit = wire_bytes(batch, seq, hidden, "fp32", True) * 8 / 1e6  # 1 s of activations per step
    stages = [StageCost(1e-9, 2e-9, params=0), StageCost(1e-9, 2e-9, params=0)]
    sw = swarm(stages, Link.symmetric(rate_mbit), batch=batch)
    one = simulate(sw, Schedule(microbatches=1)).step_s
    deep = simulate(sw, Schedule(microbatches=batch)).step_s
    grad = wire_bytes(batch, seq, hidden, "fp32", False) / wire_bytes(batch, seq, hidden, "fp32", True)
    assert one == pytest.approx(1 + grad, rel=1e-6)  # the two legs one after the other
    assert 1.0 < deep <= 1.0 + 2 / batch  # the legs overlap; fill and drain cost a microbatch each
    assert resource_bound_s(sw, Schedule(microbatches=batch)) == pytest.approx(1.0)  # stage 0's uplink


def test_the_wire_format_scales_a_transfer_bound_step() -> None:
    stages = [StageCost(0.0, 0.0, params=0), StageCost(0.0, 0.0, params=0)]
    sw = swarm(stages, Link.symmetric(8), batch=1)
    steps = {w: simulate(sw, Schedule(wire=w)).step_s for w in ("fp32", "bf16", "int8")}
    for w, t in steps.items():
        expected = (wire_bytes(1, 10, 100, w, True) + wire_bytes(1, 10, 100, w, False)) / MB
        assert t == pytest.approx(expected)


@pytest.mark.parametrize(
    ("params", "k"), [(625_000, 0), (625_000, 2), (625_000, 5), (625_000, 9), (2_500_000, 9)]
)
def test_overlap_hides_the_exchange_once_k_steps_of_compute_exceed_it(params: int, k: int) -> None:
    # One stage, two replicas: no pipeline traffic, 1 s of compute per step, and a pairwise swap
    # of 4 bytes per parameter at 1e6 bytes/s plus 0.05 s one way: 2.55 s (or 10.05 s, longer
    # than even k = H - 1 = 9 steps).
    stage = StageCost(0.25, 0.0, params=params)  # 4 samples x 0.25 s = 1 s per step
    sw = swarm([stage], Link.symmetric(8, rtt_s=0.1), replicas=2, inner_steps=10)
    t = simulate(sw, Schedule(overlap_steps=k))
    exchange = params * 4 / MB + 0.05
    assert t.step_s == pytest.approx(1.0)
    assert t.period_s == pytest.approx(10 + max(exchange - k, 0.0))
    # the floor amortises the exchange's bytes over H steps: 0.25 s a step, below the compute
    assert resource_bound_s(sw, Schedule(overlap_steps=k)) == pytest.approx(1.0)


def test_diloco_all_reduce_moves_two_shards_phases_against_nolocos_one_swap() -> None:
    stage = StageCost(0.0, 0.0, params=1_000_000)  # 4e6 bytes of fp32
    sw = swarm([stage], Link.symmetric(8, rtt_s=0.1), replicas=4, inner_steps=2)
    noloco = simulate(sw, Schedule(exchange="noloco"))
    diloco = simulate(sw, Schedule(exchange="diloco"))
    assert noloco.exchange_s == pytest.approx(4.0 + 0.05)
    # reduce-scatter: 3 shards of 1e6 bytes share the uplink (3 s), then the all-gather likewise
    assert diloco.exchange_s == pytest.approx(2 * (3.0 + 0.05))
    assert exchange_bytes(1_000_000, Schedule(exchange="diloco"), 4) == 6e6
    assert exchange_bytes(1_000_000, Schedule(exchange="noloco"), 4) == 4e6


def test_a_slow_peer_slows_the_whole_pipeline() -> None:
    stages = [StageCost(0.0, 0.0, params=0), StageCost(0.0, 0.0, params=0)]
    even = swarm(stages, Link.symmetric(8), replicas=2, batch=2)
    slow = Swarm(**{**even.__dict__, "links": ((1, 1, Link.symmetric(2)),)})
    assert simulate(slow, Schedule()).step_s > 2 * simulate(even, Schedule()).step_s


def test_unshaped_links_and_many_microbatches_approach_full_utilisation() -> None:
    stages = [StageCost(1.0, 2.0, params=0)] * 3
    sw = swarm(stages, batch=64)
    assert simulate(sw, Schedule(microbatches=64)).utilisation == pytest.approx(64 / 66)
    assert compute_bound_tokens_per_s(sw) == pytest.approx(640 / (64 * 3.0))


def test_preset_flops_follow_the_6n_convention() -> None:
    cfg = get_preset("small")
    per_token = sum(stage_flops_per_token(cfg, 4))
    matmul_params = cfg.num_layers * layer_parameters(cfg) + cfg.hidden_size * cfg.vocab_size
    attention = cfg.num_layers * 4 * cfg.seq_len * cfg.hidden_size
    assert per_token == 2 * matmul_params + attention
    stages = preset_stages(cfg, 4, flops_per_s=1e15)
    assert sum(s.params for s in stages) == count_parameters(cfg)
    assert all(s.backward_s == 2 * s.forward_s for s in stages)


def test_the_short_cut_over_steady_steps_equals_playing_out_whole_periods() -> None:
    # A pipelined, link-bound swarm whose overlapped exchange slows the steps it shares links with.
    stages = [StageCost(0.01, 0.02, params=200_000), StageCost(0.02, 0.04, params=100_000)]
    sw = swarm(stages, Link.symmetric(8, rtt_s=0.05), replicas=2, batch=4, inner_steps=12)
    for schedule in (Schedule(microbatches=2, overlap_steps=3), Schedule(exchange="diloco")):
        short, exact = simulate(sw, schedule), simulate(sw, schedule, exact=True)
        assert short.period_s == pytest.approx(exact.period_s, rel=1e-9)
        assert short.step_s == pytest.approx(exact.step_s, rel=1e-9)
        assert short.exchange_s == pytest.approx(exact.exchange_s, rel=1e-9)


def test_links_are_shared_max_min_fairly() -> None:
    # Peers 0..3. Flow a: 0 -> 1, b: 0 -> 2, c: 3 -> 2. Peer 2's downlink (0.4) is the tightest:
    # b and c get 0.2 each; a then takes what b leaves of peer 0's uplink (1.0).
    graph = Graph([1.0] * 4, [1.0, 1.0, 0.4, 1.0])
    a, b, c = (graph.add(Task("flow", peer=p, dst=q, amount=1.0), []) for p, q in ((0, 1), (0, 2), (3, 2)))
    rates = max_min_rates({a: 1.0, b: 1.0, c: 1.0}, graph.tasks, graph.capacity)
    assert rates == pytest.approx({a: 0.8, b: 0.2, c: 0.2})
    graph.run()  # b and c end at 5 s; a at 1 / 0.8 = 1.25 s
    assert [graph.tasks[t].end for t in (a, b, c)] == pytest.approx([1.25, 5.0, 5.0])
