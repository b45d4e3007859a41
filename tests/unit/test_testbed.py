"""The testbed's pure parts (names, tc commands, fault schedules) and the delay relay on loopback."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time

import pytest

from noloco_swarm.cli.main import main, parser
from noloco_swarm.testbed.bed import LINK, NAME, Testbed, default_burst_kbit, shaping_commands
from noloco_swarm.testbed.delay import DelayRelay, Route
from noloco_swarm.testbed.schedule import Action, Timeline, parse_cut, parse_rate, parse_shape

NET = ipaddress.IPv4Network("10.77.5.0/24")


def test_names_are_per_process_short_and_parseable() -> None:
    a, b = Testbed(["boot", "s0r0", "s1r1"], subnet=NET), Testbed(["boot"], subnet=NET)
    assert a.tag != b.tag and a.bridge != b.bridge, "two testbeds of one process must not clash"
    for bed in (a, b):
        links = [bed.bridge] + [h.veth for h in bed.hosts.values()]
        assert all(len(name) <= 15 for name in links), "Linux interface names are at most 15 characters"
        assert all(int(LINK.match(name).group(1), 16) == os.getpid() for name in links)
        for host in bed.hosts.values():
            assert int(NAME.match(host.netns).group(1), 16) == os.getpid()
    assert a.gateway == "10.77.5.1"
    assert [h.address for h in a.hosts.values()] == ["10.77.5.2", "10.77.5.3", "10.77.5.4"]
    assert a.hosts["s0r0"].maddr(31337) == "/ip4/10.77.5.3/tcp/31337"
    assert a.hosts["s0r0"].maddr(31337, "quic") == "/ip4/10.77.5.3/udp/31337/quic-v1"
    assert a.argv("s1r1", ["true"]) == ["ip", "netns", "exec", a.hosts["s1r1"].netns, "true"]


def test_host_names_are_checked() -> None:
    with pytest.raises(ValueError, match="distinct"):
        Testbed(["a", "a"], subnet=NET)


def test_shaping_commands() -> None:
    assert shaping_commands("eth0", 10, burst_kbit=64, latency_ms=100, qdisc="tbf") == [
        ["qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", "10mbit", "burst", "64kbit",
         "latency", "100ms"]
    ]  # fmt: skip
    htb = shaping_commands("v0", 2.5, burst_kbit=32, latency_ms=100, qdisc="htb")
    assert htb[0][-4:] == ["1:", "htb", "default", "10"]
    assert htb[1][-6:] == ["rate", "2.5mbit", "ceil", "2.5mbit", "burst", "32kbit"]
    with pytest.raises(ValueError, match="positive"):
        shaping_commands("v0", 0, burst_kbit=32, latency_ms=100, qdisc="tbf")
    with pytest.raises(ValueError, match="tbf"):
        shaping_commands("v0", 1, burst_kbit=32, latency_ms=100, qdisc="netem")
    # the default bucket: 10 ms of the rate, at least 32 kB
    assert default_burst_kbit(100) == 1000 and default_burst_kbit(1000) == 10000
    assert default_burst_kbit(10) == 256


def test_rates_shapes_and_cuts_parse() -> None:
    assert parse_rate("10") == 10.0 and parse_rate("500kbit") == 0.5 and parse_rate("1Gbit") == 1000.0
    assert parse_shape("s1r0=20mbit").rate_mbit == 20.0
    assert parse_cut("s1r0@30+20") == (Action(30, "cut", "s1r0"), Action(50, "restore", "s1r0"))
    assert parse_cut("boot@1.5s+2s")[1].at == 3.5
    for bad in ("s1r0", "s1r0@30", "s1r0@x+2", "s1r0@3+0"):
        with pytest.raises(ValueError, match=r"HOST@T|positive"):
            parse_cut(bad)
    for bad in ("fast", "-1", "0"):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="HOST=RATE"):
        parse_shape("10mbit")


def test_timeline_hands_out_each_action_once_in_order() -> None:
    t = Timeline.of_cuts(["a@10+20", "b@5+5"])
    assert t.hosts() == {"a", "b"}
    assert t.due(4.9) == []
    assert [(x.kind, x.host) for x in t.due(10)] == [("cut", "b"), ("restore", "b"), ("cut", "a")]
    assert t.due(10) == []
    assert [(x.at, x.kind) for x in t.due(100)] == [(30, "restore")]
    assert t.pending() == ()
    # A restore and a cut at the same time: the restore first, so a back-to-back cut stays cut.
    same = Timeline([Action(5, "cut", "a"), Action(5, "restore", "a")])
    assert [x.kind for x in same.due(5)] == ["restore", "cut"]


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_relay_adds_the_configured_delay_each_way_and_keeps_bytes_in_order() -> None:
    server, thread = _echo_server()
    port = server.getsockname()[1]
    forward, backward = 0.15, 0.1
    with (
        DelayRelay([Route("127.0.0.1", 0, "127.0.0.1", port, forward, backward)]) as relay,
        socket.create_connection(("127.0.0.1", relay.ports[0]), timeout=10) as s,
    ):
        payload = bytes(range(256)) * 2000  # 512 KB: several chunks, in order
        start = time.monotonic()
        s.sendall(b"ping")
        assert s.recv(4) == b"ping"
        rtt = time.monotonic() - start
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += s.recv(65536)
        assert got == payload
        s.shutdown(socket.SHUT_WR)  # EOF crosses the relay too: the echo server ends
        assert s.recv(1) == b""
    thread.join(timeout=5)
    server.close()
    assert rtt >= forward + backward, f"round trip {rtt:.3f} s is below the configured delays"


def test_a_delay_changed_while_serving_applies_to_what_is_read_next() -> None:
    """A delay spike: the same connection's round trip grows when the delay is raised and falls
    back when it is lowered, and no byte is lost or reordered across either change."""
    server, thread = _echo_server()
    port = server.getsockname()[1]

    def round_trip(s: socket.socket, tag: bytes) -> float:
        start = time.monotonic()
        s.sendall(tag)
        got = b""
        while len(got) < len(tag):
            got += s.recv(65536)
        assert got == tag
        return time.monotonic() - start

    with (
        DelayRelay([Route("127.0.0.1", 0, "127.0.0.1", port, 0.0, 0.0)]) as relay,
        socket.create_connection(("127.0.0.1", relay.ports[0]), timeout=10) as s,
    ):
        quiet = round_trip(s, b"before")
        relay.set_delay(0, 0.2, 0.1)
        time.sleep(0.05)  # the change is made on the relay's own loop
        spiked = round_trip(s, b"during")
        relay.set_delay(0, 0.0, 0.0)
        time.sleep(0.05)
        after = round_trip(s, b"after!")
        with pytest.raises(ValueError, match=">= 0 s"):
            relay.set_delay(0, -1.0, 0.0)
        s.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b""
    thread.join(timeout=5)
    server.close()
    assert spiked >= 0.3, f"round trip {spiked:.3f} s under a 0.3 s delay spike"
    assert quiet < spiked and after < spiked, (quiet, spiked, after)


def test_relay_refuses_a_bad_route_and_reports_a_taken_port() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        Route("127.0.0.1", 0, "127.0.0.1", 1, -1, 0)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        route = Route("127.0.0.1", taken.getsockname()[1], "127.0.0.1", 1, 0, 0)
        with pytest.raises(RuntimeError, match="did not start"), DelayRelay([route]):
            pass


def test_relay_closes_the_client_when_the_target_is_unreachable() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        dead = probe.getsockname()[1]  # closed below: nothing listens there
    with (
        DelayRelay([Route("127.0.0.1", 0, "127.0.0.1", dead, 0, 0)]) as relay,
        socket.create_connection(("127.0.0.1", relay.ports[0]), timeout=10) as s,
    ):
        s.settimeout(10)
        assert s.recv(1) == b""


def test_relay_stops_with_connections_open() -> None:
    server, _ = _echo_server()
    with DelayRelay([Route("127.0.0.1", 0, "127.0.0.1", server.getsockname()[1], 0.01, 0.01)]) as relay:
        client = socket.create_connection(("127.0.0.1", relay.ports[0]), timeout=10)
        client.sendall(b"x")
        assert client.recv(1) == b"x"
    assert not relay._thread.is_alive(), "the relay's thread must end with the block"
    client.close()
    server.close()


def test_cli_takes_the_testbed_flags_and_refuses_bad_ones_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parser().parse_args(
        [
            "testbed",
            "--shape",
            "s1r0=10mbit",
            "--cut",
            "s1r0@30+20",
            "--delay-ms",
            "50",
            "--step-timeout",
            "10",
        ]
    )
    assert (args.shape, args.cut, args.delay_ms, args.step_timeout) == (
        ["s1r0=10mbit"],
        ["s1r0@30+20"],
        50,
        10,
    )
    assert args.cut_mode == "drop" and args.transport == "tcp"
    assert parser().parse_args(["testbed", "--transport", "quic"]).transport == "quic"
    assert main(["testbed", "--shape", "fast"]) == 2
    assert main(["testbed", "--cut", "s1r0@soon"]) == 2
    err = capsys.readouterr().err
    assert "HOST=RATE" in err and "HOST@T+DURATION" in err
    # The delay relay carries TCP only: a QUIC testbed with a delay is refused before it starts.
    assert main(["testbed", "--transport", "quic", "--delay", "s1r0=40"]) == 2
    assert "carries TCP only" in capsys.readouterr().err
