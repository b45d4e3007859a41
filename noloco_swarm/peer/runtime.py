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

Membership is frozen per round. Round 0 starts once every stage has `num_replicas` announced
peers; at every later boundary each peer builds the next view from the DHT with the same pure rule
(protocol.membership.next_view): members reported gone leave, peers that announced this round
join. A joiner announces a round two ahead of the swarm and downloads its stage's state at that
boundary from a live replica (rpc_fetch_state). Every network wait has a deadline, and a peer we
wait on is probed (rpc_status), so that a crash costs seconds and slowness is never taken for
death; a partner that does not deliver leaves this replica to step with the rest of its group.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from noloco_swarm.data.stream import train_batches
from noloco_swarm.peer import evaluation
from noloco_swarm.peer.directory import RunDirectory
from noloco_swarm.peer.joining import (
    JOIN_MARGIN_ROUNDS,
    Snapshot,
    check_request,
    fetch_state,
    pick_join_round,
    servers_for,
)
from noloco_swarm.peer.pipeline import Arrival, StepCollector, expected_rows, outgoing
from noloco_swarm.peer.rounds import DHT_ERRORS, PROBE_PERIOD, PROBE_TIMEOUT, PeerExcluded, Rounds
from noloco_swarm.peer.streams import PeerUnavailable, RemoteRefused, StreamTruncated
from noloco_swarm.peer.transport import Transport
from noloco_swarm.protocol import gossip, messages, outer, routing
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.membership import MembershipView
from noloco_swarm.protocol.messages import (
    BackwardHeader,
    ExchangeHeader,
    ForwardHeader,
    MessageError,
    TensorMeta,
)
from noloco_swarm.train.config import RunConfig
from noloco_swarm.train.replica import StageReplica

