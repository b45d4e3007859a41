"""A small discrete-event engine: tasks with dependencies on serial processors and shared links.

Pure: times are floats of the model, nothing reads a clock. Used by the wall-clock model
(`sim/wallclock.py`), which builds the task graph of a swarm's schedule. Each peer has one
processor (one task at a time, the lowest `priority` of the ready ones first) and two links, an
uplink and a downlink. A flow from a to b takes a's uplink and b's downlink; flows share links
max-min fairly (progressive filling), the flows of one (a, b) pair go out one after another in
the order they became ready, and a flow ends `latency` seconds after its last byte left.

Peers may share a processor (`processors`: a CPU that runs two peer processes): each peer still
runs one task at a time, and the peers busy on one processor share it equally, as an operating
system's fair scheduler shares a core between two busy processes.

A flow of `weight` w stands for w identical flows that start together (w times the bytes, w
shares of every link it crosses): the wall-clock model folds the D replicas of a symmetric stage
into one peer this way, and gets the same times as with D peers.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Task:
    """A compute task (seconds on one processor), a flow (bytes from one peer to another) or a
    gate (no cost: it ends when its dependencies have)."""

    kind: Literal["compute", "flow", "gate"]
    peer: int = -1  # compute: who runs it; flow: sender
    dst: int = -1  # flow: receiver
    amount: float = 0.0  # compute: seconds; flow: bytes
    latency: float = 0.0
    weight: int = 1  # flow: how many identical flows it stands for (its shares of each link)
    priority: tuple[int, int, int] = (0, 0, 0)
    waiting: int = 0
    dependents: list[int] = field(default_factory=list)
    end: float = math.nan


class Graph:
    """Tasks with dependencies; `run` plays them out on peers' GPUs and max-min fair links."""

    def __init__(self, up: list[float], down: list[float], processors: list[int] | None = None) -> None:
        self.tasks: list[Task] = []
        self.capacity = up + down  # bytes/s: every peer's uplink, then every peer's downlink
        if processors is not None and len(processors) != len(up):
            raise ValueError(f"need one processor per peer: {len(up)} peers, {len(processors)} given")
        self.processors = processors  # peer -> the processor it runs on; None: one each

    def add(self, task: Task, deps: list[int]) -> int:
        tid = len(self.tasks)
        self.tasks.append(task)
        for dep in deps:
            self.tasks[dep].dependents.append(tid)
        task.waiting = len(deps)
        return tid

    def run(self) -> None:
        tasks, peers = self.tasks, len(self.capacity) // 2
        now = 0.0
        events: list[tuple[float, int]] = []  # (time, task) that ends then
        ready: list[list[tuple[tuple[int, int, int], int]]] = [[] for _ in range(peers)]
        busy = [False] * peers
        flows: dict[int, float] = {}  # task -> bytes left to serialise
        sending: set[tuple[int, int]] = set()  # (sender, receiver) pairs with a flow on the wire
        queued: dict[tuple[int, int], list[int]] = {}  # flows waiting for their pair, in order
        rates: dict[int, float] = {}
        idle: set[int] = set()  # peers that may pick a task once everything due now is done
        dirty = False
        shared = self.processors
        jobs: dict[int, float] = {}  # on shared processors: compute task -> seconds of work left
        job_rates: dict[int, float] = {}
        jobs_at, next_job, jobs_dirty = 0.0, (math.inf, -1), False

        def start(tid: int) -> None:
            nonlocal dirty
            task = tasks[tid]
            if task.kind == "gate":
                heapq.heappush(events, (now, tid))
            elif task.kind == "flow":
                pair = (task.peer, task.dst)
                if pair in sending:  # one connection per pair: its messages go out in order
                    queued.setdefault(pair, []).append(tid)
                else:
                    sending.add(pair)
                    flows[tid] = task.amount
                    dirty = True
            else:
                heapq.heappush(ready[task.peer], (task.priority, tid))
                idle.add(task.peer)

        def run_next(peer: int) -> None:
            nonlocal jobs_dirty
            if not busy[peer] and ready[peer]:
                _, tid = heapq.heappop(ready[peer])
                busy[peer] = True
                if shared is None:
                    heapq.heappush(events, (now + tasks[tid].amount, tid))
                else:
                    jobs[tid], jobs_dirty = tasks[tid].amount, True

        def finish(tid: int) -> None:
            task = tasks[tid]
            task.end = now
            if task.kind == "compute":
                busy[task.peer] = False
                idle.add(task.peer)
            for dep in task.dependents:
                tasks[dep].waiting -= 1
                if tasks[dep].waiting == 0:
                    start(dep)

        for tid, task in enumerate(tasks):
            if task.waiting == 0:
                start(tid)
        for peer in sorted(idle):
            run_next(peer)
        idle.clear()
        rated_at, next_flow = 0.0, (math.inf, -1)
        while events or flows or jobs:
            if jobs_dirty:  # the busy peers of a processor changed: share it anew
                for tid, rate in job_rates.items():
                    if tid in jobs:
                        jobs[tid] = max(jobs[tid] - rate * (now - jobs_at), 0.0)
                where = {tid: shared[tasks[tid].peer] for tid in jobs} if shared else {}
                busy_on = Counter(where.values())  # processor -> its peers computing now
                job_rates = {tid: 1 / busy_on[where[tid]] for tid in jobs}
                jobs_at, jobs_dirty = now, False
                ends = ((now + left / job_rates[tid], tid) for tid, left in jobs.items())
                next_job = min(ends, default=(math.inf, -1))
            if dirty:  # flows changed: bring their bytes up to now, share the links anew
                if now > rated_at:
                    for tid in flows.keys() & rates.keys():
                        flows[tid] = max(flows[tid] - rates[tid] * (now - rated_at), 0.0)
                rates, rated_at, dirty = max_min_rates(flows, tasks, self.capacity), now, False
                ends = ((now + left / rates[tid], tid) for tid, left in flows.items())
                next_flow = min(ends, default=(math.inf, -1))
            if next_job[0] < min(next_flow[0], events[0][0] if events else math.inf):
                now = next_job[0]
                # Every job due now ends now (within float drift), as one batch of events: peers
                # choose their next tasks only once all of now is done.
                due = [
                    tid for tid, left in jobs.items() if jobs_at + left / job_rates[tid] <= now * (1 + 1e-12)
                ]
                for tid in due:
                    del jobs[tid]
                    heapq.heappush(events, (now, tid))
                jobs_dirty, next_job = True, (math.inf, -1)
                continue
            if events and events[0][0] <= next_flow[0]:
                now, tid = heapq.heappop(events)
                finish(tid)
                if not (events and events[0][0] <= now) and not next_job[0] <= now:  # all of now is done
                    for peer in sorted(idle):
                        run_next(peer)
                    idle.clear()
                continue
            now, tid = next_flow
            del flows[tid]
            dirty = True
            pair = (tasks[tid].peer, tasks[tid].dst)
            if queued.get(pair):
                waiting = queued[pair].pop(0)
                flows[waiting] = tasks[waiting].amount
            else:
                sending.discard(pair)
            heapq.heappush(events, (now + tasks[tid].latency, tid))


