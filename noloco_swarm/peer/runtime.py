"""A peer's run loop: join the run, serve one stage, train, take outer steps, report.

One asyncio loop per peer. Torch work runs in a worker thread (`asyncio.to_thread`) so the loop
keeps serving other peers' requests while this peer computes. The inner loop itself is plain
PyTorch (StageReplica, shared with the simulator); routing and averaging plug in around it:

  stage 0      reads its data shard, runs its stage, sends each sample's activations (with the
               token ids) to the replica its route names, and gets the gradients back in the reply.
  stage s > 0  collects the samples routed to it (StepCollector), runs them as one batch in
               position order, forwards to stage s+1 (or computes the loss on the last stage),
               and answers each sender with the gradients of its rows.
  every H      each replica exchanges theta with its group (lower rank calls higher rank) and
               applies the NoLoCo (or DiLoCo) outer step with the same code as the simulator.

Membership is frozen for the run once every stage has `num_replicas` announced peers (joining and
leaving mid-run is not handled yet). Every network wait has a deadline; a partner that does not
deliver its theta leaves this replica to step with the rest of its group (alone, for a pair).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT

from noloco_swarm.data.stream import embedded_stream, validation_windows
from noloco_swarm.peer.directory import RunDirectory
from noloco_swarm.peer.node import NetworkConfig, reachability
from noloco_swarm.peer.pipeline import Arrival, StepCollector, expected_rows, outgoing
from noloco_swarm.peer.streams import PeerUnavailable, RemoteRefused
from noloco_swarm.peer.transport import Transport
from noloco_swarm.protocol import gossip, messages, routing
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.messages import (
    BackwardHeader,
    EvalHeader,
    EvalReply,
    ExchangeHeader,
    ForwardHeader,
    MessageError,
    TensorMeta,
)
from noloco_swarm.sim.config import RunConfig
from noloco_swarm.sim.replica import StageReplica

logger = logging.getLogger(__name__)
EVAL_BATCH = 16


@dataclass(frozen=True)
class PeerOptions:
    """How one peer runs (not part of the run's identity)."""

    run_id: str
    stage: int | None  # None: the stage with the fewest replicas (--stage auto)
    steps: int  # inner steps to train
    metrics_path: Path | None = None
    step_timeout: float = 120.0  # deadline for one pipeline round trip or one collected batch
    exchange_timeout: float = 120.0  # deadline for an outer exchange with one partner
    start_timeout: float = 120.0  # deadline for the manifest and a complete membership to appear
    heartbeat_ttl: float = 30.0


class MetricsLog:
    """JSON lines a run can be inspected with afterwards (and `noloco local` reads live)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.file = path.open("a", buffering=1) if path else None

    def write(self, event: str, **fields: Any) -> None:
        if self.file:
            self.file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")

    def close(self) -> None:
        if self.file:
            self.file.close()


class Peer:
    """One replica of one stage in a running swarm."""

    def __init__(
        self, cfg: RunConfig, opts: PeerOptions, transport: Transport, directory: RunDirectory, stage: int
    ) -> None:
        self.cfg, self.opts, self.transport, self.directory = cfg, opts, transport, directory
        self.stage = stage
        self.P, self.B = cfg.num_stages, cfg.inner.batch_size
        self.is_first, self.is_last = stage == 0, stage == cfg.num_stages - 1
        self.clock = StepClock(cfg.outer.inner_steps, self.B, cfg.inner.total_steps)
        self.replica = StageReplica(cfg, stage)
        self.metrics = MetricsLog(opts.metrics_path)
        self.view: MembershipView | None = None
        self.frozen = asyncio.Event()  # set once the view is frozen; early requests wait for it
        self.counts: list[int] = []
        self.rank = -1
        self.step = 0  # inner steps completed
        self.collectors: dict[int, StepCollector] = {}
        self.eval_queue: asyncio.Queue[None] = asyncio.Queue()
        self.tokens = 0
        self.outer_steps = 0
        self.dropped_partners = 0
        self._seen_bytes: dict[str, tuple[int, int]] = {}
        self.dead: set[tuple[int, int]] = set()  # (stage, rank) of replicas that failed us
        self.dropped_samples = 0
        transport.register("rpc_forward", self.rpc_forward)
        transport.register("rpc_eval", self.rpc_eval)

    # ------------------------------------------------------------------ membership

    async def freeze_membership(self) -> None:
        """Wait until every stage has num_replicas peers announced, then freeze the view."""
        deadline = time.monotonic() + self.opts.start_timeout
        want = self.cfg.num_replicas
        while True:
            view = await asyncio.to_thread(self.directory.membership, 0, self.P)
            counts = view.replica_counts()
            if all(c >= want for c in counts):
                if any(c > want for c in counts):
                    raise RuntimeError(f"more peers than num_replicas={want} announced for round 0: {counts}")
                self.view = view
                self.rank = view.rank_of(self.transport.peer_id)[1]
                self.counts = counts
                self.metrics.write("membership", stages=[list(s) for s in view.stages], rank=self.rank)
                self.frozen.set()
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {counts} peers per stage after {self.opts.start_timeout:.0f} s; need {want}"
                )
            await asyncio.sleep(0.5)

    def peer(self, stage: int, rank: int) -> str:
        assert self.view is not None
        return self.view.peer_at(stage, rank)

    # ------------------------------------------------------------------ inner steps

    async def train(self) -> None:
        for t in range(self.opts.steps):
            start = time.perf_counter()
            lr = self.replica.lr_at(t)
            loss = await (self._first_stage_step(t) if self.is_first else self._receiving_step(t))
            await asyncio.to_thread(self.replica.optimizer_step, lr)
            self.step = t + 1
            if self.is_first:
                self.tokens += self.B * self.cfg.model.seq_len
            self.metrics.write(
                "step",
                step=self.step,
                loss=loss,
                lr=lr,
                seconds=(seconds := time.perf_counter() - start),
                tokens=self.tokens,
                # every replica serves B samples of T tokens per step, whatever its stage
                tokens_per_second=self.B * self.cfg.model.seq_len / seconds,
            )
            if self.cfg.outer.method in ("noloco", "diloco") and self.clock.outer_step_due(self.step):
                await self.outer_step()

    async def _first_stage_step(self, t: int) -> float:
        window = self.stream.batch(t)
        x, y = window[:, :-1], window[:, 1:]
        if self.P == 1:

            def local() -> float:
                losses = self.replica.module(x, y)
                (losses.sum() / self.B).backward()
                return float(losses.detach().mean())

            return await asyncio.to_thread(local)
        out = await asyncio.to_thread(self.replica.module, x)
        grad, losses = await self._send_forward(t, 0, out.detach(), y)
        await asyncio.to_thread(out.backward, grad)
        return sum(losses) / len(losses) if losses else math.nan

    async def _send_forward(
        self, t: int, hop: int, out: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, list[float]]:
        """Send each row to the replica its route names; return the gradient rows and losses."""
        plan = outgoing(t, out.shape[0], hop, self.counts, self.rank)

        async def call(
            receiver: int, positions: list[int]
        ) -> tuple[list[int], torch.Tensor, tuple[float, ...]]:
            acts, toks = out[positions].contiguous(), tokens[positions].contiguous()
            header = ForwardHeader(
                run_id=self.opts.run_id,
                round=self.clock.round_of(t),
                step=t,
                hop=hop,
                sender_rank=self.rank,
                samples=tuple(routing.sample_index(t, i, self.B) for i in positions),
                activations=TensorMeta.of(acts),
                tokens=TensorMeta.of(toks),
            )
            reply, tensors = await self.transport.call(
                self.peer(hop + 1, receiver),
                "rpc_forward",
                header,
                [acts, toks],
                timeout=self.opts.step_timeout,
            )
            if not isinstance(reply, BackwardHeader) or len(tensors) != 1 or tensors[0].shape != acts.shape:
                raise MessageError(
                    f"stage {hop + 1} replica {receiver} answered step {t} with a malformed reply"
                )
            return positions, tensors[0], reply.losses

        async def call_or_drop(receiver: int, positions: list[int]):
            if (hop + 1, receiver) in self.dead:
                return None
            try:
                return await call(receiver, positions)
            except (PeerUnavailable, RemoteRefused, MessageError) as e:
                self._mark_dead(hop + 1, receiver, f"forward of step {t} failed: {e}")
                return None

        results = await asyncio.gather(*(call_or_drop(r, pos) for r, pos in sorted(plan.items())))
        # Rows whose gradient never came back are dropped from this step: their gradient stays 0.
        grad = torch.zeros_like(out)
        losses: list[float] = []
        for result in results:
            if result is None:
                continue
            positions, rows, sample_losses = result
            grad[positions] = rows
            losses.extend(sample_losses)
        dropped = out.shape[0] - len(losses)
        if dropped:
            self.dropped_samples += dropped
            self.metrics.write("dropped", step=t, hop=hop, samples=dropped)
        return grad, losses

    def _collector(self, t: int) -> StepCollector:
        if t not in self.collectors:
            expected = expected_rows(t, self.B, self.stage - 1, self.counts, self.rank)
            alive = [(i, sender) for i, sender in expected if (self.stage - 1, sender) not in self.dead]
            self.collectors[t] = StepCollector(t, alive)
        return self.collectors[t]

    async def _receiving_step(self, t: int) -> float:
        collector = self._collector(t)
        try:
            await asyncio.wait_for(collector.complete.wait(), self.opts.step_timeout)
        except TimeoutError:
            for sender in collector.missing_senders():
                self._mark_dead(self.stage - 1, sender, f"sent nothing for step {t} within the deadline")
        del self.collectors[t]
        if not collector.arrivals:  # nobody alive routes to us this step: nothing to compute
            self.metrics.write("dropped", step=t, hop=self.stage - 1, samples=len(collector.expected))
            return math.nan
        acts, toks, placement = collector.batch()
        x = acts.requires_grad_(True)
        if self.is_last:

            def last() -> torch.Tensor:
                losses = self.replica.module(x, toks)
                (losses.sum() / self.B).backward()
                return losses.detach()

            losses_t = await asyncio.to_thread(last)
            sample_losses = [float(v) for v in losses_t]
        else:
            out = await asyncio.to_thread(self.replica.module, x)
            grad, sample_losses = await self._send_forward(t, self.stage, out.detach(), toks)
            await asyncio.to_thread(out.backward, grad)
        assert x.grad is not None
        for arrival, rows in placement:
            if not arrival.result.done():  # the sender may have given up on us meanwhile
                arrival.result.set_result((x.grad[rows].contiguous(), [sample_losses[r] for r in rows]))
        return sum(sample_losses) / len(sample_losses) if sample_losses else math.nan

    async def rpc_forward(
        self, peer_id: str, header: messages.Message, tensors: list[torch.Tensor]
    ) -> tuple[messages.Message, list[torch.Tensor]]:
        """Rows routed to us by a replica of the previous stage; answered with their gradients."""
        if not isinstance(header, ForwardHeader):
            raise MessageError("expected a forward header")
        await self._await_frozen()
        self._check_sender(peer_id, header.run_id, header.hop, header.sender_rank)
        if not self.step <= header.step < self.step + 2:
            raise MessageError(f"forward for step {header.step}, this replica is at step {self.step}")
        positions = [k - header.step * self.B for k in header.samples]
        acts, toks = self._checked_rows(tensors)
        arrival = Arrival(header.sender_rank, positions, acts, toks)
        self._collector(header.step).add(arrival)
        grad, losses = await asyncio.wait_for(arrival.result, self.opts.step_timeout * 2)
        reply = BackwardHeader(
            run_id=header.run_id,
            round=header.round,
            step=header.step,
            hop=header.hop,
            sender_rank=self.rank,
            samples=header.samples,
            grad=TensorMeta.of(grad),
            losses=tuple(losses),
        )
        return reply, [grad]

    def _checked_rows(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Activations and token ids from another peer, checked against this model before use.

        (The transport already checked them against the header's metas and for NaN/inf.)"""
        if len(tensors) != 2:
            raise MessageError(f"expected activations and token ids, got {len(tensors)} tensors")
        acts, toks = tensors
        if acts.dtype != torch.float32 or acts.shape[1:] != (
            self.cfg.model.seq_len,
            self.cfg.model.hidden_size,
        ):
            raise MessageError(f"activations {acts.dtype} {tuple(acts.shape)} do not fit this model")
        if toks.dtype != torch.int64 or int(toks.min()) < 0 or int(toks.max()) >= self.cfg.model.vocab_size:
            raise MessageError("token ids must be int64 within the vocabulary")
        return acts, toks

    def _mark_dead(self, stage: int, rank: int, why: str) -> None:
        """Stop waiting for, and sending to, a replica that failed us (until the end of the run)."""
        if (stage, rank) not in self.dead:
            self.dead.add((stage, rank))
            logger.warning("stage %d replica %d is gone (%s); continuing without it", stage, rank, why)
            self.metrics.write("peer_gone", stage=stage, rank=rank, reason=why)

    async def _await_frozen(self) -> None:
        """A sender may freeze the view a moment before we do; wait for ours rather than refuse."""
        try:
            await asyncio.wait_for(self.frozen.wait(), self.opts.start_timeout)
        except TimeoutError as e:
            raise MessageError("this peer has not seen a complete membership yet") from e

    def _check_sender(self, peer_id: str, run_id: str, hop: int, rank: int) -> None:
        """The request must come from the peer the frozen view puts at (hop, rank), for our stage."""
        if run_id != self.opts.run_id or hop != self.stage - 1:
            raise MessageError(
                f"request for run {run_id!r} hop {hop}; this is stage {self.stage} of {self.opts.run_id!r}"
            )
        if not 0 <= rank < self.counts[hop] or self.peer(hop, rank) != peer_id:
            raise MessageError(f"peer {peer_id} is not replica {rank} of stage {hop}")

    # ------------------------------------------------------------------ outer steps

    async def outer_step(self) -> None:
        """Exchange theta with this round's group and apply the outer step (same code as the simulator)."""
        t, o = self.step, self.cfg.outer
        D = self.counts[self.stage]
        group = gossip.group_of(D, t, o.group_size, self.rank) if o.method == "noloco" else list(range(D))
        theta = await asyncio.to_thread(self.replica.theta)
        parts = [theta, self.replica.phi] if o.sends_phi else [theta]
        key = (self.clock.round_of(t - 1), t)
        self.transport.provide_exchange(key, parts)
        header = ExchangeHeader(
            run_id=self.opts.run_id,
            round=key[0],
            step=t,
            stage=self.stage,
            sender_rank=self.rank,
            parts=("theta", "phi") if o.sends_phi else ("theta",),
            meta=TensorMeta.of(theta),
            chunk_bytes=self.transport.config.part_bytes,
        )
        members = [self.peer(self.stage, m) for m in group if m != self.rank]
        start = time.perf_counter()

        async def with_member(m: int) -> tuple[int, tuple[torch.Tensor, ...] | BaseException]:
            peer = self.peer(self.stage, m)
            if (self.stage, m) in self.dead:
                return m, PeerUnavailable(f"replica {m} is gone")
            try:
                if m > self.rank:
                    got = await self.transport.exchange(
                        peer, header, parts, timeout=self.opts.exchange_timeout
                    )
                else:
                    got = await self.transport.received_exchange(
                        key, peer, timeout=self.opts.exchange_timeout
                    )
            except (PeerUnavailable, RemoteRefused, MessageError) as e:
                return m, e
            return m, (got,) if isinstance(got, torch.Tensor) else tuple(got)

        results = await asyncio.gather(*(with_member(m) for m in group if m != self.rank))
        thetas, phis = {self.rank: theta}, {self.rank: self.replica.phi}
        failed = []
        for m, got in results:
            if isinstance(got, BaseException):
                failed.append(m)
                self._mark_dead(self.stage, m, f"outer exchange at step {t} failed: {got}")
                continue
            thetas[m] = got[0]
            if o.sends_phi:
                phis[m] = got[1]
        self.transport.forget_exchange(key)
        self.dropped_partners += len(failed)
        if o.method == "noloco":
            await asyncio.to_thread(self.replica.apply_noloco, thetas, phis if o.sends_phi else None)
        else:
            await asyncio.to_thread(self.replica.apply_diloco, thetas)
        self.outer_steps += 1
        sent, received = self._exchange_bytes(members)
        self.metrics.write(
            "outer",
            step=t,
            group=sorted(group),
            partners=[self.peer(self.stage, m) for m in group if m != self.rank],
            failed=failed,
            sent_bytes=sent,
            received_bytes=received,
            seconds=time.perf_counter() - start,
            state_hash=await asyncio.to_thread(self.replica.state_hash),  # comparable with the simulator
        )

    def _exchange_bytes(self, members: list[str]) -> tuple[int, int]:
        """Bytes (framing included) sent to and received from this step's group members.

        Only outer exchanges flow between replicas of one stage, so the growth of those peers'
        counters since our previous outer step is this exchange's traffic, including what an
        early partner streamed to us before we reached the step.
        """
        counts = self.transport.byte_counts()
        sent = received = 0
        for peer in members:
            now = counts.get(peer, {})
            seen = self._seen_bytes.get(peer, (0, 0))
            sent += now.get("sent_total", 0) - seen[0]
            received += now.get("received_total", 0) - seen[1]
            self._seen_bytes[peer] = (now.get("sent_total", 0), now.get("received_total", 0))
        return sent, received

    # ------------------------------------------------------------------ evaluation

    async def evaluate(self) -> float | None:
        """Stage 0 runs the validation windows along its own fixed path; returns the mean loss."""
        windows = validation_windows(self.cfg.data)[: self.cfg.eval_windows]
        path_gone = [s for s, r in self.dead if r == self.rank]
        if path_gone:
            logger.warning("no evaluation: this replica's fixed path is broken at stage %d", min(path_gone))
            return None
        if not self.is_first:
            try:
                for _ in range(math.ceil(len(windows) / EVAL_BATCH)):
                    await asyncio.wait_for(self.eval_queue.get(), self.opts.step_timeout * 4)
            except TimeoutError:
                logger.warning("the previous stage did not run its evaluation; finishing without it")
            return None
        total, count = 0.0, 0
        for b, start in enumerate(range(0, len(windows), EVAL_BATCH)):
            w = windows[start : start + EVAL_BATCH]
            try:
                losses = await self._eval_batch(b, w[:, :-1], w[:, 1:])
            except (PeerUnavailable, RemoteRefused, MessageError) as e:
                logger.warning("evaluation failed on this replica's path: %s", e)
                return None
            total += sum(losses)
            count += len(losses)
        return total / count

    async def _eval_batch(self, b: int, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        with torch.no_grad():
            out = await asyncio.to_thread(self.replica.module, x, y if self.is_last else None)
        if self.is_last:
            return [float(v) for v in out]
        header = EvalHeader(
            self.opts.run_id, self.step, self.stage, self.rank, b, TensorMeta.of(out), TensorMeta.of(y)
        )
        reply, _ = await self.transport.call(
            self.peer(self.stage + 1, self.rank),
            "rpc_eval",
            header,
            [out, y.contiguous()],
            timeout=self.opts.step_timeout,
        )
        if not isinstance(reply, EvalReply) or len(reply.losses) != len(x):
            raise MessageError("malformed eval reply")
        return list(reply.losses)

    async def rpc_eval(
        self, peer_id: str, header: messages.Message, tensors: list[torch.Tensor]
    ) -> tuple[messages.Message, list[torch.Tensor]]:
        """Validation rows along the fixed same-rank path; answered with per-sample losses."""
        if not isinstance(header, EvalHeader):
            raise MessageError("expected an eval header")
        await self._await_frozen()
        self._check_sender(peer_id, header.run_id, header.hop, header.rank)
        if header.rank != self.rank:
            raise MessageError("evaluation follows the fixed path: same rank at every stage")
        acts, toks = self._checked_rows(tensors)
        losses = await self._eval_batch(header.batch, acts, toks)
        self.eval_queue.put_nowait(None)
        return EvalReply(tuple(losses)), []

    # ------------------------------------------------------------------ the whole run

    async def run(self) -> dict[str, Any]:
        await self.freeze_membership()
        if self.is_first:
            self.stream = embedded_stream(self.cfg.data, self.rank, self.counts[0], self.B, self.cfg.seed)
        start = time.perf_counter()
        await self.train()
        seconds = time.perf_counter() - start
        val_loss = await self.evaluate()
        summary = {
            "stage": self.stage,
            "rank": self.rank,
            "peer_id": self.transport.peer_id,
            "steps": self.step,
            "outer_steps": self.outer_steps,
            "dropped_partners": self.dropped_partners,
            "dropped_samples": self.dropped_samples,
            "gone": sorted(self.dead),
            "train_seconds": seconds,
            "tokens": self.tokens,
            "val_loss": val_loss,
            "state_hash": self.replica.state_hash(),
            "bytes": self.transport.byte_counts(),
        }
        self.metrics.write("final", **summary)
        if not self.is_first:
            await asyncio.sleep(1.0)  # let the last eval reply leave before the transport closes
        return summary


async def run_peer(
    cfg: RunConfig, net: NetworkConfig, opts: PeerOptions, *, new_run: bool = False
) -> dict[str, Any]:
    """Start this peer's libp2p daemon and DHT node, join the run, train, and shut everything down."""
    transport = await Transport.create(
        host_maddrs=net.host_maddrs,
        initial_peers=net.initial_peers,
        identity_path=net.identity_path,
        announce_maddrs=list(net.announce_maddrs) or None,
        use_relay=net.use_relay,
        use_auto_relay=net.use_auto_relay,
    )
    dht = None
    heartbeat: asyncio.Task[None] | None = None
    try:
        # The DHT shares the transport's daemon: one libp2p identity and one p2pd per peer.
        dht = await asyncio.to_thread(
            DHT, initial_peers=list(net.initial_peers), p2p=transport.p2p, start=True
        )
        directory = RunDirectory(dht, opts.run_id, ttl=opts.heartbeat_ttl)
        manifest = messages.RunManifest.create(opts.run_id, cfg.flat())
        await _join_manifest(directory, manifest, new_run, opts.start_timeout)
        stage = opts.stage
        if stage is None:
            view = await asyncio.to_thread(directory.membership, 0, cfg.num_stages)
            stage = view.least_served_stage()
        if not 0 <= stage < cfg.num_stages:
            raise ValueError(f"--stage {stage} is outside 0..{cfg.num_stages - 1} for this run")
        peer = Peer(cfg, opts, transport, directory, stage)
        announcement = messages.PeerAnnouncement(
            opts.run_id, transport.peer_id, stage, 0, tuple(await transport.visible_addresses())
        )
        for line in reachability(announcement.addresses):
            logger.warning("reachable as %s", line)  # warning: shown by default, once, at start
        heartbeat = asyncio.create_task(_heartbeat(directory, announcement, opts.heartbeat_ttl / 3))
        try:
            return await peer.run()
        finally:
            peer.metrics.close()
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
        if dht is not None:
            await asyncio.to_thread(dht.shutdown)
        await transport.shutdown()


async def _join_manifest(
    directory: RunDirectory, manifest: messages.RunManifest, new_run: bool, timeout: float
) -> None:
    """Check the run's manifest; a joiner that arrives before the starter waits for it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await asyncio.to_thread(directory.join_manifest, manifest, new_run=new_run)
            return
        except LookupError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _heartbeat(directory: RunDirectory, announcement: messages.PeerAnnouncement, period: float) -> None:
    while True:
        if not await asyncio.to_thread(directory.announce, announcement):
            logger.warning("heartbeat: the DHT did not store our announcement; retrying")
        await asyncio.sleep(period)
