"""A peer's Prometheus endpoint: an event sink that keeps counters, gauges and histograms.

`Prometheus` is a `events.Sink` like `JsonLines`: the peer emits the same typed records to both,
and this one turns them into metrics in a registry of its own, served over HTTP by
`prometheus_client` (the exposition format is the library's, never written by hand). Bytes moved
per kind come from the transport's own counters at scrape time (`bytes_source`), split by the
latest view: peers of our stage are outer exchanges and join state, peers of other stages are
rows and gradients.

Every metric is named `noloco_*`. The peer's identity (run, stage, peer id) is in
`noloco_peer_info`; join it in PromQL rather than repeating it as a label on every series.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from noloco_swarm.peer import events

# Seconds: a tiny CPU step takes tens of ms, a real model's step or exchange over a slow link minutes.
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
EXCHANGE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)

ByteCounts = Callable[[], dict[str, dict[str, int]]]  # Transport.byte_counts


class _TransportBytes(Collector):
    """`noloco_transport_bytes_total{direction, kind}` read from the transport when scraped."""

    def __init__(self, source: ByteCounts, kind_of: Callable[[str], str]) -> None:
        self.source, self.kind_of = source, kind_of

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "noloco_transport_bytes",
            "Bytes moved with other peers (framing included), by direction and kind: activations "
            "(rows and gradients with neighbouring stages), stage (outer exchanges and join state "
            "with replicas of our stage), other (peers outside the current view)",
            labels=["direction", "kind"],
        )
        totals: dict[tuple[str, str], int] = {}
        for peer, counts in self.source().items():
            kind = self.kind_of(peer)
            for direction in ("sent", "received"):
                key = (direction, kind)
                totals[key] = totals.get(key, 0) + counts.get(f"{direction}_total", 0)
        for (direction, kind), value in sorted(totals.items()):
            family.add_metric([direction, kind], value)
        yield family

    def describe(self) -> list[Any]:
        return []  # values come from the transport at scrape time; nothing to check at registration


class Prometheus:
    """An event sink that keeps a peer's metrics and serves them at http://HOST:PORT/metrics.

    `port` 0 picks a free port (see `.port`). `linger` seconds: at `close()` the endpoint keeps
    serving that long (in a background thread that holds the process open), so that a scraper
    polling every 15 s still sees a finished peer's final values; 0 stops it at once.
    """

    def __init__(
        self,
        port: int,
        host: str = "0.0.0.0",
        *,
        linger: float = 0.0,
        run_id: str = "",
        bytes_source: ByteCounts | None = None,
    ) -> None:
        self.registry = registry = CollectorRegistry()
        self.run_id, self.linger = run_id, linger
        self._stages: list[list[str]] = []
        self._me = ""
        self._tokens = 0
        ProcessCollector(registry=registry)  # resident memory, CPU seconds, open files
        PlatformCollector(registry=registry)
        self.info = Info("noloco_peer", "This peer: run, stage and peer id", registry=registry)
        self.info.info({"run_id": run_id, "stage": "", "peer_id": ""})
        self.steps = Counter("noloco_steps", "Inner steps taken", registry=registry)
        self.tokens = Counter(
            "noloco_tokens", "Tokens fed into the pipeline (stage-0 peers; 0 elsewhere)", registry=registry
        )
        self.step = Gauge("noloco_step", "The inner step this peer is at", registry=registry)
        self.loss = Gauge(
            "noloco_loss", "Mean training loss of the last step (last stage only; NaN: none came back)",
            registry=registry,
        )  # fmt: skip
        self.lr = Gauge("noloco_learning_rate", "Inner learning rate of the last step", registry=registry)
        self.tokens_per_second = Gauge(
            "noloco_tokens_per_second", "Tokens per second of the last inner step", registry=registry
        )
        self.step_seconds = Histogram(
            "noloco_step_seconds", "Duration of an inner step", buckets=STEP_BUCKETS, registry=registry
        )
        self.outer_steps = Counter("noloco_outer_steps", "Outer steps taken", registry=registry)
        self.exchange_seconds = Histogram(
            "noloco_exchange_seconds",
            "Duration of an outer exchange (streaming theta both ways)",
            buckets=EXCHANGE_BUCKETS,
            registry=registry,
        )
        self.exchange_bytes = Counter(
            "noloco_exchange_bytes", "Bytes of outer exchanges", ["direction"], registry=registry
        )
        self.failed_partners = Counter(
            "noloco_failed_partners", "Outer-step partners whose tensors never arrived", registry=registry
        )
        self.partner = Info(
            "noloco_last_outer", "The last outer step: its group (ranks) and partners", registry=registry
        )
        self.dropped = Counter(
            "noloco_dropped_samples",
            "Samples lost on a hop (side sender: no gradient came back; receiver: no rows came)",
            ["side"],
            registry=registry,
        )
        self.rerouted = Counter(
            "noloco_rerouted_samples",
            "Samples sent to the stand-in of a next-stage replica that is gone, instead of dropped",
            registry=registry,
        )
        self.stood_in = Counter(
            "noloco_stood_in_samples",
            "Samples stage 0 fed from the shards of gone stage-0 replicas it stands in for",
            registry=registry,
        )
        self.carried = Counter(
            "noloco_carried_samples",
            "Samples stage 0 fed again at the step after the one where their gradient did not come back",
            registry=registry,
        )
        self.unsent = Counter(
            "noloco_unsent_samples",
            "Samples not sent to a next-stage replica that had passed their step (this peer fell behind)",
            registry=registry,
        )
        self.retried = Counter(
            "noloco_retried_calls", "Calls made again after a broken stream", ["call"], registry=registry
        )
        self.refused = Counter("noloco_refused_calls", "Our rows refused by a live peer", registry=registry)
        self.rejected = Counter(
            "noloco_rejected_outer",
            "Partners' outer-step tensors rejected as implausible, by reason",
            ["reason"],
            registry=registry,
        )
        self.gone = Counter("noloco_peers_reported_gone", "Peers this peer reported gone", registry=registry)
        self.false_reports = Counter(
            "noloco_false_reports",
            "Gone reports of peers that still answered our probe (void)",
            registry=registry,
        )
        self.excluded = Counter(
            "noloco_excluded", "Times the swarm's view left this live peer out", registry=registry
        )
        self.round = Gauge("noloco_round", "The round of this peer's latest view", registry=registry)
        self.members = Gauge(
            "noloco_stage_members", "Replicas per stage in the latest view", ["stage"], registry=registry
        )
        self.rank = Gauge("noloco_rank", "This peer's rank within its stage", registry=registry)
        self.val_loss = Gauge(
            "noloco_validation_loss", "Validation loss at the end of the run (NaN until then)", registry=registry
        )  # fmt: skip
        self.val_loss.set(float("nan"))
        self.loss.set(float("nan"))
        self.finished = Gauge("noloco_finished", "1 once the peer has finished its run", registry=registry)
        for side in ("sender", "receiver"):  # labelled series exist, at 0, before the first event
            self.dropped.labels(side)
        for call in ("forward", "exchange"):
            self.retried.labels(call)
        for direction in ("sent", "received"):
            self.exchange_bytes.labels(direction)
        if bytes_source is not None:
            registry.register(_TransportBytes(bytes_source, self._kind_of))
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._server.server_port
        self._closed = False

    # -- the sink ---------------------------------------------------------------------------

    def emit(self, event: events.Event) -> None:
        handler = getattr(self, f"_on_{event.KIND}", None)
        if handler is not None:
            handler(event)

    def close(self) -> None:
        """Stop serving, now or after `linger` seconds (a non-daemon timer keeps the process up)."""
        if self._closed:
            return
        self._closed = True
        if self.linger > 0:
            timer = threading.Timer(self.linger, self._stop)
            timer.name = "metrics-linger"
            timer.start()
        else:
            self._stop()

    def _stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- one handler per event kind ------------------------------------------------------------

    def _on_step(self, e: events.Step) -> None:
        self.steps.inc()
        self.step.set(e.step)
        if e.tokens > self._tokens:  # cumulative in the event; a counter only grows
            self.tokens.inc(e.tokens - self._tokens)
            self._tokens = e.tokens
        self.loss.set(float("nan") if e.loss is None else e.loss)
        self.lr.set(e.lr)
        self.tokens_per_second.set(e.tokens_per_second)
        self.step_seconds.observe(e.seconds)

    def _on_outer(self, e: events.Outer) -> None:
        self.outer_steps.inc()
        self.exchange_seconds.observe(e.seconds)
        self.exchange_bytes.labels("sent").inc(e.sent_bytes)
        self.exchange_bytes.labels("received").inc(e.received_bytes)
        self.failed_partners.inc(len(e.failed))
        self.partner.info(
            {
                "step": str(e.step),
                "group": ",".join(map(str, e.group)),
                "partners": ",".join(e.partners) or "(alone)",
            }
        )

    def _on_membership(self, e: events.Membership) -> None:
        self._stages, self._me = [list(s) for s in e.stages], e.peer_id
        self.round.set(e.round)
        self.rank.set(e.rank)
        for s, members in enumerate(e.stages):
            self.members.labels(str(s)).set(len(members))
        stage = next((str(s) for s, members in enumerate(e.stages) if e.peer_id in members), "")
        self.info.info({"run_id": self.run_id, "stage": stage, "peer_id": e.peer_id})

    def _on_dropped(self, e: events.Dropped) -> None:
        self.dropped.labels(e.side).inc(e.samples)

    def _on_rerouted(self, e: events.Rerouted) -> None:
        self.rerouted.inc(e.samples)

    def _on_stood_in(self, e: events.StoodIn) -> None:
        self.stood_in.inc(e.samples)

    def _on_carried(self, e: events.Carried) -> None:
        self.carried.inc(e.samples)

    def _on_unsent(self, e: events.Unsent) -> None:
        self.unsent.inc(e.samples)

    def _on_retried(self, e: events.Retried) -> None:
        self.retried.labels(e.call).inc()

    def _on_refused(self, e: events.Refused) -> None:
        self.refused.inc()

    def _on_rejected(self, e: events.Rejected) -> None:
        self.rejected.labels(e.reason).inc()

    def _on_peer_gone(self, e: events.PeerGone) -> None:
        self.gone.inc()

    def _on_false_report(self, e: events.FalseReport) -> None:
        self.false_reports.inc()

    def _on_excluded(self, e: events.Excluded) -> None:
        self.excluded.inc()

    def _on_final(self, e: events.Final) -> None:
        self.val_loss.set(float("nan") if e.val_loss is None else e.val_loss)
        self.finished.set(1)

    def _kind_of(self, peer: str) -> str:
        """What we exchange with `peer`, by where it sits in the latest view."""
        mine = next((s for s in self._stages if self._me in s), None)
        if mine is not None and peer in mine:
            return "stage"
        if any(peer in s for s in self._stages):
            return "activations"
        return "other"
