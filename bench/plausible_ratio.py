"""How far honest partners' outer weights lie from a replica's slow weights: the numbers behind
the defaults of `outer.plausible_factor` and `outer.plausible_floor` (protocol/plausible.py).

Runs the simulator (tiny preset, short windows) and, at every outer step, for every replica d
and every other replica m of its stage (every pair, not only the drawn group: the worst case),
records ||theta_m - phi_d|| against d's own progress ||theta_d - phi_d|| and against ||phi_d||.
Prints per configuration the largest ratio, the largest distance relative to ||phi||, the
smallest floor that the default factor (4) would need so that no honest pair is rejected, and
how far a partner's weights' norm strays from ||phi|| (a tighter check against scaled weights
would use it; not applied yet).

    python bench/plausible_ratio.py noloco,0,3,120,4,2 diloco,0,10,150,4,1 noloco,4,10,150,4,1,0.3

Each argument is METHOD,SEED,H,STEPS,REPLICAS,STAGES[,GAMMA]. With sequence length 32, batch 4,
warm-up a tenth of the steps and a cosine to the end (so the last rounds take tiny steps).
"""

from __future__ import annotations

import sys
import time

from noloco_swarm.protocol import plausible
from noloco_swarm.sim.engine import Simulator
from noloco_swarm.sim.run import data_batches
from noloco_swarm.train.layering import build_config

FACTOR = plausible.DEFAULT_FACTOR


def pairs(spec: str) -> list[tuple[int, float, float, float, float]]:
    """(boundary, own progress, partner distance, ||phi||, ||theta_partner||) for every honest
    pair and outer step."""
    method, seed, H, steps, D, P, *gamma = spec.split(",")
    assignments = {
        "model.seq_len": "32",
        "inner.batch_size": "4",
        "outer.inner_steps": H,
        "inner.warmup_steps": str(max(2, int(steps) // 10)),
        "inner.total_steps": steps,
        "eval_windows": "4",
        "num_stages": P,
        "num_replicas": D,
        "seed": seed,
        **({"outer.gamma": gamma[0]} if gamma else {}),
    }
    cfg = build_config("tiny", method, assignments=assignments, env={})
    sim = Simulator(cfg, data_batches(cfg))
    seen: list[tuple[int, float, float, float, float]] = []
    apply = sim._apply_outer

    def hook(boundary, all_thetas, *, carry):
        for row, thetas in zip(sim.replicas, all_thetas, strict=True):
            for d, replica in enumerate(row):
                own, phi_norm = plausible.own_progress(thetas[d], replica.phi)
                for m in range(len(row)):
                    if m != d:
                        far = plausible.distance(thetas[m], replica.phi)
                        seen.append((boundary, own, far, phi_norm, plausible.distance(thetas[m], None)))
        return apply(boundary, all_thetas, carry=carry)

    sim._apply_outer = hook  # type: ignore[method-assign]
    for _ in range(int(steps)):
        sim.inner_step()
    return seen


def main(specs: list[str]) -> None:
    for spec in specs:
        start = time.perf_counter()
        seen = pairs(spec)
        worst = max(seen, key=lambda x: x[2] / x[1])
        print(
            f"{spec}: pairs {len(seen)}, max ratio {max(x[2] / x[1] for x in seen):.3f} "
            f"(step {worst[0]}), median {sorted(x[2] / x[1] for x in seen)[len(seen) // 2]:.3f}, "
            f"max distance/|phi| {max(x[2] / x[3] for x in seen):.4f}, floor needed at factor "
            f"{FACTOR:g}: {max(0.0, *((x[2] - FACTOR * x[1]) / x[3] for x in seen)):.4f}, "
            f"max | |theta_partner| / |phi| - 1 |: {max(abs(x[4] / x[3] - 1) for x in seen):.4f} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
