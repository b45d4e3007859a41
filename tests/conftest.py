"""Shared fixtures: one data cache per test session, never the user's ~/.cache."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# The suite draws the same examples on every run (a red CI run is then reproducible, and a green
# one is not luck); `pytest --hypothesis-profile=explore` draws fresh examples on each run, to look
# for new failures, and bench/fuzz.py fuzzes the decoders for longer.
settings.register_profile("suite", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("suite")


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache for the session, so the corpus is built and the BPE trained once."""
    path = tmp_path_factory.mktemp("noloco-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NOLOCO_CACHE", str(path))
        yield path


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread, as the peers run: a reference computed with more may order float sums
    differently inside the kernels, and no longer match them bit for bit."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for a module, so that daemons its fixtures start once (about a second each
    on 2 cores) serve all of its tests."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Sweep the daemon socket folders of processes the tests started that are gone (a killed
    peer or DHT process cannot remove its own; peers and local_swarm sweep them as they start)."""
    from noloco_swarm.peer.net.lifetime import sweep_sockets

    sweep_sockets()
