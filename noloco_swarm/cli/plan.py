"""`noloco plan`: read the token costs, run the planner (sim/planner.py), print its ranking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from noloco_swarm.sim.planner import Plan, Projection, TokenCost, plan_json

# The measured token costs, in a checkout (the bench that measures them writes this file).
TOKEN_COST = Path(__file__).resolve().parents[2] / "docs" / "results" / "token_cost.json"


def load_token_costs(path: Path) -> list[TokenCost]:
    """The NoLoCo rows of a token_cost.json (a list of rows, or {"rows": [...]}) that reached the
    dense run's loss; [] if there is no file. bench/token_cost.py also measures DiLoCo (`method`),
    which the planner does not schedule, and a run that never reached the dense loss in the steps
    measured has no ratio (null): its schedule stays unmeasured rather than get a guess."""
    if not path.exists():
        return []
    data: Any = json.loads(path.read_text())
    rows = data.get("rows", []) if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of rows or {{'rows': [...]}}")
    return [
        TokenCost.from_row(row)
        for row in rows
        if isinstance(row, dict)
        and row.get("method", "noloco") == "noloco"
        and row.get("tokens_to_dense_loss_ratio", 0) is not None
    ]


def best(result: Plan, top: int) -> list[Projection]:
    """The first `top` measured schedules and the first `top` unmeasured ones, in rank order
    (top 0: all)."""
    measured = [p for p in result.schedules if p.measured]
    unmeasured = [p for p in result.schedules if not p.measured]
    return (measured[:top] + unmeasured[:top]) if top else result.schedules


def as_json(result: Plan, top: int) -> str:
    data = plan_json(result)
    shown = {id(p) for p in best(result, top)}
    data["schedules"] = [
        s for s, p in zip(data["schedules"], result.schedules, strict=True) if id(p) in shown
    ]
    return json.dumps(data, indent=2)


def hours(seconds: float | None) -> str:
    if seconds is None:
        return "unmeasured"
    return f"{seconds / 3600:,.1f} h" if seconds < 3600 * 72 else f"{seconds / 86400:,.1f} d"


def row(i: int | str, p: Projection) -> str:
    mb = p.bytes_per_step / 1e6
    parts = f"{mb:,.1f} ({p.pipeline_bytes_per_step / 1e6:,.1f} + {p.exchange_bytes_per_step / 1e6:,.1f})"
    return (
        f"{i!s:>3}  {p.candidate.label:46s} {p.timing.tokens_per_s:>10,.0f} {p.timing.utilisation:>7.4f}"
        f"  {parts:>28s}  {hours(p.time_to_target_s):>11s}"
    )


def as_text(result: Plan, top: int, token_cost: Path) -> str:
    pr = result.problem
    gb = f", {pr.gpu.memory_gb:g} GB" if pr.gpu.memory_gb else ", memory unknown"
    cap = "capped at 93% of the link" if pr.capped else "uncapped"
    lines = [
        f"noloco plan: {pr.model.name}, {pr.stages} stages x {pr.replicas} replicas, {pr.rate_mbit:g} Mbit/s, "
        f"RTT {pr.rtt_s * 1000:g} ms, {pr.gpu.name} ({pr.gpu.peak_tflops:g} TFLOP/s x {pr.mfu:g} MFU{gb})",
        f"{len(result.schedules)} schedules projected by the wall-clock model; the dense run needs "
        f"{pr.dense_tokens:.3g} tokens to the target; exchange {cap}; {pr.hop_rtts:g} round trip(s) added "
        "per pipeline message",
        f"token costs: {token_cost}"
        if token_cost.exists()
        else f"token costs: none ({token_cost} is missing): only the dense run (fp32, H=50) gets a time",
        "",
        f"{'#':>3}  {'schedule':46s} {'tokens/s':>10s} {'util.':>7s}  {'MB/step (rows + exchange)':>28s}"
        f"  {'to target':>11s}",
    ]
    for i, p in enumerate(best(result, top), 1):
        lines.append(row(i, p))
        lines.append("     " + " ".join(f"--set {k}={v}" for k, v in p.config.items()))
    b = result.baseline
    lines += ["", "today's default (noloco join):", row("-", b)]
    for what, p in (
        ("first", result.schedules[0] if result.schedules else None),
        ("fastest", max(result.schedules, key=lambda p: p.timing.tokens_per_s, default=None)),
    ):
        if p is not None:
            lines.append(
                f"the {what} ({p.candidate.label}): {p.timing.tokens_per_s / b.timing.tokens_per_s:.1f}x the "
                f"default's tokens/s, utilisation {p.timing.utilisation:.3f} against {b.timing.utilisation:.4f}"
            )
    return "\n".join(lines)


def schedule_toml(p: Projection, title: str) -> str:
    """A schedule's config keys as a TOML file for `--config`, each value typed as the run reads
    it (ConfigError if the planner proposed a config the run refuses). The run-wide keys go into
    the run's manifest when its first peer starts it; `peer.*` keys are that peer's own."""
    from noloco_swarm.cli.keys import toml_lines
    from noloco_swarm.train.layering import build_config

    keys = dict(p.config)
    preset, method = keys.pop("preset"), keys.pop("method")
    flat = build_config(preset, method, assignments=keys, env={}).flat()
    top = {k: flat[k] for k in keys if "." not in k}  # as the planner gives them
    sections = {k: flat[k] for k in sorted(keys) if "." in k}  # sections in name order
    values = {"preset": preset, "method": method} | top | sections
    return "\n".join([f"# {title}", *toml_lines(values)]) + "\n"
