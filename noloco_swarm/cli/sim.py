"""`noloco sim`: run methods side by side in the simulator and write JSON, CSV and a plot."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from noloco_swarm.sim.engine import Simulator, StepStats
from noloco_swarm.sim.report import write_results
from noloco_swarm.sim.run import SimResult, run_simulation
from noloco_swarm.train.config import RunConfig


def run_sim(configs: dict[str, RunConfig], steps: int, out: Path) -> int:
    console = Console()
    results: dict[str, SimResult] = {}
    columns = (
        TextColumn("[bold]{task.description:>13}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as progress:
        for label, cfg in configs.items():
            task = progress.add_task(label, total=steps, loss="-")

            def on_step(sim: Simulator, stats: StepStats, task=task) -> None:
                progress.update(task, completed=stats.step, loss=f"{stats.loss:.3f}")

            results[label] = run_simulation(cfg, steps, on_step=on_step)
    paths = write_results(results, out)
    table = Table(title=f"simulator: {steps} inner steps")
    for column in ("method", "val ppl", "avg-model ppl", "spread", "tokens/s", "state hash"):
        table.add_column(column, justify="right")
    for label, r in results.items():
        f = r.final
        table.add_row(
            label,
            f"{f['val_ppl']:.2f}",
            f"{f['val_ppl_avg_model']:.2f}",
            f"{f['weight_spread']:.2e}",
            f"{r.tokens_per_second:,.0f}",
            r.state_hash[:12],
        )
    console.print(table)
    console.print(f"wrote {paths['json']}, {paths['csv']} and {paths['png']}")
    return 0
