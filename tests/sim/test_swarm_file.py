"""Swarm files (train/layering.py, SwarmFile): `network.initial_peers` may name a small TOML file of
bootstrap addresses and a default run, as an organiser ships it (`noloco dht --swarm-file`)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from noloco_swarm.cli.dht import swarm_file_text
from noloco_swarm.cli.main import main
from noloco_swarm.train.layering import ConfigError, load_swarm_file

BOOT = "/ip4/203.0.113.7/tcp/31337/p2p/QmevZLzRdcVW3T5sXsy8syrRvzWLawCbjkbwLPJTB6AW8n"
OTHER = "/ip4/198.51.100.2/tcp/31337/p2p/QmaGgTf2Xx2hpZZvVvrm5bTnvFgqYDyYczSJBHXU9xUUJg"


@pytest.fixture(autouse=True)
def no_noloco_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOLOCO_SET", raising=False)


def printed(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main([*argv, "--print-config"]) == 0
    return tomllib.loads(capsys.readouterr().out)


def test_a_swarm_file_gives_its_peers_and_its_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "swarm.toml"
    path.write_text(swarm_file_text(["/ip4/127.0.0.1/tcp/31337/p2p/Qmx", BOOT], "public-1"))
    swarm = load_swarm_file(path)
    assert swarm.initial_peers == (BOOT, "/ip4/127.0.0.1/tcp/31337/p2p/Qmx") and swarm.run == "public-1"
    cfg = printed(capsys, ["join", "--initial-peers", str(path)])
    assert cfg["network"]["initial_peers"] == list(swarm.initial_peers)
    assert cfg["peer"]["run_id"] == "public-1"
    # A run id given by the volunteer wins; the file's multiaddrs join the ones given beside it.
    cfg = printed(capsys, ["join", "--initial-peers", OTHER, str(path), "--run-id", "mine"])
    assert (
        cfg["network"]["initial_peers"] == [OTHER, *swarm.initial_peers] and cfg["peer"]["run_id"] == "mine"
    )
    # Any command that reaches a swarm takes one; without a run in it, no run id is set.
    bare = tmp_path / "bare.toml"
    bare.write_text(swarm_file_text([BOOT], None))
    cfg = printed(capsys, ["status", "--initial-peers", str(bare), "--run-id", "r"])
    assert cfg["network"]["initial_peers"] == [BOOT]
    assert printed(capsys, ["runs", "--initial-peers", str(bare)])["peer"]["run_id"] == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "no multiaddr (/ip4/..., /dns/...) and no readable swarm file"),
        ("initial_peers = [", "no readable swarm file"),
        (f'initial_peers = ["{BOOT}"]\npeers = 3', "unknown keys ['peers']"),
        ("initial_peers = []", "non-empty list of multiaddrs"),
        ('initial_peers = ["203.0.113.7:31337"]', "non-empty list of multiaddrs"),
        (f'initial_peers = ["{BOOT}"]\nrun = "no spaces please"', "run: run id"),
    ],
)
def test_a_bad_swarm_file_is_refused_saying_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, message: str
) -> None:
    path = tmp_path / "swarm.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match="swarm file"):
        load_swarm_file(path)
    assert main(["runs", "--initial-peers", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_dht_run_needs_a_swarm_file_and_a_valid_run_id(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dht", "--run", "r1"]) == 2
    assert "give --swarm-file FILE too" in capsys.readouterr().err
    assert main(["dht", "--swarm-file", "/tmp/x.toml", "--run", "bad run"]) == 2
    assert "noloco dht --run: run id" in capsys.readouterr().err
