"""The simulator's side of the wire: activations and gradients make the format's round trip per hop."""

from __future__ import annotations

import pytest
import torch

from noloco_swarm.sim.engine import Simulator
from noloco_swarm.train.config import RunConfig
from tests.sim.test_config_precedence import JOIN, printed


def run(fmt: str, stages: int = 2, steps: int = 5) -> tuple[Simulator, list[float]]:
    cfg = RunConfig.create(
        "tiny",
        "noloco",
        model={"seq_len": 16},
        inner={"batch_size": 2, "warmup_steps": 2, "total_steps": 10},
        outer={"inner_steps": 3},
        wire={"activations": fmt},
        num_stages=stages,
        num_replicas=2,
    )
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.model.vocab_size, (2, steps, 2, 17), generator=g)
    sim = Simulator(cfg, lambda d, t: data[d, t])
    return sim, [sim.inner_step().loss for _ in range(steps)]


def test_each_format_is_deterministic_and_changes_training_only_through_the_hops(one_thread: None) -> None:
    hashes, exact = {}, run("fp32")[1]
    for fmt in ("fp32", "bf16", "int8"):
        sim, losses = run(fmt)
        again, _ = run(fmt)
        assert sim.replica_hashes() == again.replica_hashes(), f"{fmt} is not deterministic"
        assert all(abs(a - b) < 0.05 for a, b in zip(losses, exact, strict=True)), f"{fmt} trains differently"
        hashes[fmt] = sim.state_hash()
    assert len(set(hashes.values())) == 3, "bf16 and int8 must change the bits that cross a hop"
    # One stage: nothing crosses the wire, so every format trains the same weights.
    single = {fmt: run(fmt, stages=1)[0].state_hash() for fmt in ("fp32", "bf16", "int8")}
    assert len(set(single.values())) == 1


@pytest.mark.parametrize(
    ("argv", "fmt"),
    [
        (JOIN, "bf16"),  # a real swarm: the measured choice (docs/benchmarks.md)
        ([*JOIN, "--set", "wire.activations=fp32"], "fp32"),
        (["local"], "fp32"),  # its peers get the run config, so they stay exact too
        (["local", "--in-process"], "fp32"),
        (["local", "--in-process", "--set", "wire.activations=int8"], "int8"),
    ],
)
def test_noloco_join_defaults_to_bf16_and_the_rest_to_exact_rows(
    argv: list[str], fmt: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    values, _ = printed(argv, capsys, monkeypatch)
    assert values["wire.activations"] == fmt
