"""Chaos: a seeded schedule of the faults a volunteer swarm meets (a kill, a joiner, a peer frozen
past the step deadline, a link cut, a delay spike, a graceful leave), played against a 2 x 3 swarm
of real peer processes on the namespace testbed (noloco_swarm/harness/chaos.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from noloco_swarm.harness.chaos import (
    BATCH,
    INNER_STEPS,
    REPLICAS,
    STAGES,
    Chaos,
    chaos_config,
    schedule,
    trained_samples,
    views_since,
)
from noloco_swarm.harness.local import wait
from noloco_swarm.harness.namespaces import namespace_swarm
from noloco_swarm.peer.events import Final, Joined, Step, of_kind
from tests.integration.test_testbed import nothing_left, testbed_here  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration

H = INNER_STEPS
# Enough steps for the whole schedule on a loaded machine and a few rounds after it: the last
# window began at step 213 in a quiet run and at steps 207-222 under stress-ng --cpu 2
# (2026-12-06); a run that ends first fails saying so. (340 until 2026-12-06, when the suite's
# time called for 300: the runs of bench/chaos.py below are of 300 steps.)
STEPS = 300
WINDOW = 2 * H
# The validation loss every surviving stage-0 peer must end below: the first steps' loss is 8.34;
# after 300 steps the chaos runs of bench/chaos.py ended at 6.11, the same swarm without faults
# at 6.07 (2026-12-06).
TARGET_LOSS = 6.5


def test_chaos_schedule_keeps_pace_views_and_loss(cache: Path, nothing_left: None, tmp_path: Path) -> None:  # noqa: F811
    """Between faults the swarm keeps at least half its healthy pace, every running peer holds
    the same view at every boundary after the schedule, the survivors run to the end and the
    stage-0 peers' validation loss ends below the target. Goodput (samples trained during the
    schedule over what the healthy pace would have trained in the same time) is printed."""
    cfg = chaos_config(STEPS)
    faults = schedule(0, STAGES, REPLICAS, inner_steps=H)
    joiner_stage = faults[0].stage
    with namespace_swarm(
        cfg, STEPS, step_timeout=8, delay_ms=5.0, workdir=tmp_path, spares={joiner_stage: 1}
    ) as ns:
        chaos = Chaos(ns, faults, inner_steps=H, window_steps=WINDOW)
        record = chaos.play()
        leaver = next(
            p for p in ns.swarm.peers if (p.stage, p.replica) == (faults[-1].stage, faults[-1].replica)
        )
        wait(ns.swarm, timeout=600, ignore=record.killed)
        events = {p.log.name: p.events() for p in ns.swarm.peers}
        logs = "\n".join(f"--- {p.log.name}\n{p.log_tail(10)}" for p in ns.swarm.peers)
        survivors = [p for p in ns.swarm.peers if p not in record.killed and p is not leaver]
        stage0 = [events[p.log.name] for p in ns.swarm.peers if p.stage == 0]
    summary = record.summary()
    (tmp_path / "chaos.json").write_text(json.dumps(summary, indent=1))
    healthy = record.windows[0]
    paces = {w.after: round(w.pace / healthy.pace, 2) for w in record.windows[1:]}
    end = record.ended["leave"]
    first_fault = record.started["kill"]
    trained = trained_samples(stage0, BATCH, first_fault, end)
    would = healthy.pace * REPLICAS * BATCH * (end - first_fault)
    print(f"chaos: pace after each fault / healthy: {paces}; goodput {trained / would:.2f}")
    print(f"chaos: {summary}")

    assert all(ratio >= 0.5 for ratio in paces.values()), (paces, summary, logs)
    finals = {p.log.name: next(iter(of_kind(events[p.log.name], Final)), None) for p in survivors}
    assert all(f is not None and f.steps == STEPS for f in finals.values()), (finals, logs)
    assert all(p.proc.returncode == 0 for p in survivors), logs
    # Views agree at every boundary built after the schedule ended, and there were a few.
    after = views_since(list(events.values()), end)
    assert len(after) >= 3, (sorted(after), logs)
    split = {r: views for r, views in after.items() if len(views) != 1}
    assert split == {}, split
    # The peers that came back (the frozen and the cut one, unless the swarm kept them) trained
    # on rows after they rejoined, and the joiner did.
    for p in survivors:
        history = events[p.log.name]
        for joined in of_kind(history, Joined):
            later = [e for e in of_kind(history, Step) if e.step > joined.step and e.loss is not None]
            assert later, f"{p.log.name} trained on nothing after rejoining\n{logs}"
    # Stage 0 evaluates (its samples cross the pipeline and the losses come back to it).
    losses = [f.val_loss for f in finals.values() if f.stage == 0]
    assert losses and all(loss is not None and loss < TARGET_LOSS for loss in losses), losses
