"""The live views in a real terminal, and a volunteer's first hour: `noloco local` and `noloco
status`, then, as a volunteer handed only the bootstrap's address, `noloco doctor`, `noloco runs`
and `noloco join --auto`, each in a tmux window, against one live swarm; the screens are captured
and read as a user would read them. Ctrl-C then stops each as a user would: the joiner leaves at a
boundary, and `noloco local` stops its whole swarm, removes its temporary folder and leaves no
process behind. docs/terminal.md and docs/volunteer.md show the screens of one such run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.helpers import PACED_2S, descendants
from tests.small import SMALL_RUN

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# A run far longer than the test: it ends with Ctrl-C, never on its own before the joiner is in.
STEPS, H = 100_000, 10
# The swarm's run: the local swarm and the late joiner must hold the same config (the manifest).
RUN = ["--replicas", "2", "--steps", str(STEPS), "--set", f"outer.inner_steps={H}", *SMALL_RUN]
HINT = re.compile(r"noloco status --run-id (\S+) --initial-peers (\S+)")
WORKDIR = re.compile(r"logs and metrics in\s+(\S+)\s+\(removed at exit")
ROW = re.compile(r"^│ ([01])\s+│ ([01])\s+│", re.MULTILINE)  # a replica's row: stage, replica
PANEL = (  # a joiner's panel: where it trains, the swarm it sees, how others reach it
    re.compile(r"place\s+stage 0, replica \d, round \d+"),
    re.compile(r"swarm\s+5 peers \(3 \+ 2 per stage\)"),
    re.compile(r"reachable\s+(direct|loopback only)"),
)


class Terminal:
    """A private tmux server (its own socket) whose windows run our commands, each in a terminal of
    80 columns and 40 rows."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.socket, self.env = name, env
        self.windows: list[str] = []

    def tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args], check=False, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def open(self, window: str, argv: list[str]) -> None:
        # The shell stays after the command ends, so its last screen can still be read.
        command = " ".join(argv) + "; echo EXITED $?; sleep 3600"
        env = [a for k, v in self.env.items() for a in ("-e", f"{k}={v}")]
        if not self.windows:
            size = ["-x", "80", "-y", "40"]
            self.tmux("new-session", "-d", "-s", "t", "-n", window, *size, "-c", str(ROOT), *env, command)
            self.tmux("set-option", "-t", "t", "default-size", "80x40")  # and the windows opened later
        else:
            self.tmux("new-window", "-t", "t", "-n", window, "-c", str(ROOT), *env, command)
        self.windows.append(window)

    def screen(self, window: str) -> str:
        """What the window shows, with its scrollback, wrapped lines joined."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-300", "-t", f"t:{window}")

    def keys(self, window: str, *keys: str) -> None:
        self.tmux("send-keys", "-t", f"t:{window}", *keys)

    def wait_for(self, window: str, found: Callable[[str], object], what: str, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen(window)
            if found(screen):
                return screen
            assert "EXITED" not in screen or found(screen), f"{window} ended before {what}:\n{screen}"
            assert time.monotonic() < deadline, f"{window}: no {what} within {timeout:.0f} s:\n{screen}"
            time.sleep(1.0)

    def leftovers(self) -> set[str]:
        """Processes still running under the windows' shells, other than their final `sleep`."""
        found = set()
        for pane in self.tmux("list-panes", "-a", "-F", "#{pane_pid}").split():
            for pid in descendants(int(pane)):
                try:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                if name != "sleep":
                    found.add(f"{pid} {name}")
        return found

    def close(self) -> None:
        subprocess.run(
            ["tmux", "-L", self.socket, "kill-server"], check=False, capture_output=True, timeout=30
        )


def noloco(*args: str) -> list[str]:
    return [sys.executable, "-m", "noloco_swarm.cli.main", *args]


def steps_shown(screen: str, label: str = "step") -> list[int]:
    return [int(m) for m in re.findall(rf"^{label}\s+(\d+)/{STEPS}", screen, re.MULTILINE)]


