"""`noloco join`: run one peer that hosts one stage of a run, until the run's steps are done."""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import time

from rich.console import Console
from rich.text import Text

from noloco_swarm.cli.panel import PeerPanel
from noloco_swarm.peer.events import Final, to_dict
from noloco_swarm.peer.joining import RunEnding
from noloco_swarm.peer.launch import run_on_loop, run_peer
from noloco_swarm.peer.net.lifetime import exit_within, orphaned
from noloco_swarm.peer.net.transport import Transport
from noloco_swarm.train.config import RunConfig

# Once the peer has shut down, its event loop must close (joining its worker threads) within this
# many seconds. If a worker thread still holds it (a call that never returns), every thread's stack
# goes to stderr and the process exits with status 1: a peer that finished but hangs would stall
# whoever waits for it.
EXIT_GRACE = 60.0


def _stop_at_once(signum: int, frame: object) -> None:
    os._exit(130)


class _Say:
    """The peer's own lines (start, end, signals): rich text on stderr, or log records (`--log-format
    json`, one JSON object per line) under the logger `noloco_swarm.cli.join` at INFO."""

    def __init__(self, quiet: bool, json_logs: bool) -> None:
        self.console = Console(stderr=True, quiet=quiet)
        self.logger = logging.getLogger(__name__) if json_logs and not quiet else None
        if self.logger is not None:
            self.logger.setLevel(logging.INFO)

    def print(self, markup: str) -> None:
        if self.logger is not None:
            self.logger.info(Text.from_markup(markup).plain)
        else:
            self.console.print(markup)


def run_join(
    cfg: RunConfig,
    steps: int,
    *,
    new_run: bool,
    resume: bool = False,
    quiet: bool = False,
    log_format: str = "text",
    panel: bool = True,
) -> int:
    """Run one peer as `cfg.peer` and `cfg.network` say for `steps` inner steps; 130 on a signal.
    `log_format` json: every line on stderr is one JSON object (cli/logs.py). With `panel`, text
    logs and stderr a terminal, the peer's live panel (cli/panel.py) shows on stderr."""
    if log_format == "json":
        from noloco_swarm.cli.logs import use_json_logs

        use_json_logs()
    console = _Say(quiet, log_format == "json")
    watch = None
    if panel and not quiet and log_format == "text" and console.console.is_terminal:

        def watch(transport: Transport) -> PeerPanel:
            return PeerPanel(cfg, steps, console.console).attach(transport.byte_counts)

    net = cfg.network
    stage = "auto" if cfg.peer.stage is None else str(cfg.peer.stage)
    cpus = f", on CPUs {cfg.peer.cpus}" if cfg.peer.cpus else ""
    console.print(f"[bold]noloco join[/]: run {cfg.peer.run_id}, stage {stage}, {steps} steps{cpus}")
    if cfg.peer.release_memory == "thp":
        from noloco_swarm.peer.net.lifetime import huge_pages_off

        why = huge_pages_off()
        said = "on" if why is None else f"off ({why}): freed memory is handled as with map"
        console.print(f"peer.release_memory = thp: huge pages {said}")
    if net.announce_maddrs:
        console.print(f"announcing {', '.join(net.announce_maddrs)} to other peers")
    if not net.use_relay:
        console.print("circuit relays are off: peers that cannot dial us directly cannot reach us")

    async def main() -> Final:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        leave = asyncio.Event()

        def on_signal() -> None:
            if leave.is_set():  # the second signal: stop now, unwinding every finally (no daemon left)
                task.cancel()
                return
            if orphaned():  # the launcher that started us died: nobody waits for a graceful leave
                console.print("the process that started this peer is gone: stopping now")
                exit_within()  # a clean shutdown, if it is quick; gone in seconds either way
                task.cancel()
                return
            console.print("leaving the swarm at the next boundary; a second signal stops at once")
            leave.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        ran.set()
        try:
            return await run_peer(cfg, steps, new_run=new_run, resume=resume, leave=leave, watch=watch)
        finally:
            faulthandler.dump_traceback_later(EXIT_GRACE, exit=True)

    ran = asyncio.Event()  # set once main() took the signals over (only then are they left to us)
    try:
        summary = run_on_loop(main(), cfg.peer.event_loop)
    except asyncio.CancelledError:
        console.print("stopped by a signal; shut down cleanly")
        return 130
    except RunEnding as e:  # not a failure of this peer: the swarm is about to finish without it
        console.print(f"nothing left to train: {e}; this peer stops (start it again for the next run)")
        return 0
    finally:
        faulthandler.cancel_dump_traceback_later()  # the loop and its worker threads have ended
        # The loop's signal handlers closed with it, and a signal now would kill the process in
        # its last teardown (-15), as the second SIGTERM of a stop did to a peer that had just
        # left at a boundary (seen under the suite's load, 2026-12-07). Its work is done and its
        # daemon stopped: a signal now means stop at once, as the second one does while it runs.
        for sig in (signal.SIGTERM, signal.SIGINT) if ran.is_set() else ():
            signal.signal(sig, _stop_at_once)
    console.print(
        f"done: stage {summary.stage} replica {summary.rank}, {summary.steps} steps, "
        f"{summary.outer_steps} outer steps, state {summary.state_hash[:16]}"
    )
    if cfg.peer.metrics is None:
        # run_peer returns the record as built, before Events stamped its copy: stamp it now.
        print(json.dumps(to_dict(dataclasses.replace(summary, time=time.time())), default=str))
    return 0
