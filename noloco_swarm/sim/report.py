"""Result files of simulator runs: JSON (everything), CSV (one row per eval) and a PNG plot."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path

from noloco_swarm.sim.run import SimResult

CSV_COLUMNS = [
    "method",
    "step",
    "tokens",
    "lr",
    "train_loss",
    "val_loss",
    "val_ppl",
    "val_ppl_avg_model",
    "val_ppl_best_replica",
    "weight_spread",
    "spread_before_outer",
    "wall_seconds",
]


def write_results(results: Mapping[str, SimResult], out_dir: Path) -> dict[str, Path]:
    """Write results.json, results.csv and results.png for runs keyed by label; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "csv": out_dir / "results.csv", "png": out_dir / "results.png"}
    paths["json"].write_text(json.dumps({label: r.to_dict() for label, r in results.items()}, indent=1))
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for label, result in results.items():
            for row in result.evals:
                writer.writerow({"method": label, **row})
    plot_results(results, paths["png"])
    return paths


def plot_results(results: Mapping[str, SimResult], path: Path, title: str | None = None) -> None:
    """Validation perplexity and weight spread against inner step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (ax_ppl, ax_spread) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for label, result in results.items():
        steps = [row["step"] for row in result.evals]
        (line,) = ax_ppl.plot(steps, [row["val_ppl"] for row in result.evals], marker="o", ms=3, label=label)
        ax_spread.plot(
            steps, [row["weight_spread"] for row in result.evals], marker="o", ms=3, color=line.get_color()
        )
    ax_ppl.set(xlabel="inner step", ylabel="validation perplexity (log scale)", yscale="log")
    ax_ppl.set_title("Validation perplexity (each replica on its own path)")
    ax_spread.set(xlabel="inner step", ylabel="RMS distance to stage mean")
    ax_spread.set_title("Weight spread between replicas")
    for ax in (ax_ppl, ax_spread):
        ax.grid(alpha=0.3)
    ax_ppl.legend()
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
