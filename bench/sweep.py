"""Where does NoLoCo match DiLoCo? Both papers' baselines, the routing ablation, a constant-lr control.

One process, one torch thread, one run at a time (the machine is shared): every run is a simulator
run on the embedded corpus whose result goes to its own JSON file under `--out`; a run whose file
exists is skipped, so an interrupted sweep continues where it stopped. Runs are listed in priority
order (the core comparison first), so a sweep cut short still answers the main question.

Methods: `noloco` (pairs, alpha 0.5, beta 0.7, gamma = beta unless the run scales it), and the two
DiLoCo baselines with H twice NoLoCo's: `diloco-heavyball` (the NoLoCo paper's, as the official
code runs it: heavy-ball, momentum 0.3, lr 0.7) and `diloco-nesterov` (the DiLoCo paper's:
Nesterov, momentum 0.9, lr 0.7). Routing ablation (P = 2): `local` and `noloco` with random
per-sample routes against their `-fixed` chains. Control: `noloco-constlr` keeps the peak lr after
warm-up. NoLoCo's groups are drawn with `outer.seeded_groups` on, so that seeds vary the partners
too (with it off every seed sees the same partner sequence).

Evaluation: the deduplicated validation split, at the end of each run, up to data.val_max_windows
(512) windows: 16,384 of its 25,194 tokens with this vocabulary and window;
each file records the token count, the standard error of the loss over windows, and the
per-window losses, so that two runs can be compared on the same windows (a paired error).

    nice -n 19 python bench/sweep.py --out docs/results/sweep            # run (or continue)
    python bench/sweep.py --out docs/results/sweep --summarise           # tables + plot only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

BASE = {  # the model and data every run shares (the tiny preset's shape, a smaller vocabulary)
    "model.vocab_size": 1024,
    "model.seq_len": 32,
    "inner.batch_size": 4,
    "inner.lr": 1e-3,
    "inner.min_lr": 1e-4,
}
DILOCO = ("diloco-heavyball", "diloco-nesterov")
TRIO = ("noloco", *DILOCO)


def spec(group: str, method: str, n: int, p: int, seed: int, steps: int, h: int, **extra: Any) -> dict:
    gamma = extra.get("gamma_factor", 1.0)
    name = f"{group}-{method}-N{n}-P{p}-H{h}-S{steps}-g{gamma:g}-seed{seed}"
    return {"name": name, "group": group, "method": method, "replicas": n, "stages": p, "seed": seed,
            "steps": steps, "h": h, "gamma_factor": gamma}  # fmt: skip


def plan(steps: int, h: int) -> list[dict]:
    """Every run of the sweep, most important first."""
    runs = []
    for seed in range(3):  # the core comparison at N = 4, the routing ablation, the lr control
        runs += [spec("core", m, 4, 1, seed, steps, h) for m in TRIO]
        runs += [
            spec("routing", m, 4, 2, seed, steps, h)
            for m in ("local", "local-fixed", "noloco", "noloco-fixed")
        ]
        runs.append(spec("control", "noloco-constlr", 4, 1, seed, steps, h))
    runs += [spec("core", m, n, 1, 0, steps, h) for n in (8, 16) for m in TRIO]
    for hh in (2 * h, 5 * h):  # H: NoLoCo 10-50 against DiLoCo at twice that
        runs += [spec("h", m, 4, 1, 0, steps, hh) for m in TRIO]
    runs += [spec("gamma", "noloco", 4, 1, 0, steps, h, gamma_factor=g) for g in (0.5, 1.5)]
    runs += [spec("core", m, 8, 1, 1, steps, h) for m in TRIO]
    runs += [spec("long", m, 4, 1, 0, 5 * steps, h) for m in TRIO]
    for seed in (1, 2):
        runs += [spec("core", m, 16, 1, seed, steps, h) for m in TRIO]
        runs += [spec("long", m, 4, 1, seed, 5 * steps, h) for m in TRIO]
    runs += [spec("core", m, 8, 1, 2, steps, h) for m in TRIO]
    return runs


def assignments(run: dict, warmup: int) -> tuple[str, dict[str, Any]]:
    method = run["method"]
    base = method.split("-")[0]
    a: dict[str, Any] = {
        **BASE,
        "num_replicas": run["replicas"],
        "num_stages": run["stages"],
        "seed": run["seed"],
        "inner.total_steps": run["steps"],
        "inner.warmup_steps": warmup,
        "eval_every": 0,
        "eval_windows": 100_000,  # as many as data.val_max_windows gives
        "outer.inner_steps": 2 * run["h"] if base == "diloco" else run["h"],
        "outer.random_routing": not method.endswith("-fixed"),
    }
    if base == "diloco":
        a["outer.diloco_variant"] = method.split("-")[1]
    if base == "noloco":
        a["outer.seeded_groups"] = True
        a["outer.gamma"] = 0.7 * run["gamma_factor"]
    if method.endswith("-constlr"):
        a["inner.min_lr"] = BASE["inner.lr"]
    return base, a


def run_one(run: dict, warmup: int) -> dict:
    from noloco_swarm.sim.run import run_simulation
    from noloco_swarm.train.layering import build_config

    base, a = assignments(run, warmup)
    cfg = build_config("tiny", base, assignments={k: str(v) for k, v in a.items()}, env={})
    trace: list[dict] = []  # weight spread over the run: before each outer step, or every H steps

    def on_step(sim, stats) -> None:
        if stats.outer_step:
            trace.append({"step": stats.step, "lr": stats.lr, "spread": sim.spread_before_outer})
        elif base == "local" and stats.step % run["h"] == 0:
            trace.append({"step": stats.step, "lr": stats.lr, "spread": sim.weight_spread()})

    windows: list[float] = []
    start = time.perf_counter()
    result = run_simulation(
        cfg,
        run["steps"],
        on_step=on_step,
        on_eval=lambda sim, _: windows.extend(sim.last_window_losses.tolist()),
    )
    return {**run, "config": cfg.manifest(), "final": result.final, "trace": trace,
            "window_losses": windows, "seconds": time.perf_counter() - start}  # fmt: skip


# ---------------------------------------------------------------------------------------- summary


def load(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def pearson(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else float("nan")


def paired(a: dict, b: dict) -> tuple[float, float]:
    """log(ppl_a / ppl_b) on the same windows, and its standard error over windows."""
    d = [x - y for x, y in zip(a["window_losses"], b["window_losses"], strict=True)]
    return statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))


def fmt_ratio(rs: list[float]) -> str:
    if not rs:
        return "-"
    return f"{statistics.fmean(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})" if len(rs) > 1 else f"{rs[0]:.3f}"


def summarise(runs: dict[str, dict]) -> str:
    def find(group: str, method: str, n: int, p: int, h: int, steps: int, seed: int, g: float = 1.0):
        return runs.get(spec(group, method, n, p, seed, steps, h, gamma_factor=g)["name"])

    lines = []
    rows = sorted({(r["group"], r["replicas"], r["stages"], r["h"], r["steps"], r["gamma_factor"])
                   for r in runs.values() if r["group"] in ("core", "h", "long", "gamma")})  # fmt: skip
    lines += [
        "| set | N | H (NoLoCo / DiLoCo) | steps | gamma/beta | seeds | noloco ppl | diloco-heavyball ppl | diloco-nesterov ppl "
        "| noloco / heavyball | noloco / nesterov | paired s.e. of the ratio | noloco <= heavyball | noloco <= nesterov |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tokens = set()
    for group, n, p, h, steps, g in rows:
        seeds = sorted(
            {
                r["seed"]
                for r in runs.values()
                if (r["group"], r["replicas"], r["h"], r["steps"]) == (group, n, h, steps)
            }
        )
        cells, ratios, ses = [], {m: [] for m in DILOCO}, []
        for m in TRIO:
            gg = g if m == "noloco" else 1.0
            got = [find(group, m, n, p, h, steps, s, gg) for s in seeds]
            vals = [r["final"]["val_ppl"] for r in got if r]
            tokens |= {r["final"]["val_tokens"] for r in got if r}
            sd = f" ± {statistics.stdev(vals):.1f}" if len(vals) > 1 else ""
            cells.append(f"{statistics.fmean(vals):.1f}{sd}" if vals else "-")
        for s in seeds:
            nl = find(group, "noloco", n, p, h, steps, s, g)
            for m in DILOCO:
                dl = find(group, m, n, p, h, steps, s)
                if nl and dl:
                    diff, se = paired(nl, dl)
                    ratios[m].append(math.exp(diff))
                    ses.append(se)
        if group == "gamma":  # its DiLoCo runs are the core set's at the same point
            for s in seeds:
                nl = find(group, "noloco", n, p, h, steps, s, g)
                for m in DILOCO:
                    dl = find("core", m, n, p, h, steps, s)
                    if nl and dl:
                        ratios[m].append(math.exp(paired(nl, dl)[0]))
                        ses.append(paired(nl, dl)[1])
                cells[1:] = [f"(core) {statistics.fmean([find('core', m, n, p, h, steps, s)['final']['val_ppl'] for s in seeds if find('core', m, n, p, h, steps, s)]):.1f}" if any(find('core', m, n, p, h, steps, s) for s in seeds) else "-" for m in DILOCO]  # fmt: skip
        se = f"{statistics.fmean(ses):.3f}" if ses else "-"
        wins = [f"{sum(r <= 1 for r in ratios[m])}/{len(ratios[m])}" for m in DILOCO]
        lines.append(
            f"| {group} | {n} | {h} / {2 * h} | {steps} | {g:g} | {len(seeds)} | {' | '.join(cells)} | "
            f"{fmt_ratio(ratios['diloco-heavyball'])} | {fmt_ratio(ratios['diloco-nesterov'])} | {se} | {' | '.join(wins)} |"
        )
    lines += ["", f"Perplexities are over {', '.join(map(str, sorted(tokens)))} held-out tokens (the first data.val_max_windows "
              "windows of the deduplicated validation split); mean ± std over seeds; ratios: mean (range) over seeds, each "
              "computed on the same windows; the paired s.e. is that of log(ratio) over windows.", ""]  # fmt: skip

    # Routing ablation: mean spread over the run, random routes vs fixed chains, per seed.
    lines.append(
        "| outer step | seed | spread, random routes | spread, fixed chains | change | ppl random / fixed |"
    )
    lines.append("|---|---|---|---|---|---|")
    for base in ("local", "noloco"):
        changes = []
        for r in sorted(
            (r for r in runs.values() if r["group"] == "routing" and r["method"] == base),
            key=lambda r: r["seed"],
        ):
            fixed = runs.get(r["name"].replace(f"-{base}-", f"-{base}-fixed-"))
            if not fixed:
                continue
            a = statistics.fmean(e["spread"] for e in r["trace"])
            b = statistics.fmean(e["spread"] for e in fixed["trace"])
            changes.append(a / b - 1)
            label = "off (local)" if base == "local" else "NoLoCo"
            ratio = r["final"]["val_ppl"] / fixed["final"]["val_ppl"]
            lines.append(f"| {label} | {r['seed']} | {a:.3e} | {b:.3e} | {a / b - 1:+.1%} | {ratio:.3f} |")
        if changes:
            lines.append(f"| {base}: mean | | | | {statistics.fmean(changes):+.1%} | |")
    lines.append("")

    # Spread vs lr: cosine runs against the constant-lr control.
    lines.append(
        "| schedule | seed | Pearson(spread, lr) | Pearson(spread, step) | spread last third / first third |"
    )
    lines.append("|---|---|---|---|---|")
    for r in sorted(runs.values(), key=lambda r: (r["method"], r["seed"])):
        if not (
            r["group"] == "control"
            or (r["group"] == "core" and r["method"] == "noloco" and r["replicas"] == 4)
        ):
            continue
        tr = [e for e in r["trace"] if e["step"] > r["config"]["inner.warmup_steps"]]
        if len(tr) < 6:
            continue
        third = len(tr) // 3
        drift = statistics.fmean(e["spread"] for e in tr[-third:]) / statistics.fmean(
            e["spread"] for e in tr[:third]
        )
        sched = "constant lr" if r["group"] == "control" else "cosine"
        lines.append(
            f"| {sched} | {r['seed']} | {pearson([e['spread'] for e in tr], [e['lr'] for e in tr]):.3f} | "
            f"{pearson([e['spread'] for e in tr], [e['step'] for e in tr]):.3f} | {drift:.3f} |"
        )
    secs = sum(r["seconds"] for r in runs.values())
    lines += ["", f"{len(runs)} runs, {secs / 60:.0f} minutes of one nice'd core."]
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    core = [r for r in runs.values() if r["group"] in ("core", "h", "long") and r["method"] == "noloco"]
    for m, marker in zip(DILOCO, "os", strict=True):
        xs, ys = [], []
        for r in core:
            dl = runs.get(r["name"].replace("-noloco-", f"-{m}-"))
            if dl:
                xs.append(r["replicas"] * (1.03 if m == DILOCO[1] else 0.97))
                ys.append(math.exp(paired(r, dl)[0]))
        ax1.scatter(xs, ys, marker=marker, label=f"noloco / {m}", alpha=0.7)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set(xlabel="replicas N", ylabel="perplexity ratio (below 1: NoLoCo better)")
    ax1.set_xticks([4, 8, 16], ["4", "8", "16"])
    ax1.set_xlim(2, 18)
    ax1.legend(fontsize=8)
    for r in runs.values():
        if r["group"] == "control" or (
            r["group"] == "core" and r["method"] == "noloco" and r["replicas"] == 4
        ):
            color = "C3" if r["group"] == "control" else "C0"
            ax2.plot(
                [e["step"] for e in r["trace"]], [e["spread"] for e in r["trace"]], color=color, alpha=0.7
            )
    ax2.plot([], [], color="C0", label="cosine lr")
    ax2.plot([], [], color="C3", label="constant lr")
    ax2.set(xlabel="inner step", ylabel="weight spread before outer step", title="NoLoCo, N=4, P=1")
    ax2.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/results/sweep"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--h", type=int, default=10, help="NoLoCo H (DiLoCo: twice this)")
    ap.add_argument("--only", default="", help="comma-separated groups to run (default: all)")
    ap.add_argument("--summarise", action="store_true", help="only write summary.md and the plot")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.summarise:
        import torch

        torch.set_num_threads(1)
        todo = [r for r in plan(args.steps, args.h) if not args.only or r["group"] in args.only.split(",")]
        left = [r for r in todo if not (args.out / f"{r['name']}.json").exists()]
        print(f"{len(todo) - len(left)} of {len(todo)} runs done, {len(left)} to go", flush=True)
        spent = 0.0
        for i, run in enumerate(left):
            row = run_one(run, args.warmup)
            tmp = args.out / f".{run['name']}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(row))
            os.replace(tmp, args.out / f"{run['name']}.json")  # a run counts once its file is whole
            spent += row["seconds"]
            f = row["final"]
            print(f"[{i + 1}/{len(left)}] {run['name']}: ppl {f['val_ppl']:.2f} over {f['val_tokens']} tokens "
                  f"(s.e. {f['val_loss_se']:.3f}), {row['seconds']:.0f} s; {spent / 60:.0f} min so far", flush=True)  # fmt: skip
    runs = load(args.out)
    if runs:
        (args.out / "summary.md").write_text(summarise(runs) + "\n")
        plot(runs, args.out / "sweep.png")
        print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