logger = logging.getLogger(__name__)


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
    join_timeout: float = 280.0  # deadline for joining a running swarm (waiting for our round, fetching)
    heartbeat_ttl: float = 30.0
    device: str = "cpu"  # where this stage computes; tensors cross the network from the CPU


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
        self,
        cfg: RunConfig,
        opts: PeerOptions,
        transport: Transport,
        directory: RunDirectory,
        stage: int,
        addresses: tuple[str, ...] = (),
    ) -> None:
        self.cfg, self.opts, self.transport, self.directory = cfg, opts, transport, directory
        self.stage, self.addresses = stage, addresses
        self.me = transport.peer_id
        self.P, self.B = cfg.num_stages, cfg.inner.batch_size
        self.is_first, self.is_last = stage == 0, stage == cfg.num_stages - 1
        self.clock = StepClock(cfg.outer.inner_steps, self.B, cfg.inner.total_steps)
        self.device = torch.device(opts.device)
        self.replica = StageReplica(cfg, stage, device=self.device)
        self.metrics = MetricsLog(opts.metrics_path)
        self.rounds = Rounds(self.me, stage, cfg.num_stages, transport, directory, self.metrics)
        self.joined_round = 0
        self.announced = False
        self.step = 0  # inner steps completed
        self.collectors: dict[int, StepCollector] = {}
        self._consumed = -1  # the last step whose rows were taken out of its collector
        self.snapshots: dict[int, Snapshot] = {}  # round -> state served to that round's joiners
        self.eval_queue: asyncio.Queue[None] = asyncio.Queue()
        self.trained = asyncio.Event()
        self.tokens = 0
        self.outer_steps = 0
        self.last_loss: float | None = None
        self.dropped_partners = 0
        self._seen_bytes: dict[str, tuple[int, int]] = {}
        self.dropped_samples = 0
        self._data: Iterator[torch.Tensor] | None = None  # stage 0's batches
        self._data_at: tuple[tuple[int, int], int] = ((0, 0), 0)  # (shard layout, next step) of _data
        transport.register("rpc_forward", self.rpc_forward)
        transport.register("rpc_eval", self.rpc_eval)
        transport.register("rpc_fetch_state", self.rpc_fetch_state)
        transport.register("rpc_status", self.rpc_status)

    # ------------------------------------------------------------------ membership

    def announcement(self) -> messages.PeerAnnouncement:
        """Our heartbeat record, with the round we (re)joined at and our progress."""
        return messages.PeerAnnouncement(
            self.opts.run_id,
            self.me,
            self.stage,
            self.joined_round,
            self.addresses,
            self.device.type,
            self.step,
        )

    def view_at(self, t: int) -> MembershipView:
        """The frozen view of inner step t's round."""
        return self.rounds.at(self.clock.round_of(t))

    async def advance_view(self) -> None:
        """At a round boundary: freeze the next round's view; keep our state for its joiners."""
        current = self.view_at(self.step - 1)
        view = await self.rounds.next(current, self.joined_round)
        joiners = [p for p in view.stages[self.stage] if p not in current.members()]
        if joiners:  # they fetch this state, taken right after the outer step that closed the round
            self.snapshots[view.round] = await asyncio.to_thread(Snapshot.take, self.replica, view, self.step)
            self.metrics.write("joiners", round=view.round, peers=joiners)
        for old in [r for r in self.snapshots if r < view.round]:
            del self.snapshots[old]
        self.rounds.set(view)

    async def join_late(self) -> None:
        """Enter a running swarm two rounds ahead with a live replica's state (see peer.joining)."""
        deadline = time.monotonic() + self.opts.join_timeout
        while True:
            others = [a for a in await asyncio.to_thread(self.rounds.read_peers) if a.peer_id != self.me]
            await asyncio.gather(
                *(self.transport.connect(a.peer_id, a.addresses, timeout=PROBE_TIMEOUT) for a in others)
            )
            target = await pick_join_round(
                self.transport, self.opts.run_id, others, self.clock, self.opts.steps
            )
            self.joined_round = target
            self.collectors.clear()
            await asyncio.to_thread(self.directory.announce, self.announcement())
            self.announced = True
            self.metrics.write("joining", round=target, step=self.clock.round_start(target))
            logger.warning(
                "joining the running swarm at round %d (step %d)", target, self.clock.round_start(target)
            )
            servers = servers_for(others, self.stage, target)
            if not servers:
                raise RuntimeError(
                    f"no live replica of stage {self.stage} holds its state; this peer cannot join"
                )
            # Spread joiners over the servers; each joiner tries them all, in its own order.
            servers.sort(key=lambda p: hashlib.sha256(f"{self.me}/{p}".encode()).digest())
            for server in servers:
                try:
                    view, step = await fetch_state(
                        self.transport,
                        server,
                        self.opts.run_id,
                        target,
                        self.replica,
                        me=self.me,
                        timeout=self.opts.join_timeout,
                    )
                except (PeerUnavailable, RemoteRefused, MessageError) as e:
                    logger.warning("state fetch from %s for round %d failed: %s", server, target, e)
                    continue
                self.step = step
                self._seen_bytes = {}
                self._exchange_bytes(list(self.transport.byte_counts()))  # the fetch is no outer exchange
                self.metrics.write(
                    "joined",
                    round=target,
                    step=step,
                    server=server,
                    state_hash=self.replica.state_hash(),
                    peer_id=self.me,
                )
                self.rounds.set(view)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not join the run within {self.opts.join_timeout:.0f} s")
            await asyncio.sleep(1.0)

    async def rpc_fetch_state(
        self, peer_id: str, header: messages.Message, tensors: list[torch.Tensor]
    ) -> tuple[messages.Message, list[torch.Tensor]]:
        """A peer joining our stage at a round boundary downloads our state at that boundary."""
        request = check_request(header, self.opts.run_id, self.stage)
        if request.round > self.clock.round_of(self.step) + JOIN_MARGIN_ROUNDS + 1:
            raise MessageError(f"round {request.round} is too far ahead (this peer is at step {self.step})")
        wait = min(self.opts.join_timeout, self.transport.config.serve_timeout - 5.0)
        view = await self.rounds.wait(request.round, timeout=wait)
        snapshot = self.snapshots.get(request.round)
        if snapshot is None or peer_id not in snapshot.view.stages[self.stage] or snapshot.view != view:
            raise MessageError(f"peer {peer_id} is not admitted at round {request.round} by this peer's view")
        reply, tensor = snapshot.reply(self.opts.run_id, self.stage, request.part)
        self.metrics.write("served_state", round=request.round, peer=peer_id, part=request.part)
        # Keep the state we serve out of the next outer step's byte count with this peer.
        seen = self._seen_bytes.get(peer_id, (0, 0))
        self._seen_bytes[peer_id] = (seen[0] + tensor.numel() * tensor.element_size(), seen[1])
        return reply, [tensor]

    async def rpc_status(
        self, peer_id: str, header: messages.Message, tensors: list[torch.Tensor]
    ) -> tuple[messages.Message, list[torch.Tensor]]:
        """Where this peer is: for joiners choosing their round, for probes, and for `noloco status`."""
        if not isinstance(header, messages.StatusRequest) or header.run_id != self.opts.run_id:
            raise MessageError(f"expected a status request for run {self.opts.run_id!r}")
        view = self.rounds.latest()
        rank = view.rank_of(self.me)[1] if view is not None and self.me in view.members() else 0
        loss = self.last_loss if self.last_loss is not None and math.isfinite(self.last_loss) else None
        status = messages.PeerStatus(
            self.opts.run_id,
            self.me,
            self.stage,
            self.step,
            self.clock.round_of(self.step),
            rank,
            self.outer_steps,
            self.tokens,
            loss,
        )
        return status, []

    # ------------------------------------------------------------------ inner steps

    async def train(self) -> None:
        while self.step < self.opts.steps:
            t = self.step
            start = time.perf_counter()
            lr = self.replica.lr_at(t)
            loss = await (self._first_stage_step(t) if self.is_first else self._receiving_step(t))
            await asyncio.to_thread(self.replica.optimizer_step, lr)
            self.step = t + 1
            self.last_loss = loss
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
            if self.clock.outer_step_due(self.step):
                if self.cfg.outer.method in ("noloco", "diloco"):
                    await self.outer_step()
                if self.step < self.opts.steps:
                    await self.advance_view()

    def _batch(self, t: int) -> torch.Tensor:
        """Stage 0's data: shard `rank` of this round's stage-0 replica count, batch t.

        The stream is reopened at step t whenever the shard layout changes or steps were skipped
        (joining); a streaming dataset then reads its new shard forward to t (see data.hub).
        """
        view = self.view_at(t)
        key = (view.rank_of(self.me)[1], view.replica_counts()[0])
        if self._data is None or self._data_at != (key, t):
            self._data = train_batches(self.cfg.data, key[0], key[1], self.B, self.cfg.seed, start_step=t)
        self._data_at = (key, t + 1)
        return next(self._data)

    async def _first_stage_step(self, t: int) -> float:
        window = await asyncio.to_thread(self._batch, t)  # a new shard layout loads the corpus
        x, y = window[:, :-1].to(self.device), window[:, 1:]
        if self.P == 1:

            def local() -> float:
                losses = self.replica.module(x, y.to(self.device))
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
        view = self.view_at(t)
        rank = view.rank_of(self.me)[1]
        plan = outgoing(t, out.shape[0], hop, view.replica_counts(), rank)

        async def call(
            receiver: str, positions: list[int]
        ) -> tuple[list[int], torch.Tensor, tuple[float, ...]]:
            acts, toks = out[positions].contiguous(), tokens[positions].contiguous()
            header = ForwardHeader(
                run_id=self.opts.run_id,
                round=view.round,
                step=t,
                hop=hop,
                sender_rank=rank,
                samples=tuple(routing.sample_index(t, i, self.B) for i in positions),
                activations=TensorMeta.of(acts),
                tokens=TensorMeta.of(toks),
                view=view.digest(),
            )
            reply, tensors = await self.transport.call(
                receiver, "rpc_forward", header, [acts, toks], timeout=self.opts.step_timeout
            )
            if not isinstance(reply, BackwardHeader) or len(tensors) != 1 or tensors[0].shape != acts.shape:
                raise MessageError(f"{receiver} answered step {t} with a malformed reply")
            return positions, tensors[0], reply.losses

        async def call_or_drop(receiver: str, positions: list[int]):
            for attempt in range(2):  # a live receiver whose stream broke gets the rows once more
                if receiver in self.rounds.dead:
                    return None
                try:
                    return await call(receiver, positions)
                except RemoteRefused as e:  # alive but disagrees (e.g. another view): drop these rows
                    logger.warning("stage %d peer %s refused step %d: %s", hop + 1, receiver, t, e)
                    self.metrics.write("refused", step=t, peer=receiver, reason=str(e))
                    return None
                except StreamTruncated as e:  # the connection broke mid-transfer
                    if attempt or await self.rounds.suspect(receiver, f"forward of step {t} broke: {e}"):
                        return None
                    self.metrics.write("retried", step=t, peer=receiver, reason=str(e))
                except PeerUnavailable as e:
                    await self.rounds.suspect(receiver, f"forward of step {t} failed: {e}")
                    return None
                except MessageError as e:  # it answered with garbage: do not trust it again
                    self.rounds.mark_dead(receiver, f"malformed answer to the forward of step {t}: {e}")
                    return None
            return None

        receivers = {view.peer_at(hop + 1, r): pos for r, pos in plan.items()}
        results = await asyncio.gather(*(call_or_drop(r, pos) for r, pos in sorted(receivers.items())))
        # Rows whose gradient never came back are dropped from this step: their gradient stays 0.
        grad = torch.zeros_like(out)
        losses: list[float] = []
        for result in results:
            if result is None:
                continue
            positions, rows, sample_losses = result
            grad[positions] = rows.to(grad.device)
            losses.extend(sample_losses)
        dropped = out.shape[0] - len(losses)
        if dropped:
            self.dropped_samples += dropped
            self.metrics.write("dropped", step=t, hop=hop, samples=dropped)
        return grad, losses

    def _collector(self, t: int) -> StepCollector:
        if t not in self.collectors:
            view = self.view_at(t)
            expected = expected_rows(
                t, self.B, self.stage - 1, view.replica_counts(), view.rank_of(self.me)[1]
            )
            alive = [(i, s) for i, s in expected if view.peer_at(self.stage - 1, s) not in self.rounds.dead]
            self.collectors[t] = StepCollector(t, alive)
        return self.collectors[t]

    async def _receiving_step(self, t: int) -> float:
        collector = self._collector(t)
        await self._collect(t, collector)
        del self.collectors[t]
        self._consumed = t  # rows for this step that arrive from now on are too late
        if not collector.arrivals:  # nobody alive routes to us this step: nothing to compute
            self.metrics.write("dropped", step=t, hop=self.stage - 1, samples=len(collector.expected))
            return math.nan
        acts, toks, placement = collector.batch()
        x = acts.to(self.device).requires_grad_(True)
        if self.is_last:

            def last() -> torch.Tensor:
                losses = self.replica.module(x, toks.to(self.device))
                (losses.sum() / self.B).backward()
                return losses.detach()

            losses_t = await asyncio.to_thread(last)
            sample_losses = [float(v) for v in losses_t]
        else:
            out = await asyncio.to_thread(self.replica.module, x)
            grad, sample_losses = await self._send_forward(t, self.stage, out.detach(), toks)
            await asyncio.to_thread(out.backward, grad)
        assert x.grad is not None
        x_grad = x.grad.cpu()  # replies leave from the CPU
        for arrival, rows in placement:
            if not arrival.result.done():  # the sender may have given up on us meanwhile
                arrival.result.set_result((x_grad[rows].contiguous(), [sample_losses[r] for r in rows]))
        return sum(sample_losses) / len(sample_losses) if sample_losses else math.nan

    async def _collect(self, t: int, collector: StepCollector) -> None:
        """Wait for step t's rows; probe silent senders while waiting and stop expecting dead ones."""
        view = self.view_at(t)
        deadline = time.monotonic() + self.opts.step_timeout
        while not collector.complete.is_set():
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(collector.complete.wait(), min(PROBE_PERIOD, max(left, 0.0)))
                return
            except TimeoutError:
                pass
            missing = collector.missing_senders()
            peers = [view.peer_at(self.stage - 1, s) for s in missing]
            if left <= PROBE_PERIOD:  # the deadline: whoever is still silent failed us
                why = f"sent nothing for step {t} within {self.opts.step_timeout:.0f} s"
                gone = await asyncio.gather(*(self.rounds.suspect(p, why) for p in peers))
                for sender in missing:
                    collector.drop_sender(sender)
                self.metrics.write("dropped", step=t, hop=self.stage - 1, senders=missing, gone=list(gone))
                return
            alive = await asyncio.gather(*(self.rounds.alive(p) for p in peers))
            for sender, peer, ok in zip(missing, peers, alive, strict=True):
                if not ok:
                    self.rounds.mark_dead(peer, f"stopped answering while we waited for step {t}")
                    collector.drop_sender(sender)

    async def rpc_forward(
        self, peer_id: str, header: messages.Message, tensors: list[torch.Tensor]
    ) -> tuple[messages.Message, list[torch.Tensor]]:
        """Rows routed to us by a replica of the previous stage; answered with their gradients."""
        if not isinstance(header, ForwardHeader):
            raise MessageError("expected a forward header")
        if header.round != self.clock.round_of(header.step):
            raise MessageError(f"step {header.step} is not in round {header.round}")
        if not self.step <= header.step < self.step + 2 and header.round in self.rounds.views:
            raise MessageError(f"forward for step {header.step}, this replica is at step {self.step}")
        # A sender may start a round a moment before we do: wait for our view of it, then compare.
        view = await self.rounds.wait(header.round, timeout=self.opts.step_timeout)
        if header.view != view.digest():
            self.metrics.write("view_mismatch", step=header.step, peer=peer_id)
            raise MessageError(
                f"views of round {header.round} differ (theirs {header.view}, ours {view.digest()})"
            )
        self.check_sender(peer_id, view, header.run_id, header.hop, header.sender_rank)
        if not self.step <= header.step < self.step + 2 or header.step <= self._consumed:
            raise MessageError(f"forward for step {header.step}, this replica is at step {self.step}")
        positions = [k - header.step * self.B for k in header.samples]
        acts, toks = self.checked_rows(tensors)
        arrival = Arrival(header.sender_rank, positions, acts, toks)
        self._collector(header.step).add(arrival)
        grad, losses = await asyncio.wait_for(arrival.result, self.opts.step_timeout * 2)
        reply = BackwardHeader(
            run_id=header.run_id,
            round=header.round,
            step=header.step,
            hop=header.hop,
            sender_rank=view.rank_of(self.me)[1],
            samples=header.samples,
            grad=TensorMeta.of(grad),
            losses=tuple(losses),
        )
        return reply, [grad]

    def checked_rows(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
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

    def check_sender(self, peer_id: str, view: MembershipView, run_id: str, hop: int, rank: int) -> None:
        """The request must come from the peer `view` puts at (hop, rank), for our stage."""
        if run_id != self.opts.run_id or hop != self.stage - 1:
            raise MessageError(
                f"request for run {run_id!r} hop {hop}; this is stage {self.stage} of {self.opts.run_id!r}"
            )
        if not 0 <= rank < len(view.stages[hop]) or view.peer_at(hop, rank) != peer_id:
            raise MessageError(f"peer {peer_id} is not replica {rank} of stage {hop} in round {view.round}")

    # ------------------------------------------------------------------ outer steps

    async def outer_step(self) -> None:
        """Exchange theta with this round's group and apply the outer step (same code as the simulator).

        NoLoCo (and DiLoCo with two replicas) swaps whole vectors with each member. DiLoCo with
        more replicas all-reduces: each member averages one shard (reduce-scatter) and sends it
        to all (all-gather), 2(D-1)/D of the stage each way instead of (D-1) times it.
        """
        t, o = self.step, self.cfg.outer
        view = self.view_at(t - 1)  # the round that just closed
        rank, D = view.rank_of(self.me)[1], len(view.stages[self.stage])
        group = gossip.group_of(D, t, o.group_size, rank) if o.method == "noloco" else list(range(D))
        members = {m: view.peer_at(self.stage, m) for m in group if m != rank}
        theta = await asyncio.to_thread(self.replica.theta)
        start = time.perf_counter()
        if o.method == "diloco" and D > 2:
            mean, failed = await self._allreduce_mean(view.round, t, rank, members, theta)
            await asyncio.to_thread(self.replica.apply_diloco, {rank: mean})
        else:
            parts = [theta, self.replica.phi] if o.sends_phi else [theta]
            names = ("theta", "phi") if o.sends_phi else ("theta",)
            got, failed = await self._exchange(view.round, t, 0, rank, members, names, lambda m: parts)
            thetas = {rank: theta} | {m: tensors[0] for m, tensors in got.items()}
            if o.method == "noloco":
                phis = {rank: self.replica.phi} | {m: x[1] for m, x in got.items()} if o.sends_phi else None
                await asyncio.to_thread(self.replica.apply_noloco, thetas, phis)
            else:
                await asyncio.to_thread(self.replica.apply_diloco, thetas)
        self.dropped_partners += len(failed)
        self.outer_steps += 1
        sent, received = self._exchange_bytes(list(members.values()))
        self.metrics.write(
            "outer",
            step=t,
            group=sorted(group),
            partners=list(members.values()),
            failed=failed,
            sent_bytes=sent,
            received_bytes=received,
            seconds=time.perf_counter() - start,
            state_hash=await asyncio.to_thread(self.replica.state_hash),  # comparable with the simulator
        )

    async def _allreduce_mean(
        self, round_: int, t: int, rank: int, members: dict[int, str], theta: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """The stage's mean theta by reduce-scatter then all-gather over equal padded shards.

        Shard owners sum in ascending rank, the same order as `outer.group_mean`, so the result
        is bit-identical to the simulator's mean. A member that fails phase 1 is left out of the
        mean of this member's shard; a shard whose owner fails phase 2 keeps our own values.
        """
        D = len(members) + 1
        size = -(-theta.numel() // D)
        padded = torch.zeros(size * D, dtype=theta.dtype, device=theta.device)
        padded[: theta.numel()] = theta
        shards = padded.view(D, size)
        got, failed = await self._exchange(
            round_, t, 1, rank, members, ("theta_shard",), lambda m: [shards[m]]
        )
        mine = outer.group_mean({rank: shards[rank]} | {m: x[0].to(theta.device) for m, x in got.items()})
        got, lost = await self._exchange(round_, t, 2, rank, members, ("mean_shard",), lambda m: [mine])
        means = padded.clone().view(D, size)  # a shard we never get keeps our own values
        means[rank] = mine
        for m, x in got.items():
            means[m] = x[0].to(theta.device)
        return means.view(-1)[: theta.numel()].clone(), sorted(set(failed) | set(lost))

    async def _exchange(
        self,
        round_: int,
        t: int,
        phase: int,
        rank: int,
        members: dict[int, str],
        names: tuple[str, ...],
        payload: Callable[[int], list[torch.Tensor]],
    ) -> tuple[dict[int, tuple[torch.Tensor, ...]], list[int]]:
        """Swap `payload(m)` with every member m (lower rank calls higher); what arrived, and who failed."""
        key = (round_, t) if phase == 0 else (round_, t, phase)
        for m, peer in members.items():
            if m < rank:  # they call us and get what we provide for them
                self.transport.provide_exchange(key, payload(m), to=peer)

        async def with_member(m: int) -> tuple[int, tuple[torch.Tensor, ...] | BaseException]:
            peer = members[m]
            if peer in self.rounds.dead:
                return m, PeerUnavailable(f"{peer} is gone")
            ours = payload(m)
            header = ExchangeHeader(
                run_id=self.opts.run_id,
                round=round_,
                step=t,
                stage=self.stage,
                sender_rank=rank,
                parts=names,
                meta=TensorMeta.of(ours[0]),
                chunk_bytes=self.transport.config.part_bytes,
                phase=phase,
            )
            try:
                if m > rank:
                    got = await self.transport.exchange(
                        peer, header, ours, timeout=self.opts.exchange_timeout
                    )
                else:
                    got = await self._received_exchange(key, peer)
            except (PeerUnavailable, RemoteRefused, MessageError) as e:
                return m, e
            return m, (got,) if isinstance(got, torch.Tensor) else tuple(got)

        results = await asyncio.gather(*(with_member(m) for m in members))
        self.transport.forget_exchange(key)
        got, failed = {}, []
        for m, result in results:
            if not isinstance(result, BaseException):
                got[m] = result
                continue
            failed.append(m)
            if isinstance(result, PeerUnavailable):
                await self.rounds.suspect(members[m], f"outer exchange at step {t} failed: {result}")
            elif isinstance(result, MessageError):
                self.rounds.mark_dead(members[m], f"malformed outer exchange at step {t}: {result}")
        return got, failed

    async def _received_exchange(self, key: tuple[int, ...], peer: str) -> tuple[torch.Tensor, ...]:
        """Await a lower-ranked partner's exchange call, probing it so that a crash ends the wait."""
        waiting = asyncio.ensure_future(
            self.transport.received_exchange(key, peer, timeout=self.opts.exchange_timeout)
        )
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=PROBE_PERIOD)
                if done:
                    return waiting.result()
                if not await self.rounds.alive(peer):
                    raise PeerUnavailable(f"{peer} stopped answering before its outer exchange")
        finally:
            if not waiting.done():
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)

    def _exchange_bytes(self, members: list[str]) -> tuple[int, int]:
        """Bytes (framing included) sent to and received from this step's group members.

        Only outer exchanges (and a joiner's one state fetch, which resets the baseline) flow
        between replicas of one stage, so the growth of those peers' counters since our previous
        outer step is this exchange's traffic, including what an early partner streamed to us
        before we reached the step.
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

    async def rpc_eval(
        self, peer_id: str, header: messages.Message, tensors: list[torch.Tensor]
    ) -> tuple[messages.Message, list[torch.Tensor]]:
        return await evaluation.serve(self, peer_id, header, tensors)

    # ------------------------------------------------------------------ the whole run

    async def run(self) -> dict[str, Any]:
        announcements = await asyncio.to_thread(self.rounds.read_peers)
        late = self.rounds.run_in_progress(announcements, self.cfg.num_replicas)
        if self.is_first:  # tokenize the corpus (or open the dataset) before anyone routes work to us
            await asyncio.to_thread(lambda: next(train_batches(self.cfg.data, 0, 1, self.B, self.cfg.seed)))
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            if late:
                await self.join_late()
            else:
                await asyncio.to_thread(self.directory.announce, self.announcement())
                self.announced = True
                await self.rounds.freeze_round_zero(self.cfg.num_replicas, self.opts.start_timeout)
            start = time.perf_counter()
            while True:
                try:
                    await self.train()
                    break
                except PeerExcluded as e:
                    logger.warning("%s; joining again", e)
                    self.metrics.write("excluded", step=self.step, reason=str(e))
                    await self.join_late()
            seconds = time.perf_counter() - start
            self.trained.set()
            val_loss = await evaluation.evaluate(self)
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            await self.rounds.close()
        view = self.view_at(self.step - 1)
        summary = {
            "stage": self.stage,
            "rank": view.rank_of(self.me)[1],
            "peer_id": self.me,
            "joined_round": self.joined_round,
            "steps": self.step,
            "outer_steps": self.outer_steps,
            "dropped_partners": self.dropped_partners,
            "dropped_samples": self.dropped_samples,
            "gone": sorted(self.rounds.dead),
            "final_view": [list(s) for s in view.stages],
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

    async def _heartbeat(self) -> None:
        """Re-store our announcement (with our current step) every ttl/3 seconds."""
        while True:
            await asyncio.sleep(self.opts.heartbeat_ttl / 3)
            if not self.announced:  # a joiner announces itself once it has picked its round
                continue
            try:
                stored = await asyncio.to_thread(self.directory.announce, self.announcement())
            except DHT_ERRORS as e:  # the DHT is best effort; try again next beat
                stored = False
                logger.warning("heartbeat failed: %s", e)
            if not stored:
                logger.warning("heartbeat: the DHT did not store our announcement; retrying")
