"""The wall-clock model against cases worked out by hand (seconds of the model, not of any run)."""

from __future__ import annotations

import math

import pytest

from noloco_swarm.model.presets import count_parameters, get_preset, layer_parameters
from noloco_swarm.sim.costs import preset_stages, stage_flops_per_token
from noloco_swarm.sim.flows import Graph, Task, max_min_rates
from noloco_swarm.sim.wallclock import (
    Link,
    Schedule,
    StageCost,
    Swarm,
    compute_bound_tokens_per_s,
    exchange_bytes,
    resource_bound_s,
    simulate,
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


def test_subspace_sends_its_coefficients_and_an_int32_token_id_each_way() -> None:
    # rank 8: 8 bf16 coefficients and a 4-byte token id per token, forward and back, whatever
    # the hidden size; bf16 at hidden 100 sends 200 bytes per token back and 208 forward.
    assert wire_bytes(1, 10, 100, "subspace", token_ids=True, rank=8) == 10 * (16 + 4)
    assert wire_bytes(3, 10, 100, "subspace", token_ids=False, rank=8) == 3 * 10 * (16 + 4)
    with pytest.raises(ValueError, match=r"rank must be in 1\.\.100"):
        wire_bytes(1, 10, 100, "subspace", token_ids=True, rank=101)
    with pytest.raises(ValueError, match="needs a rank >= 1, and only it"):
        Schedule(wire="subspace")
    with pytest.raises(ValueError, match="needs a rank >= 1, and only it"):
        Schedule(wire="bf16", rank=8)
    # A transfer-bound hop (1e6 bytes/s, no compute): 200 bytes each way.
    stages = [StageCost(0.0, 0.0, params=0), StageCost(0.0, 0.0, params=0)]
    t = simulate(swarm(stages, Link.symmetric(8), batch=1), Schedule(wire="subspace", rank=8))
    assert t.step_s == pytest.approx(2 * 200 / MB)


def test_the_stack_adds_its_round_trips_to_every_pipeline_message() -> None:
    # The one-hop case above with 2 round trips of 0.1 s added to each of the two messages.
    link = Link.symmetric(8, rtt_s=0.1)
    stages = [StageCost(0.1, 0.2, params=0), StageCost(0.3, 0.6, params=0)]
    bare = simulate(swarm(stages, link, batch=1), Schedule()).step_s
    stacked = Swarm(**{**swarm(stages, link, batch=1).__dict__, "hop_rtts": 2.0})
    assert simulate(stacked, Schedule()).step_s == pytest.approx(bare + 2 * 2 * 0.1)
    # The exchange, one long transfer, is not charged them.
    stage = StageCost(0.25, 0.0, params=625_000)
    pair = swarm([stage], link, replicas=2, inner_steps=10)
    assert simulate(Swarm(**{**pair.__dict__, "hop_rtts": 2.0}), Schedule()).exchange_s == pytest.approx(
        2.5 + 0.05
    )


def test_the_exchange_runs_at_its_goodput_share_of_the_link() -> None:
    # A 10 Mbit/s link (1.25e6 bytes/s) whose flows carry 80% payload (1e6 bytes/s). The exchange
    # gets half the link's rate: 2.5e6 bytes each way at 6.25e5 bytes/s, 4 s plus 0.05 s one way.
    stage = StageCost(0.25, 0.0, params=625_000)
    link = Link(10, 10, rtt_s=0.1, efficiency=0.8)
    sw = Swarm(**{**swarm([stage], link, replicas=2, inner_steps=10).__dict__, "exchange_goodput": 0.5})
    t = simulate(sw, Schedule())
    assert t.exchange_s == pytest.approx(4.0 + 0.05)
    assert t.period_s == pytest.approx(10 + 4.05)
    # the floor: 4 s of exchange over H = 10 steps, 0.4 s a step, below the 1 s of compute
    assert resource_bound_s(sw, Schedule()) == pytest.approx(1.0)
    slow = Swarm(**{**sw.__dict__, "exchange_goodput": 0.1})  # 20 s: 2 s a step
    assert resource_bound_s(slow, Schedule()) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="exchange_goodput"):
        Swarm(**{**sw.__dict__, "exchange_goodput": 1.5})


