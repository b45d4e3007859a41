"""A real swarm's peers serve Prometheus metrics; scraped over HTTP, they match what the peers did."""

from __future__ import annotations

import dataclasses
import math
import socket
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from noloco_swarm.harness.local import local_swarm
from noloco_swarm.peer.events import Dropped, Final, Outer, Retried, Step, of_kind
from noloco_swarm.train.layering import build_config

pytestmark = pytest.mark.integration
STEPS = 7  # H = 3: two outer steps


def free_ports(count: int) -> int:
    """A base port with `count` free ports after it (held while checked, then released)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        with ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError("no run of free ports found")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample at the endpoint, keyed by (name, sorted labels), parsed by the client library."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_peer_serves_its_metrics(cache: Path, one_thread: None) -> None:
    assignments = {
        "model.seq_len": "32",
        "inner.batch_size": "2",
        "outer.inner_steps": "3",
        "eval_windows": "4",
        "peer.metrics_host": "127.0.0.1",
        "peer.metrics_linger": "300",  # serve the final values until the test has read them
    }
    cfg = build_config("tiny", "noloco", assignments=assignments, env={})
    base = free_ports(4)
    cfg = cfg.replace(peer=dataclasses.replace(cfg.peer, metrics_port=base))
    with local_swarm(cfg, STEPS, step_timeout=60) as swarm:
        deadline = time.monotonic() + 400
        while not all(of_kind(p.events(), Final) for p in swarm.peers):
            failed = swarm.failed()
            assert not failed, failed[0].log_tail()
            assert time.monotonic() < deadline, "the swarm did not finish"
            time.sleep(1)
        assert any(of_kind(p.events(), Final)[0].val_loss is not None for p in swarm.peers)
        for index, peer in enumerate(swarm.peers):
            events = peer.events()
            final = of_kind(events, Final)[0]
            steps, outers = of_kind(events, Step), of_kind(events, Outer)
            got = scrape(base + index)
            assert got[("noloco_steps_total", ())] == STEPS == final.steps
            assert got[("noloco_step", ())] == STEPS
            assert got[("noloco_outer_steps_total", ())] == 2 == len(outers)
            assert got[("noloco_tokens_total", ())] == final.tokens
            assert (final.tokens > 0) == (peer.stage == 0)
            assert got[("noloco_step_seconds_count", ())] == STEPS
            assert got[("noloco_step_seconds_sum", ())] == pytest.approx(sum(e.seconds for e in steps))
            assert got[("noloco_exchange_seconds_count", ())] == 2
            assert got[("noloco_exchange_bytes_total", (("direction", "sent"),))] == sum(
                e.sent_bytes for e in outers
            )
            assert got[("noloco_tokens_per_second", ())] == pytest.approx(steps[-1].tokens_per_second)
            if peer.stage == 1:  # the last stage computes the loss
                assert got[("noloco_loss", ())] == pytest.approx(steps[-1].loss)
            if final.val_loss is None:  # evaluated where the samples start: stage 0
                assert math.isnan(got[("noloco_validation_loss", ())])
            else:
                assert got[("noloco_validation_loss", ())] == pytest.approx(final.val_loss)
            for stage in (0, 1):
                assert got[("noloco_stage_members", (("stage", str(stage)),))] == 2
            partners = ",".join(outers[-1].partners)
            info = [k for k in got if k[0] == "noloco_last_outer_info"]
            assert len(info) == 1 and ("partners", partners) in info[0][1]
            assert ("peer_id", final.peer_id) in next(k for k in got if k[0] == "noloco_peer_info")[1]
            for side in ("sender", "receiver"):
                dropped = sum(e.samples for e in of_kind(events, Dropped) if e.side == side)
                assert got[("noloco_dropped_samples_total", (("side", side),))] == dropped
            for call in ("forward", "exchange"):
                retried = sum(1 for e in of_kind(events, Retried) if e.call == call)
                assert got[("noloco_retried_calls_total", (("call", call),))] == retried
            # Bytes by kind from the transport: the exchange with our stage's partner, rows with the
            # other stage. Both at least what the events counted.
            stage_sent = got[("noloco_transport_bytes_total", (("direction", "sent"), ("kind", "stage")))]
            rows_sent = got[
                ("noloco_transport_bytes_total", (("direction", "sent"), ("kind", "activations")))
            ]
            assert stage_sent >= sum(e.sent_bytes for e in outers) > 0
            assert rows_sent > 0
            assert sum(final.bytes[p]["sent_total"] for p in final.bytes) <= stage_sent + rows_sent + got.get(
                ("noloco_transport_bytes_total", (("direction", "sent"), ("kind", "other"))), 0
            )
            assert got[("noloco_finished", ())] == 1
            assert got[("process_resident_memory_bytes", ())] > 0
