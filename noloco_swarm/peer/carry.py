"""Rows fed again: a stage-0 row whose gradient did not come back is trained one step later.

A sender finds a dead next-stage replica only when its call to it fails, and by then the replica's
stand-in has usually run that step, so the rows of that call cannot join it. Every row starts on
stage 0, which holds its token ids: a stage-0 replica feeds each of its rows whose gradient did
not come back at step t (its own call failed, or a later stage answered it `lost`) once more at
step t + 1, before that step's own rows and in the same microbatch 0 (`Carry`). Rows a live
receiver refused (late, another view) or answered with implausible gradients are not fed again:
they would meet the same answer (sending.Lost). A carried row
trains with step t + 1's weights and joins that step's gradient, as a sample of a batch one row
larger would; on a healthy swarm nothing is carried and the plan is the simulator's.

Carried rows have no place in the step plan. They ride with the rows of the step that each hop
sends anyway (`along`): the sender gives them, in order, cyclically to the receivers that get
this step's rows from it, so a receiver never waits for rows the plan does not announce. The
forward header says how many of its rows are carried (`ForwardHeader.carried`; they come first,
their sample indices those of the step before). Every stage runs them before its own rows and
sends them on the same way. A row is carried once: lost again, it is dropped.
"""

from __future__ import annotations

import torch


def along(planned: dict[int, list[int]], carried: int) -> dict[int, list[int]]:
    """Routes for a batch whose first `carried` rows are carried and whose other rows the plan
    routes as `planned` (receiver -> indices into those rows): each receiver's indices into the
    whole batch, carried rows first, handed out cyclically over the receivers in rank order."""
    routes = {receiver: [carried + j for j in sent] for receiver, sent in planned.items()}
    receivers = sorted(routes)
    if carried and not receivers:
        raise ValueError("carried rows need a receiver that gets rows of this step")
    extra: dict[int, list[int]] = {r: [] for r in receivers}
    for j in range(carried):
        extra[receivers[j % len(receivers)]].append(j)
    return {r: extra[r] + routes[r] for r in receivers}


class Carry:
    """A stage-0 replica's rows of one step to feed again at the next."""

    def __init__(self) -> None:
        self._step = -1
        self._samples: list[int] = []
        self._windows: list[torch.Tensor] = []

    def keep(self, step: int, samples: list[int], windows: list[torch.Tensor]) -> None:
        """The rows (sample indices and token windows) of `step` whose gradient did not come back."""
        self._step, self._samples, self._windows = step, samples, windows

    def take(self, step: int) -> tuple[list[int], torch.Tensor | None]:
        """The rows to feed at `step`: those kept at `step` - 1, in ascending sample order (none
        after a gap: a rejoin or a skipped step). Taken once."""
        kept, samples, windows = self._step, self._samples, self._windows
        self.keep(-1, [], [])
        if kept != step - 1 or not samples:
            return [], None
        order = sorted(range(len(samples)), key=lambda j: samples[j])
        return [samples[j] for j in order], torch.stack([windows[j] for j in order])
