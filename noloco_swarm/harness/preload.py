"""Peers forked from one process that has already imported torch, transformers and hivemind.

A peer spends about 4 s of CPU importing those before it serves (numpy and torch 1.2 s, the
transformers Llama modules 2.6 s, hivemind 0.4 s), and a swarm started here paid that once per
peer: on a 2-core machine a 2 x 2 swarm spent its first 8 s importing. The preloader is one
process (`python -m noloco_swarm.harness.preload FD`) that imports them once and then forks each
peer from itself. The child becomes what `python -m noloco_swarm.cli.main ARGS` would be: a
session of its own, its own environment, working directory and log on stdout and stderr, stdin
from /dev/null, and that module run as __main__ (runpy), so the interpreter's normal exit (threads
joined, atexit handlers) ends it. It is a real peer process with its own p2pd; only the
import is shared, copy-on-write.

What a fork cannot change is what the preloaded modules read from the environment as they were
imported (hivemind's log level, the Hugging Face cache variables, torch's flags). So a peer is
forked only when its environment equals the preloader's apart from `NOLOCO_*` variables, which
only our own modules read, and the preloader imports none of those. Otherwise, or with a command
prefix, the launcher starts the peer as before. A peer of the namespace testbed is forked too: the
child enters its host's network namespace (setns) before anything else, which is what `ip netns
exec` does for a peer (the peer reads no per-namespace /etc or /sys files). On a 2-core machine
this is what lets 32 testbed peers share one import (docs/testbed.md).

The preloader's child processes are not ours, so `Forked` stands in for `subprocess.Popen`
(pid, poll, wait, returncode, signals): the preloader reaps each child and sends its exit status
over a socket of that child's own. The preloader ends when the launching process does (the
control socket reaches end of file), and a peer started with `--die-with-parent` then ends too.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import os
import runpy
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path

import setproctitle

# What the preloader imports: the modules that make a peer's start-up slow. None of them is ours:
# our modules read NOLOCO_* variables as they are imported (failpoints), which differ per peer.
PRELOADED = ("numpy", "torch", "transformers.models.llama.modeling_llama", "hivemind")
CLI_MODULE = "noloco_swarm.cli.main"  # what a peer runs: `python -m CLI_MODULE join ...`
MESSAGE_BYTES = 1 << 20  # the largest request (argv and environment) the preloader reads
READY_TIMEOUT = 120.0  # seconds the preloader may take to import PRELOADED (a loaded 2-core machine)


def command(args: Sequence[str]) -> list[str]:
    """The command line that runs `noloco ARGS` from scratch (and that a forked peer shows)."""
    return [sys.executable, "-m", CLI_MODULE, *args]


class Forked:
    """A peer process forked by the preloader, with the parts of subprocess.Popen's interface the
    harness uses. `returncode` is the exit code, or -N for a process ended by signal N; -1 if the
    preloader ended before the peer did (its status is then unknown)."""

    def __init__(self, args: Sequence[str], pid: int, status: socket.socket) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = None  # the peer writes its log itself
        self._status = status

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _collect(self) -> None:
        message = self._status.recv(MESSAGE_BYTES)
        self.returncode = json.loads(message)["returncode"] if message else -1
        self._status.close()


class Preloader:
    """The launching side: starts the preloader process and asks it for peers."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        """A preloader started with `env` (this process's environment by default)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ if env is None else env)
        argv = [sys.executable, "-m", __name__, str(theirs.fileno())]
        # A session of its own: a terminal's Ctrl-C reaches the launcher, which ends its peers
        # gracefully, and not the preloader, whose end would end them at once.
        self.process = subprocess.Popen(
            argv, pass_fds=[theirs.fileno()], start_new_session=True, env=self.env
        )
        theirs.close()
        self._control = ours
        self._lock = threading.Lock()
        ready = select.select([ours], [], [], READY_TIMEOUT)[0]
        if not ready or ours.recv(MESSAGE_BYTES) != b"ready":
            self.close()
            raise RuntimeError(f"the peer preloader did not start (exit {self.process.poll()})")

    def forks(self, env: Mapping[str, str]) -> bool:
        """Whether a peer with environment `env` can be forked from this preloader (see above)."""
        return self.process.poll() is None and imported_with(self.env) == imported_with(env)

    def spawn(
        self, args: Sequence[str], env: Mapping[str, str], log: Path, netns: str | None = None
    ) -> Forked:
        """Fork a process that runs `noloco ARGS` with `env`, in the current working directory,
        writing stdout and stderr to `log` (truncated here first); in network namespace `netns`
        (a name `ip netns` knows) if given."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = {"args": list(args), "env": dict(env), "cwd": os.getcwd(), "netns": netns}
        with log.open("wb") as out, self._lock:  # the log exists once this returns, as with Popen
            socket.send_fds(self._control, [json.dumps(request).encode()], [theirs.fileno(), out.fileno()])
        theirs.close()
        if not select.select([mine], [], [], READY_TIMEOUT)[0]:
            mine.close()
            raise RuntimeError("the peer preloader did not answer a request to start a peer")
        answer = mine.recv(MESSAGE_BYTES)
        if not answer:
            mine.close()
            raise RuntimeError(f"the peer preloader ended (exit {self.process.poll()})")
        return Forked(command(args), json.loads(answer)["pid"], mine)

    def close(self) -> None:
        """End the preloader (peers it forked with --die-with-parent then end too)."""
        self._control.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def imported_with(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that the preloaded modules may have read as they were imported: all
    but NOLOCO_* (read only by our modules) and PYTEST_CURRENT_TEST (pytest sets it per test)."""
    return {k: v for k, v in env.items() if not k.startswith("NOLOCO_") and k != "PYTEST_CURRENT_TEST"}


ALLOCATOR_VARS = ("GLIBC_TUNABLES",)  # read by malloc as a process starts: a fork keeps its preloader's
_shared: dict[tuple[str | None, ...], Preloader] = {}
_shared_lock = threading.Lock()


def shared(env: Mapping[str, str] | None = None) -> Preloader:
    """This process's preloader for peers started with `env`'s allocator settings (ALLOCATOR_VARS,
    which malloc reads as a process starts, so a fork keeps its preloader's: the huge pages of
    peer.release_memory = thp), started on first use and ended when this process exits."""
    env = os.environ if env is None else env
    key = tuple(env.get(name) for name in ALLOCATOR_VARS)
    with _shared_lock:
        preloader = _shared.get(key)
        if preloader is None or preloader.process.poll() is not None:
            ours = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARS}
            ours |= {
                name: value for name, value in zip(ALLOCATOR_VARS, key, strict=True) if value is not None
            }
            preloader = _shared[key] = Preloader(ours)
            atexit.register(preloader.close)
        return preloader


