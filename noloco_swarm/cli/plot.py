"""`noloco plot RUN_DIR`: PNG charts of a run from its peers' JSON-lines event files.

`noloco local --keep DIR` (and `noloco testbed --keep`, and `noloco join --metrics FILE` for one
peer) write one `*.jsonl` file of typed events per peer. This reads them back with
`events.read` and draws, against inner steps and against wall-clock time since the run's first
inner step: the training loss (the last stage's peers compute it), the validation perplexity (peers
evaluate once, at the end: one point per peer), tokens per second, and bytes per peer (the
transport's totals at the end, and the outer exchanges' bytes as they accumulate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from noloco_swarm.peer import events
from noloco_swarm.peer.events import Final, Membership, Outer, Step, of_kind

CHARTS = ("loss", "val_ppl", "tokens_per_second", "bytes")


@dataclass
class PeerSeries:
    """One peer's events, as the charts need them."""

    name: str  # "stage S replica R", or the file's name when the peer never reported its place
    stage: int | None
    steps: list[Step] = field(default_factory=list)
    outers: list[Outer] = field(default_factory=list)
    final: Final | None = None


def load(run_dir: Path) -> list[PeerSeries]:
    """Every peer's series from the `*.jsonl` files in `run_dir` (a single file works too)."""
    files = [run_dir] if run_dir.is_file() else sorted(run_dir.glob("*.jsonl"))
    out = []
    for path in files:
        evs = events.read(path)
        if not evs:
            continue
        finals = of_kind(evs, Final)
        final = finals[-1] if finals else None
        stage: int | None = final.stage if final else None
        rank: int | None = final.rank if final else None
        views = of_kind(evs, Membership)
        if stage is None and views:
            view = views[-1]
            stage = next((s for s, members in enumerate(view.stages) if view.peer_id in members), None)
            rank = view.rank
        name = f"stage {stage} replica {rank}" if stage is not None else path.stem
        out.append(PeerSeries(name, stage, of_kind(evs, Step), of_kind(evs, Outer), final))
    return sorted(out, key=lambda p: (p.stage is None, p.stage or 0, p.name))


def run_start(peers: list[PeerSeries]) -> float:
    times = [e.time for p in peers for e in (*p.steps, *p.outers)]
    return min(times, default=0.0)


def write_charts(peers: list[PeerSeries], out: Path) -> dict[str, Path]:
    """One PNG per chart in `out`; returns chart name -> path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    t0 = run_start(peers)
    last_stage = max((p.stage for p in peers if p.stage is not None), default=None)
    paths = {}

    def figure(title: str):
        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
        fig.suptitle(title)
        by_step.set_xlabel("inner step")
        by_time.set_xlabel("wall-clock seconds since the first inner step")
        return fig, by_step, by_time

    def save(fig, name: str) -> None:
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name], dpi=100)
        plt.close(fig)

    def note(axes, text: str) -> None:
        for ax in axes:
            ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes)

    # Training loss: the last stage computes it; a step whose loss never came back is a gap.
    fig, by_step, by_time = figure("training loss (last stage's replicas)")
    shown = [p for p in peers if p.stage == last_stage and any(e.loss is not None for e in p.steps)]
    for p in shown:
        rows = [
            (e.step, e.time - t0, e.loss) for e in p.steps if e.loss is not None and math.isfinite(e.loss)
        ]
        by_step.plot([r[0] for r in rows], [r[2] for r in rows], label=p.name)
        by_time.plot([r[1] for r in rows], [r[2] for r in rows], label=p.name)
    if shown:
        by_step.set_ylabel("loss")
        by_step.legend(fontsize="small")
    else:
        note((by_step, by_time), "no peer reported a training loss")
    save(fig, "loss")

    # Validation perplexity: each replica's own path, once, when the peer finishes.
    fig, by_step, by_time = figure("validation perplexity (peers evaluate once, at the end)")
    finals = [p for p in peers if p.final is not None and p.final.val_loss is not None]
    for p in finals:
        assert p.final is not None and p.final.val_loss is not None
        ppl = math.exp(p.final.val_loss)
        by_step.scatter([p.final.steps], [ppl], label=p.name)
        by_time.scatter([p.final.time - t0], [ppl], label=p.name)
    if finals:
        by_step.set_ylabel("perplexity")
        by_step.legend(fontsize="small")
    else:
        note((by_step, by_time), "no peer reported a validation loss (the run did not finish)")
    save(fig, "val_ppl")

    # Tokens per second of each peer's inner steps (every replica serves B x T tokens a step).
    fig, by_step, by_time = figure("tokens per second, per peer")
    for p in peers:
        if p.steps:
            by_step.plot([e.step for e in p.steps], [e.tokens_per_second for e in p.steps], label=p.name)
            by_time.plot([e.time - t0 for e in p.steps], [e.tokens_per_second for e in p.steps], label=p.name)
    if any(p.steps for p in peers):
        by_step.set_ylabel("tokens/s")
        by_step.legend(fontsize="small")
    else:
        note((by_step, by_time), "no inner step yet")
    save(fig, "tokens_per_second")

    # Bytes: each peer's transport totals at the end, and its outer exchanges' bytes as they add up.
    fig, (totals, exchanged) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    fig.suptitle("bytes per peer")
    done = [p for p in peers if p.final is not None]
    if done:
        xs = range(len(done))
        sent = [sum(c.get("sent_total", 0) for c in p.final.bytes.values()) / 2**20 for p in done]  # type: ignore[union-attr]
        received = [sum(c.get("received_total", 0) for c in p.final.bytes.values()) / 2**20 for p in done]  # type: ignore[union-attr]
        totals.bar([x - 0.2 for x in xs], sent, width=0.4, label="sent")
        totals.bar([x + 0.2 for x in xs], received, width=0.4, label="received")
        totals.set_xticks(list(xs), [p.name for p in done], rotation=20, fontsize="small")
        totals.set_ylabel("MiB, whole run")
        totals.set_title("all traffic: rows, gradients, exchanges, state", fontsize="small")
        totals.legend(fontsize="small")
    else:
        note((totals,), "no peer has finished: totals come with each peer's summary")
    for p in peers:
        if p.outers:
            cumulative, total = [], 0
            for e in p.outers:
                total += e.sent_bytes + e.received_bytes
                cumulative.append(total / 2**20)
            exchanged.plot([e.step for e in p.outers], cumulative, marker="o", label=p.name)
    exchanged.set_xlabel("inner step")
    if any(p.outers for p in peers):
        exchanged.set_ylabel("MiB, cumulative")
        exchanged.set_title("outer exchanges (sent + received)", fontsize="small")
        exchanged.legend(fontsize="small")
    else:
        note((exchanged,), "no outer step yet")
    save(fig, "bytes")
    return paths


def run_plot(run_dir: Path, out: Path | None = None) -> int:
    if not run_dir.exists():
        print(f"noloco plot: {run_dir} does not exist (give the folder of noloco local --keep DIR)")
        return 2
    peers = load(run_dir)
    if not peers:
        print(
            f"noloco plot: no peer events (*.jsonl) in {run_dir}; run noloco local --keep {run_dir}, "
            "or noloco join --metrics FILE"
        )
        return 2
    target = out or (run_dir if run_dir.is_dir() else run_dir.parent) / "plots"
    paths = write_charts(peers, target)
    print(f"{len(peers)} peers; wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
