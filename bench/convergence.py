"""The paper's Table 1 question at small scale: NoLoCo vs DiLoCo vs all-reduce vs local.

Tiny preset on the embedded corpus, N in {4, 8} replicas, P in {1, 2} stages, several seeds, equal
tokens for every method (same steps, same batch, same replicas). Reports final validation
perplexity, NoLoCo's ratios to DiLoCo and all-reduce with their spread over seeds, the Pearson
correlation between weight spread and learning rate (paper: 0.91-0.97), and the routing
ablation's change in weight spread (paper: about 10-15% lower with random routing).

Runs are independent, so they go to a pool of worker processes (one torch thread each) and each
finished run is appended to a JSON-lines file; re-running the same command skips finished runs.

    python bench/convergence.py --out runs/convergence            # the full grid
    python bench/convergence.py --out runs/conv-smoke --steps 40 --seeds 1 --replicas 4 --stages 1
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

from runlog import add_run_flags, run_pending, simulate  # bench/ is the script's folder: on sys.path

# Both DiLoCo baselines, labelled: the NoLoCo paper's (heavy-ball, momentum 0.3, as the official code
# runs it; its "14 of 16" compares against this one) and the DiLoCo paper's (Nesterov, momentum 0.9).
METHODS = ("noloco", "diloco-heavyball", "diloco-nesterov", "allreduce", "local")


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    method = job["method"]
    base = method.split("-")[0]
    extra: dict[str, Any] = {}
    if method == "noloco-fixed":
        extra["outer.random_routing"] = False
    if base == "diloco":
        extra["outer.diloco_variant"] = method.split("-")[1]
    if base in ("noloco", "local"):
        extra["outer.inner_steps"] = job["h_noloco"]
    elif base == "diloco":
        extra["outer.inner_steps"] = job["h_diloco"]
    return simulate(job, base, extra, window_losses=False)


def pearson(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else float("nan")


def summarise(rows: list[dict[str, Any]]) -> str:
    """The markdown tables for docs/benchmarks.md."""
    final = {(r["replicas"], r["stages"], r["method"], r["seed"]): r["evals"][-1] for r in rows}
    grid = sorted({(r["replicas"], r["stages"]) for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    lines = [
        "| N | P | noloco ppl | diloco-heavyball ppl | diloco-nesterov ppl | allreduce ppl | local ppl "
        "| noloco/diloco-heavyball | noloco/diloco-nesterov | noloco/allreduce | noloco <= heavyball, nesterov |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    wins = total = 0
    for n, p in grid:

        def ppl(method: str, n: int = n, p: int = p) -> list[float]:
            return [final[(n, p, method, s)]["val_ppl"] for s in seeds if (n, p, method, s) in final]

        cells = []
        for m in METHODS:
            v = ppl(m)
            cells.append(
                f"{statistics.fmean(v):.2f} ± {statistics.stdev(v) if len(v) > 1 else 0:.2f}" if v else "-"
            )
        ratios_h = [a / b for a, b in zip(ppl("noloco"), ppl("diloco-heavyball"), strict=False)]
        ratios_n = [a / b for a, b in zip(ppl("noloco"), ppl("diloco-nesterov"), strict=False)]
        ratios_a = [a / b for a, b in zip(ppl("noloco"), ppl("allreduce"), strict=False)]
        w, wn = sum(r <= 1.0 for r in ratios_h), sum(r <= 1.0 for r in ratios_n)
        wins, total = wins + w, total + len(ratios_h)

        def fmt(rs: list[float]) -> str:
            return f"{statistics.fmean(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})" if rs else "-"

        lines.append(
            f"| {n} | {p} | {' | '.join(cells)} | {fmt(ratios_h)} | {fmt(ratios_n)} | {fmt(ratios_a)} "
            f"| {w}/{len(ratios_h)}, {wn}/{len(ratios_n)} |"
        )
    lines.append("")
    lines.append(f"NoLoCo <= heavy-ball DiLoCo (the NoLoCo paper's baseline) in {wins} of {total} runs.")
    lines.append("")
    # Pearson correlation of weight spread with learning rate, per NoLoCo run (evals after warm-up).
    # The spread is that of the fast weights just before the latest outer step: right after it,
    # a group's members coincide, so the spread at an eval that lands on an outer step says little.
    corr = []
    for r in rows:
        if r["method"] != "noloco":
            continue
        evals = [e for e in r["evals"] if e["step"] > r["warmup"]]
        if len(evals) > 2:
            corr.append(pearson([e["spread_before_outer"] for e in evals], [e["lr"] for e in evals]))
    if corr:
        lines.append(
            f"Pearson correlation of weight spread with learning rate (NoLoCo, after warm-up, {len(corr)} runs): "
            f"mean {statistics.fmean(corr):.3f}, range {min(corr):.3f} to {max(corr):.3f}."
        )
    # Routing ablation: mean spread before the outer steps over the run, random vs fixed routes.
    abl = []
    for n, p in grid:
        for s in seeds:
            a, b = (n, p, "noloco", s), (n, p, "noloco-fixed", s)
            ra = next((r for r in rows if (r["replicas"], r["stages"], r["method"], r["seed"]) == a), None)
            rb = next((r for r in rows if (r["replicas"], r["stages"], r["method"], r["seed"]) == b), None)
            if ra and rb:
                ma = statistics.fmean(e["spread_before_outer"] for e in ra["evals"])
                mb = statistics.fmean(e["spread_before_outer"] for e in rb["evals"])
                abl.append((n, p, s, ma / mb - 1.0))
    if abl:
        changes = [c for *_, c in abl]
        lines.append(
            f"Routing ablation (P >= 2): mean weight spread with random routing vs fixed routes: "
            f"{statistics.fmean(changes):+.1%} (range {min(changes):+.1%} to {max(changes):+.1%}, {len(abl)} runs)."
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = sorted({(r["replicas"], r["stages"]) for r in rows})
    fig, axes = plt.subplots(
        2, len(grid), figsize=(4.2 * len(grid), 7), squeeze=False, constrained_layout=True
    )
    colors = {"noloco": "C0", "diloco-heavyball": "C1", "diloco-nesterov": "C5", "allreduce": "C2", "local": "C3",
              "noloco-fixed": "C4"}  # fmt: skip
    for col, (n, p) in enumerate(grid):
        ax_ppl, ax_spread = axes[0][col], axes[1][col]
        for method, color in colors.items():
            runs = [r for r in rows if (r["replicas"], r["stages"], r["method"]) == (n, p, method)]
            for i, r in enumerate(runs):
                steps = [e["step"] for e in r["evals"]]
                label = method if i == 0 else None
                ax_ppl.plot(
                    steps, [e["val_ppl"] for e in r["evals"]], color=color, alpha=0.7, lw=1, label=label
                )
                spread = [e["spread_before_outer"] or e["weight_spread"] for e in r["evals"]]
                ax_spread.plot(steps, spread, color=color, alpha=0.7, lw=1)
        ax_ppl.set(title=f"N={n}, P={p}", yscale="log", ylabel="val perplexity")
        ax_spread.set(xlabel="inner step", ylabel="weight spread before outer step")
        ax_ppl.grid(alpha=0.3)
        ax_spread.grid(alpha=0.3)
    handles = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)  # noloco-fixed only appears in the P >= 2 panels
    fig.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/convergence"))
    ap.add_argument("--replicas", default="4,8")
    ap.add_argument("--stages", default="1,2")
    add_run_flags(ap, steps=300, warmup=30, eval_every=20, eval_windows=48)
    ap.add_argument("--h-noloco", type=int, default=10, help="NoLoCo H (paper: 50 of 25,000 steps)")
    ap.add_argument("--h-diloco", type=int, default=20, help="DiLoCo H (paper: 100 of 25,000 steps)")
    args = ap.parse_args()
    key = ("replicas", "stages", "method", "seed", "steps", "seq_len", "batch_size", "h_noloco", "h_diloco")
    jobs = []
    for n in map(int, args.replicas.split(",")):
        for p in map(int, args.stages.split(",")):
            methods = (*METHODS, "noloco-fixed") if p >= 2 else METHODS
            for seed in range(args.seeds):
                for method in methods:
                    jobs.append({
                        "replicas": n, "stages": p, "method": method, "seed": seed, "steps": args.steps,
                        "warmup": args.warmup, "seq_len": args.seq_len, "batch_size": args.batch_size,
                        "h_noloco": args.h_noloco, "h_diloco": args.h_diloco, "eval_every": args.eval_every,
                        "eval_windows": args.eval_windows,
                    })  # fmt: skip

    def describe(row: dict) -> str:
        last = row["evals"][-1]
        return (
            f"N={row['replicas']} P={row['stages']} {row['method']:>12} seed {row['seed']}: "
            f"ppl {last['val_ppl']:.2f} spread {last['weight_spread']:.2e} ({row['seconds']:.0f} s)"
        )

    done = run_pending(args.out, jobs, key, run_one, describe, args.workers)
    rows = [
        r
        for r in done
        if tuple(r[k] for k in key[4:])
        == (args.steps, args.seq_len, args.batch_size, args.h_noloco, args.h_diloco)
    ]
    summary = summarise(rows)
    (args.out / "summary.md").write_text(summary + "\n")
    plot(rows, args.out / "convergence.png")
    print(summary)


if __name__ == "__main__":
    main()