def max_min_rates(flows: dict[int, float], tasks: list[Task], capacity: list[float]) -> dict[int, float]:
    """Max-min fair rates (progressive filling) of the flows; links are uplinks, then downlinks.
    A flow of weight w gets w shares (the rate of w flows together)."""
    peers = len(capacity) // 2
    users: dict[int, list[int]] = {}
    for tid in flows:
        users.setdefault(tasks[tid].peer, []).append(tid)
        users.setdefault(peers + tasks[tid].dst, []).append(tid)
    left = {link: capacity[link] for link in users}
    count = {link: sum(tasks[tid].weight for tid in tids) for link, tids in users.items()}
    rates: dict[int, float] = {}
    while count:
        link = min(count, key=lambda x: left[x] / count[x])
        share = left[link] / count[link]
        if share == math.inf:  # only unshaped links are left: their flows take no time
            return rates | {tid: math.inf for tid in flows if tid not in rates}
        del count[link]
        for tid in users[link]:
            if tid in rates:
                continue
            weight = tasks[tid].weight
            rates[tid] = share * weight
            for other in (tasks[tid].peer, peers + tasks[tid].dst):
                if other in count:
                    left[other] -= share * weight
                    count[other] -= weight
                    if not count[other]:
                        del count[other]
    return rates