@pytest.mark.parametrize(
    "schedule",
    [
        Schedule(microbatches=4, overlap_steps=2),
        Schedule(microbatches=2, wire="subspace", rank=10, overlap_steps=5),
        Schedule(exchange="diloco", overlap_steps=1),
        Schedule(group_size=4),
    ],
)
def test_one_played_replica_per_stage_times_a_symmetric_swarm_as_d_do(schedule: Schedule) -> None:
    # D = 4 replicas whose pipeline flows and exchange share every link: folding them into one
    # peer per stage with weighted flows must give the same times.
    stages = [StageCost(0.01, 0.02, params=200_000), StageCost(0.02, 0.04, params=100_000)]
    sw = Swarm(
        **{
            **swarm(stages, Link.symmetric(8, rtt_s=0.05), replicas=4, batch=8, inner_steps=12).__dict__,
            "hop_rtts": 1.0,
            "exchange_goodput": 0.7,
        }
    )
    folded, full = simulate(sw, schedule, fold=True), simulate(sw, schedule, fold=False)
    assert folded.period_s == pytest.approx(full.period_s, rel=1e-9)
    assert folded.step_s == pytest.approx(full.step_s, rel=1e-9)
    assert folded.exchange_s == pytest.approx(full.exchange_s, rel=1e-9)
    uneven = Swarm(**{**sw.__dict__, "links": ((1, 1, Link.symmetric(2)),)})
    with pytest.raises(ValueError, match="only a symmetric swarm can be folded"):
        simulate(uneven, schedule, fold=True)


def test_weighted_flows_get_their_shares_of_a_link() -> None:
    # One uplink of 1.0 carries a flow of weight 3 and one of weight 1: 0.75 and 0.25.
    graph = Graph([1.0, 1.0], [1.0, 1.0])
    a = graph.add(Task("flow", peer=0, dst=1, amount=3.0, weight=3), [])
    b = graph.add(Task("flow", peer=0, dst=0, amount=1.0), [])
    assert max_min_rates({a: 3.0, b: 1.0}, graph.tasks, graph.capacity) == pytest.approx({a: 0.75, b: 0.25})


def test_colocated_stages_take_turns_on_one_processor() -> None:
    # The same pipeline as above with both stages on one processor: nothing overlaps, so a step
    # is all of both stages' compute (4 x 1 + 4 x 3 + 4 x 2 = 24 s) whatever M is, and that is
    # also the compute-bound rate's step (utilisation 1) and the resource floor.
    stages = [StageCost(1.0, 2.0, params=0), StageCost(1.0, 2.0, params=0)]
    for m in (1, 2, 4):
        sw = swarm(stages, colocated=True)
        t = simulate(sw, Schedule(microbatches=m))
        assert t.step_s == pytest.approx(24)
        assert t.utilisation == pytest.approx(1.0)
        assert resource_bound_s(sw, Schedule(microbatches=m)) == pytest.approx(24)
    # On a link, one stage's compute fills the other's wait: colocated is never faster than
    # separate GPUs, and never slower than all compute and every transfer of the step in series.
    link = Link.symmetric(8)  # 1e6 bytes/s
    sep = simulate(swarm(stages, link), Schedule(microbatches=2))
    co = simulate(swarm(stages, link, colocated=True), Schedule(microbatches=2))
    transfers = (wire_bytes(4, 10, 100, "fp32", True) + wire_bytes(4, 10, 100, "fp32", False)) / MB
    assert sep.step_s < co.step_s < 24 + transfers


def test_peers_on_one_processor_share_it_equally_while_both_are_busy() -> None:
    # Peers 0 and 1 on processor 0, peer 2 on its own: 1 s and 3 s tasks on the shared one run at
    # half speed together (the 1 s one ends at 2 s), then the 3 s one alone (its 2 s left by 4 s);
    # peer 2's 1 s task is untouched. Peer 0's second task waits for its first.
    g = Graph([math.inf] * 3, [math.inf] * 3, processors=[0, 0, 1])
    a = g.add(Task("compute", peer=0, amount=1.0), [])
    b = g.add(Task("compute", peer=1, amount=3.0), [])
    c = g.add(Task("compute", peer=2, amount=1.0), [])
    d = g.add(Task("compute", peer=0, amount=1.0), [a])
    g.run()
    # Peer 0's second task runs beside b from 2 s: both at half speed until it ends at 4 s, when b
    # has 3 - 1 - 1 = 1 s left, alone from then: b ends at 5 s.
    assert [g.tasks[i].end for i in (a, b, c, d)] == pytest.approx([2.0, 5.0, 1.0, 4.0])
    with pytest.raises(ValueError, match="one processor per peer"):
        Graph([1.0], [1.0], processors=[0, 0])


def test_jobs_ending_together_finish_before_any_peer_chooses() -> None:
    # At 1 s both first tasks end; peer 0 then has c (low priority, after a) and d (high, after
    # b) ready and must take d first. One processor per peer given explicitly behaves exactly as
    # none given.
    for processors in (None, [0, 1]):
        g = Graph([math.inf] * 2, [math.inf] * 2, processors=processors)
        a = g.add(Task("compute", peer=0, amount=1.0), [])
        b = g.add(Task("compute", peer=1, amount=1.0), [])
        c = g.add(Task("compute", peer=0, amount=1.0, priority=(9, 9, 9)), [a])
        d = g.add(Task("compute", peer=0, amount=1.0, priority=(0, 0, 0)), [b])
        g.run()
        assert [g.tasks[i].end for i in (a, b, c, d)] == [1.0, 1.0, 3.0, 2.0], processors