def fork_peer(
    args: Sequence[str], env: Mapping[str, str], log: Path, netns: str | None = None
) -> Forked | None:
    """Fork `noloco ARGS` (in network namespace `netns`, if given) from the preloader of its
    allocator, or None where it cannot be forked (its environment differs from the preloader's;
    see the module's docstring)."""
    preloader = shared(env)
    return preloader.spawn(args, env, log, netns) if preloader.forks(env) else None


CLONE_NEWNET = 0x40000000


def enter_netns(name: str) -> None:
    """Move this (single-threaded) process into the network namespace `ip netns` calls `name`."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


# ---- the preloader's side ----------------------------------------------------------------------


def serve(control: socket.socket) -> dict | None:
    """Import PRELOADED, then fork a child per request until the launcher closes the control
    socket (returns None). In a child it returns that child's request."""
    for name in PRELOADED:
        importlib.import_module(name)
    # What the imports made is kept for good: moved out of the collector's reach, the children's
    # collections never walk it, and so never touch (and copy) the pages they share with us. A
    # forked peer's collection at exit walked it all: 2.5 s of CPU per peer (2026-12-06).
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sys.stdout.flush()
    sys.stderr.flush()
    control.send(b"ready")
    children: dict[int, socket.socket] = {}
    while True:
        readable = select.select([control, wake_r], [], [])[0]
        if wake_r in readable:
            os.read(wake_r, 4096)
        reap(children)
        if control not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 2)
        if not message:  # the launcher has gone
            return None
        status, log = socket.socket(fileno=fds[0]), fds[1]
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for sock in (control, status, *children.values()):
                sock.close()
            os.close(wake_r)
            os.close(wake_w)
            return {**json.loads(message), "log": log}
        os.close(log)
        children[pid] = status
        status.send(json.dumps({"pid": pid}).encode())


def reap(children: dict[int, socket.socket]) -> None:
    """Send each child that has ended its exit status, on its own socket."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = children.pop(pid, None)
        if sock is not None:
            with suppress(OSError):  # the launcher no longer waits for this peer
                sock.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            sock.close()


def become(request: dict) -> None:
    """In a forked child: take on the request's session, directory, environment, log and
    arguments (sys.argv)."""
    if request.get("netns"):
        enter_netns(request["netns"])
    # What ps, top and /proc/PID/cmdline show: the command it runs, not the preloader's. First:
    # setproctitle takes the room of the process's original environment, which must be in place.
    setproctitle.setproctitle(shlex.join(command(request["args"])))
    os.setsid()
    os.chdir(request["cwd"])
    log = request["log"]  # the file descriptor of the log the launcher opened
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # the preloader's, cached: gettempdir() reads this TMPDIR instead
    sys.argv = [sys.argv[0], *request["args"]]
    import numpy

    numpy.random.seed()  # unlike `random`, numpy's global generator is not reseeded at a fork


if __name__ == "__main__":
    child = serve(socket.socket(fileno=int(sys.argv[1])))
    if child is None:
        sys.exit(0)
    become(child)
    # As `python -m CLI_MODULE ARGS` runs it (sys.argv is already [.., *ARGS]).
    runpy.run_module(CLI_MODULE, run_name="__main__", alter_sys=True)
