"""How the host allocator's settings trade a step's time against the memory it keeps (issue 35,
item 5: one allocator default within 5% of the fastest setting's step time).

The two stages of the testbed benches' tiny swarm (sequence 128), in one process on one thread,
run whole inner steps as a peer's replica does: both forwards, the loss, both backwards and an
AdamW step over both stages (foreach, as `StageReplica`). Each setting runs in a process of its
own, because glibc reads its tunables, and the loader LD_PRELOAD, at start:

- off: glibc's own (its mmap threshold grows to the largest block freed);
- map: `peer.release_memory=map` (blocks of 1.125 MiB and more get mappings of their own);
- trim: `peer.release_memory=trim` (malloc_trim after every step);
- map 16 MiB: map with a larger threshold (activation-sized blocks stay in the heap);
- ...+thp: the same with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which asks for
  transparent huge pages on what malloc maps (the kernel's THP mode must be `madvise` or `always`);
- thp: `peer.release_memory=thp`: map at 4 MiB, with huge pages;
- jemalloc, jemalloc keep: Debian's libjemalloc2 preloaded (`apt-get install libjemalloc2`), with
  its own defaults, and keeping all it frees (no decay): not settings of a peer.

Settings alternate within each repetition, in a fresh process each time; a setting's time is the
median of its repetitions' median steps, and its memory the peak resident set over the resident
set before the first step (what the steps added and kept at their worst), median over repetitions.
This leaves out the peer's own buffers (the transport's, the outer step's): bench/peer_memory.py
measures a whole peer.

    python bench/allocator.py --out docs/results/allocator.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from noloco_swarm.peer.net.lifetime import allocator_env

THP = allocator_env("thp", {})  # what peer.release_memory=thp starts a peer with
JEMALLOC = "/lib/x86_64-linux-gnu/libjemalloc.so.2"  # Debian's libjemalloc2, where installed
SETTINGS = {  # name: (peer.release_memory, environment, mmap threshold in MiB for map; 0: the peer's)
    "off": ("off", {}, 0),
    "map": ("map", {}, 0),
    "trim": ("trim", {}, 0),
    "thp": ("thp", THP, 0),  # map at 4 MiB, on huge pages
    "map+thp": ("map", THP, 0),
    "off+thp": ("off", THP, 0),
    "map 16 MiB+thp": ("map", THP, 16),
    # Not settings of a peer: jemalloc preloaded, with its own decay (freed pages handed back over
    # 10 s) and keeping everything freed.
    "jemalloc": ("off", {"LD_PRELOAD": JEMALLOC}, 0),
    "jemalloc keep": (
        "off",
        {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"},
        0,
    ),
}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(setting: str, batch: int, steps: int) -> dict:
    """One setting's steps in this process: median step seconds and the memory the steps added."""
    import torch
    from wallclock_validation import testbed_config  # bench/ is the script's folder: on sys.path

    from noloco_swarm.model import build_stage
    from noloco_swarm.peer.net.lifetime import release_memory, trim_heap

    mode, _, threshold_mib = SETTINGS[setting]
    release_memory(mode)
    if threshold_mib:  # a larger threshold than the peer's: blocks below it stay in the heap
        from noloco_swarm.peer.net.lifetime import M_MMAP_THRESHOLD, _glibc

        libc = _glibc()
        if libc is None or not libc.mallopt(M_MMAP_THRESHOLD, threshold_mib << 20):
            raise SystemExit(f"{setting}: this C library does not take an mmap threshold")
    torch.set_num_threads(1)  # as a peer of a local or testbed swarm runs
    model = testbed_config(seq_len=128, batch_size=batch, inner_steps=50).model
    stages = build_stage(model, 0, 2, 0), build_stage(model, 1, 2, 0)
    params = [p for s in stages for p in s.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (batch, model.seq_len), generator=generator)
    targets = torch.randint(0, model.vocab_size, (batch, model.seq_len), generator=generator)

    def step() -> None:
        hidden = stages[0](ids)
        received = hidden.detach().requires_grad_()
        (stages[1](received, targets).sum() / batch).backward()
        hidden.backward(received.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if mode == "trim":
            trim_heap()

    before = resident_bytes()
    step()  # the first step allocates the optimizer's moments: kept, as in a peer
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"median_step_s": statistics.median(times), "peak_over_start_mb": (peak - before) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per process")
    ap.add_argument("--reps", type=int, default=3, help="processes per setting, settings alternating")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch_size, args.steps)))
        return
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    # A library LD_PRELOAD cannot find is skipped with a warning: the setting would time glibc.
    if any(SETTINGS[n][1].get("LD_PRELOAD") == JEMALLOC for n in names) and not Path(JEMALLOC).exists():
        raise SystemExit(
            f"{JEMALLOC} is missing: apt-get install libjemalloc2, or leave out the jemalloc settings"
        )
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else reversed(names):
            env = {
                k: v
                for k, v in os.environ.items()
                if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CONF")
            }
            env |= SETTINGS[name][1]
            command = [sys.executable, __file__, "--child", name, "--batch-size", str(args.batch_size)]
            done = subprocess.run(
                [*command, "--steps", str(args.steps)], env=env, capture_output=True, text=True, check=True
            )
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    step = {n: statistics.median(r["median_step_s"] for r in runs[n]) for n in names}
    fastest = min(step.values())
    rows = {}
    for n in names:
        memory = statistics.median(r["peak_over_start_mb"] for r in runs[n])
        rows[n] = {"median_step_s": step[n], "over_fastest": step[n] / fastest, "peak_over_start_mb": memory}
        rows[n]["per_rep"] = runs[n]
        print(
            f"{n:8s} step {step[n] * 1e3:7.1f} ms ({step[n] / fastest:.3f}x the fastest), peak +{memory:.0f} MB"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python bench/allocator.py " + " ".join(sys.argv[1:])
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
        machine = {"thp": thp.read_text().strip() if thp.exists() else None}
        args.out.write_text(
            json.dumps({"command": command, "machine": machine, "settings": rows}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