def test_first_hour_doctor_runs_and_join_auto_beside_local_and_status(cache: Path, tmp_path: Path) -> None:
    if shutil.which("tmux") is None:
        pytest.fail(
            "tmux is not installed: sudo apt-get install -y tmux (scripts/setup_tools.sh installs it as root)"
        )
    # The swarm and the joiner train rounds of H steps of at least 2 s each (PACED_2S): the test
    # watches them, it does not need them fast, and the CPU goes to the commands beside them.
    env = {"NOLOCO_CACHE": str(cache), "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), **PACED_2S}
    term = Terminal(f"noloco-test-{os.getpid()}", env)
    try:
        term.open("local", noloco("local", *RUN))
        hint = HINT.search(term.wait_for("local", HINT.search, "status hint"))
        assert hint is not None
        run_id, bootstrap = hint.groups()

        # noloco local's live view: its stages and replicas, and steps that advance
        first = term.wait_for("local", lambda s: any(n > 0 for n in steps_shown(s)), "training step")
        n = max(steps_shown(first))
        # rich redraws the view in place, and a capture can fall in the middle of a frame: wait
        # for a later step in a whole one (its last line, the folder, drawn; a CI run here caught a
        # frame whose replica table was half drawn)
        later = term.wait_for(
            "local",
            lambda s: (
                max(steps_shown(s), default=0) > n and WORKDIR.search(s) and len(set(ROW.findall(s))) == 4
            ),
            "later step in a whole frame",
        )
        assert "local swarm 2 stages x 2 replicas" in later
        workdir = WORKDIR.search(later)
        assert workdir is not None and Path(workdir[1]).is_dir(), later
        rows = ROW.findall(later)
        assert sorted(set(rows)) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], later

        # noloco status from "another terminal", as the hint says: all four peers answer
        term.open("status", noloco("status", "--run-id", run_id, "--initial-peers", bootstrap))
        status = term.wait_for(
            "status",
            lambda s: all(
                x in s
                for x in (
                    "4 announced (stage 0: 2, stage 1: 2), 4 answering",
                    f"{run_id}  [noloco]",
                    "tiny, 2 stages",
                )
            ),
            "peers",
        )
        assert f"{run_id}  [noloco]" in status and "tiny, 2 stages" in status

        # A volunteer handed only the bootstrap's address: the preflight checks pass, the list of
        # runs shows this one (both stages full), and join --auto takes it, on stage 0 (no stage
        # lacks a peer: the lowest of the least crowded), with the run's own config.
        term.open("doctor", noloco("doctor", "--initial-peers", bootstrap))
        doctor = term.wait_for("doctor", lambda s: "EXITED" in s, "doctor's verdict", timeout=180)
        assert "EXITED 0" in doctor, doctor
        term.open("runs", noloco("runs", "--initial-peers", bootstrap))
        runs = term.wait_for("runs", lambda s: "EXITED" in s, "the list of runs", timeout=180)
        assert "EXITED 0" in runs and f"{run_id}  [open]" in runs, runs
        assert "peers per stage 2/2 2/2: every stage has its peers" in runs, runs
        term.open("join", noloco("join", "--initial-peers", bootstrap, "--auto"))
        panel = term.wait_for(
            "join",
            lambda s: steps_shown(s) and max(steps_shown(s)) > 0 and all(p.search(s) for p in PANEL),
            "joiner's step in a whole frame",
        )
        assert f"{run_id}: chosen: stage 0 has 2 of the 2 peers" in panel, panel
        screens = {
            "doctor.txt": doctor,
            "runs.txt": runs,
            "join-panel.txt": panel,
            "local-view.txt": later,
            "status-view.txt": status,
        }
        keep = os.environ.get("NOLOCO_KEEP_SCREENS")  # docs/terminal.md's and volunteer.md's captures
        for name, screen in screens.items():
            (tmp_path / name).write_text(screen)
            if keep:
                shutil.copy(tmp_path / name, Path(keep) / name)

        # Ctrl-C everywhere: the joiner leaves the swarm at its next boundary, the status view and
        # the swarm stop
        term.keys("join", "C-c")
        term.keys("status", "C-c")
        for window in ("doctor", "runs"):  # their shells' `sleep` ends with the tmux server
            assert "EXITED 0" in term.screen(window)
        left = term.wait_for("join", lambda s: "EXITED" in s, "joiner's exit", timeout=120)
        assert "leaving the swarm at the next boundary" in left and "EXITED 0" in left, left
        assert re.search(r"\bdone\s*$", left, re.MULTILINE) or "done: stage 1" in left, left
        term.keys("local", "C-c")
        ended = term.wait_for("local", lambda s: "EXITED" in s, "local's exit", timeout=120)
        assert "summary (interrupted)" in ended and "EXITED 130" in ended, ended
        assert not Path(workdir[1]).exists(), "noloco local left its temporary folder behind"
        assert "EXITED" in term.wait_for("status", lambda s: "EXITED" in s, "status's exit", timeout=60)
        deadline = time.monotonic() + 30  # every peer, daemon and DHT process ended with its command
        while term.leftovers() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not term.leftovers()
    finally:
        term.close()
