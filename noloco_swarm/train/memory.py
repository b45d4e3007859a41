"""How much memory one peer needs for its stage: an estimate from the shapes alone (nothing is built).

A replica holds six fp32 copies of its stage's parameters: the weights, their gradients, AdamW's
two moments, the slow weights phi and the outer momentum delta (6 x 4 bytes per parameter). On
top: the activations kept for backward (the whole batch on stages before the last, whose
microbatches are all in flight before the flush; one microbatch on the last stage, which
backpropagates each at once), the last stage's logits and their gradient, and a fixed overhead per
peer process (Python and torch, p2pd; a forked DHT process until the DHT node moved into the
peer), about 0.9 GiB on CPU as measured for issue 14, kept as a margin.

Known limits: the activation term counts the tensors a Llama layer keeps per token (norm inputs,
q/k/v, attention output, the SwiGLU's three ffn-wide tensors) and, under eager attention, the
T x T probabilities; allocator slack and the outer exchange's two stage-sized copies (our theta
snapshot and the partner's) are not counted. Measured (bench/peer_memory.py, small preset on
the CPU), a peer's own process peaks at 1.2-1.3x of the state term beyond its idle size,
depending on peer.release_memory (docs/benchmarks.md).
It is meant for "does this fit", not for sizing to the last megabyte, and errs high: a
microbatch's logits, log-softmax and gradient are counted as alive at once, which has not yet been
checked against a measured peak of a real preset.
"""

from __future__ import annotations

from dataclasses import dataclass

from noloco_swarm.model.presets import ModelConfig, count_stage_parameters
from noloco_swarm.model.split import stage_layers
from noloco_swarm.train.config import RunConfig

GIB = 2**30
FP32 = 4
STATE_COPIES = 6  # weights, grads, Adam m and v, phi, delta
PROCESS_OVERHEAD = int(0.9 * GIB)  # Python, torch and the DHT node 0.8, p2pd 0.1 (RSS-like: kept high)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one peer of `stage` needs, by part."""

    stage: int
    parameters: int
    state: int  # 6 x 4 bytes x parameters
    activations: int
    logits: int  # the last stage only
    overhead: int

    @property
    def total(self) -> int:
        return self.state + self.activations + self.logits + self.overhead

    def describe(self) -> str:
        return (
            f"stage {self.stage}: {self.total / GIB:.2f} GiB = state {self.state / GIB:.2f} "
            f"({self.parameters / 1e6:.1f} M params x 6 x 4 B) + activations {self.activations / GIB:.2f} "
            f"+ logits {self.logits / GIB:.2f} + process {self.overhead / GIB:.2f}"
        )


def estimate(cfg: RunConfig, stage: int) -> MemoryEstimate:
    """The estimate for a peer that hosts `stage` of `cfg`'s run."""
    inner = cfg.inner
    largest = max(inner.microbatch_sizes, default=inner.batch_size // inner.microbatches)
    return stage_estimate(cfg.model, cfg.num_stages, stage, inner.batch_size, largest)


def stage_estimate(
    m: ModelConfig, num_stages: int, stage: int, batch_size: int, largest_microbatch: int
) -> MemoryEstimate:
    """The estimate for `stage` of `m` split into `num_stages`, at a batch of `batch_size` rows whose
    largest microbatch has `largest_microbatch` (what the planner tries before any config exists)."""
    layers = stage_layers(m.num_layers, stage, num_stages)
    first, last = stage == 0, stage == num_stages - 1
    params = count_stage_parameters(m, layers, first=first, last=last)
    tokens = batch_size * m.seq_len
    h, f = m.hidden_size, m.intermediate_size
    per_token_layer = FP32 * (8 * h + 5 * f)
    if m.attn_implementation == "eager":
        per_token_layer += FP32 * 2 * m.num_heads * m.seq_len  # scores and probabilities
    # The last stage backpropagates each microbatch as soon as it ran it: one microbatch is alive
    # there; the stages before it keep every microbatch of the step until its gradients return.
    alive = largest_microbatch * m.seq_len if last else tokens
    activations = alive * len(layers) * per_token_layer + tokens * h * FP32 * 2  # + rows in and out
    logits = alive * m.vocab_size * FP32 * 3 if last else 0  # logits, log-softmax, their gradient
    return MemoryEstimate(
        stage=stage,
        parameters=params,
        state=STATE_COPIES * FP32 * params,
        activations=activations,
        logits=logits,
        overhead=PROCESS_OVERHEAD,
    )


def largest(cfg: RunConfig) -> MemoryEstimate:
    """The estimate of the stage that needs the most (what `--stage auto` may be given)."""
    return max((estimate(cfg, s) for s in range(cfg.num_stages)), key=lambda e: e.total)
