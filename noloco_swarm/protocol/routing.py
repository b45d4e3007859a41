"""Per-sample random routes between neighbouring pipeline stages.

This is the only file that says which replica of stage s+1 receives a sample from a replica of
stage s. Samples are numbered by a global counter shared by all replicas: sample i of inner step
t is `k = t * B + i` (B = per-replica batch), so the i-th samples of all stage-0 replicas share
one k. For the hop from stage s to s+1 the official code (gensyn-ai/noloco, `pipeline_llama.py`)
draws `numpy.random.default_rng(k * P + s + 1).permutation(D)` and replica d of stage s sends to
`perm[d]`; the receiver finds its sender by inverting the permutation. Gradients go back the same
way. `route_permutation` reproduces that draw bit for bit.

Unequal replica counts (our generalisation, used when volunteers do not fill every stage
evenly): with S senders and R receivers draw `perm = default_rng(k*P + s + 1).permutation(max(S, R))`
and send sender d to `perm[d] % R`. With S == R this is exactly the official draw. For every
sample index the receivers' loads differ by at most one (a fair share): if S >= R the first S
entries are all of 0..S-1 and their residues mod R are balanced; if S < R the entries are
distinct and below R, so each receiver gets at most one sample. Over many k every receiver is
equally likely, since the permutation is uniform.
"""

from __future__ import annotations

import numpy as np


def _check(sample: int, hop: int, num_stages: int) -> None:
    if sample < 0:
        raise ValueError(f"sample index must be >= 0, got {sample}")
    if num_stages < 2:
        raise ValueError(f"routing needs at least 2 stages, got {num_stages}")
    if not 0 <= hop < num_stages - 1:
        raise ValueError(f"hop {hop} is not a hop between stages 0..{num_stages - 1}")


def sample_index(step: int, position: int, batch_size: int) -> int:
    """The global counter of sample `position` of inner step `step` (`k = t * B + i`)."""
    if not 0 <= position < batch_size:
        raise ValueError(f"position {position} is outside the batch of {batch_size}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step * batch_size + position


def _draw(sample: int, hop: int, num_stages: int, size: int) -> list[int]:
    seed = sample * num_stages + hop + 1
    return [int(x) for x in np.random.default_rng(seed).permutation(size)]


def route_permutation(sample: int, hop: int, num_stages: int, num_replicas: int) -> list[int]:
    """Entry d is the replica of stage `hop + 1` that receives sample `sample` from replica d."""
    _check(sample, hop, num_stages)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    return _draw(sample, hop, num_stages, num_replicas)


def inverse_permutation(perm: list[int]) -> list[int]:
    """Entry r is the sender whose sample goes to receiver r (perm must be a permutation)."""
    inverse = [-1] * len(perm)
    for sender, receiver in enumerate(perm):
        if not 0 <= receiver < len(perm) or inverse[receiver] != -1:
            raise ValueError(f"not a permutation of 0..{len(perm) - 1}: {perm}")
        inverse[receiver] = sender
    return inverse


def sender_of(sample: int, hop: int, num_stages: int, num_replicas: int, receiver: int) -> int:
    """The replica of stage `hop` whose sample `sample` arrives at `receiver` of stage `hop + 1`."""
    if not 0 <= receiver < num_replicas:
        raise ValueError(f"receiver {receiver} is outside 0..{num_replicas - 1}")
    return inverse_permutation(route_permutation(sample, hop, num_stages, num_replicas))[receiver]


def route_uneven(sample: int, hop: int, num_stages: int, num_senders: int, num_receivers: int) -> list[int]:
    """Entry d is the receiver (of `num_receivers`) of sender d (of `num_senders`); see module doc."""
    _check(sample, hop, num_stages)
    if num_senders < 1 or num_receivers < 1:
        raise ValueError(f"replica counts must be >= 1, got {num_senders} -> {num_receivers}")
    perm = _draw(sample, hop, num_stages, max(num_senders, num_receivers))
    return [perm[d] % num_receivers for d in range(num_senders)]


def senders_uneven(
    sample: int, hop: int, num_stages: int, num_senders: int, num_receivers: int, receiver: int
) -> list[int]:
    """The senders (ascending) whose sample `sample` goes to `receiver`; may be empty if S < R."""
    if not 0 <= receiver < num_receivers:
        raise ValueError(f"receiver {receiver} is outside 0..{num_receivers - 1}")
    route = route_uneven(sample, hop, num_stages, num_senders, num_receivers)
    return [d for d, r in enumerate(route) if r == receiver]


def full_route(sample: int, start_replica: int, replica_counts: list[int]) -> list[int]:
    """The replica at every stage for a sample that starts at `start_replica` of stage 0.

    `replica_counts[s]` is the number of replicas of stage s; equal counts give the official route.
    """
    num_stages = len(replica_counts)
    if not 0 <= start_replica < replica_counts[0]:
        raise ValueError(f"start replica {start_replica} is outside 0..{replica_counts[0] - 1}")
    path = [start_replica]
    for hop in range(num_stages - 1):
        route = route_uneven(sample, hop, num_stages, replica_counts[hop], replica_counts[hop + 1])
        path.append(route[path[-1]])
    return path
