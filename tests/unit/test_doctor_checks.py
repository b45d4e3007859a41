"""`noloco doctor`'s offline checks: the memory estimate (6 x 4 bytes per stage parameter, plus the
batch's share), ports, and what noloco join would refuse."""

from __future__ import annotations

import socket

from noloco_swarm.cli.doctor_local import config_check, listen_ports, memory_check, port_check
from noloco_swarm.model.presets import count_parameters
from noloco_swarm.train import memory
from noloco_swarm.train.layering import build_config


def test_state_is_six_fp32_copies_of_the_stage() -> None:
    cfg = build_config("tiny", "noloco", assignments={"num_stages": "2"}, env={})
    parts = [memory.estimate(cfg, s) for s in range(2)]
    assert sum(p.parameters for p in parts) == count_parameters(cfg.model)
    assert all(p.state == 24 * p.parameters for p in parts)
    assert parts[0].logits == 0 < parts[1].logits  # only the last stage holds logits
    assert memory.largest(cfg) == max(parts, key=lambda p: p.total)


def test_activations_grow_with_the_batch() -> None:
    small = build_config("tiny", "noloco", assignments={"inner.batch_size": "2"}, env={})
    big = build_config("tiny", "noloco", assignments={"inner.batch_size": "8"}, env={})
    a, b = memory.estimate(small, 0), memory.estimate(big, 0)
    assert b.activations == 4 * a.activations and b.state == a.state


def test_a_memory_cap_below_the_estimate_fails_with_a_fix() -> None:
    cfg = build_config("tiny", "noloco", assignments={}, env={})
    check = memory_check(cfg, None, limit_gib=0.25)  # below the process overhead alone
    assert not check.ok and "--memory-limit" in check.detail and "inner.batch_size" in check.fix


def test_a_held_port_is_not_free() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        check = port_check("127.0.0.1", port, "listen port", "choose another")
    assert not check.ok and check.fix == "choose another"
    assert port_check("127.0.0.1", port, "listen port", "-").ok  # released: free again


def test_fixed_listen_ports_are_found() -> None:
    maddrs = ["/ip4/0.0.0.0/tcp/31337", "/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/31338", "/ip4/1.2.3.4/udp/5/quic"]
    assert listen_ports(maddrs) == [("0.0.0.0", 31337), ("::", 31338)]


def test_cuda_without_a_device_says_so() -> None:
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    cfg = build_config("tiny", "noloco", assignments={"peer.device": "cuda"}, env={})
    check = memory_check(cfg, None, limit_gib=None)
    assert not check.ok and "no CUDA device" in check.detail and "--device cpu" in check.fix


def test_a_config_join_would_refuse_fails_the_config_check() -> None:
    cfg = build_config("tiny", "allreduce", assignments={}, env={})
    check = config_check(cfg.refusals("peer", {"method": "--method"}))
    assert not check.ok and check.detail.startswith(
        "method allreduce (set by --method) runs only in the simulator"
    )
    assert config_check([]).ok


def test_a_clock_off_the_bootstrap_s_beyond_the_ping_s_uncertainty_fails_with_a_fix() -> None:
    from noloco_swarm.cli.doctor_net import CLOCK_TOLERANCE, clock_verdict

    assert clock_verdict("clock", 0.3, 0.01).ok
    assert clock_verdict("clock", -CLOCK_TOLERANCE - 0.5, 1.0).ok  # the ping cannot tell
    behind = clock_verdict("clock", 42.0, 0.01)
    ahead = clock_verdict("clock", -42.0, 0.01)
    assert not behind.ok and "42.0 s behind the bootstrap's" in behind.detail and "ntp" in behind.fix
    assert not ahead.ok and "42.0 s ahead of the bootstrap's" in ahead.detail
