"""What cutting a batch into microbatches costs the model's compute alone, without the peer.

The two stages of the testbed benches' 2x2 tiny swarm (sequence 128, batch 16), in one process on
one thread: each step runs stage 0's forward, stage 1's forward and loss, and both backwards, once
per microbatch, the gradients accumulating as a peer's do. Cuts alternate within each repetition;
a cut's time is its median step. The ratio to the uncut batch says how much of the schedule's
cost on a CPU is the layers' per-call work, and so how much is the peer's own handling of each
microbatch (messages, tasks, the wire format), which this leaves out.

    python bench/microbatch_compute.py --out docs/results/microbatch_compute.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from wallclock_validation import testbed_config  # bench/ is the script's folder: on sys.path

from noloco_swarm.model import build_stage

CUTS = {"16": [16], "4,4,4,4": [4] * 4, "2,4,4,4,2": [2, 4, 4, 4, 2], "16 x 1": [1] * 16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="repetitions; each times every cut")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per cut and repetition")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a peer of a local or testbed swarm runs
    batch = 16
    model = testbed_config(seq_len=128, batch_size=batch, inner_steps=50).model
    stages = build_stage(model, 0, 2, 0), build_stage(model, 1, 2, 0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (batch, model.seq_len), generator=generator)
    targets = torch.randint(0, model.vocab_size, (batch, model.seq_len), generator=generator)

    def step(cut: list[int]) -> None:
        start = 0
        for rows in cut:
            hidden = stages[0](ids[start : start + rows])
            received = hidden.detach().requires_grad_()
            (stages[1](received, targets[start : start + rows]).sum() / batch).backward()
            hidden.backward(received.grad)
            start += rows

    seconds: dict[str, list[float]] = {name: [] for name in CUTS}
    for rep in range(args.reps):
        for name in CUTS if rep % 2 == 0 else reversed(CUTS):
            step(CUTS[name])  # warm
            times = []
            for _ in range(args.steps):
                began = time.perf_counter()
                step(CUTS[name])
                times.append(time.perf_counter() - began)
            seconds[name].append(statistics.median(times))
    whole = statistics.median(seconds["16"])
    rows = {}
    for name, values in seconds.items():
        median = statistics.median(values)
        rows[name] = {"median_step_s": median, "over_uncut": median / whole, "per_rep_s": values}
        print(f"cut {name:10s} median step {median * 1e3:6.1f} ms, {median / whole:.3f}x the uncut batch")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python bench/microbatch_compute.py " + " ".join(sys.argv[1:])
        args.out.write_text(json.dumps({"command": command, "cuts": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
