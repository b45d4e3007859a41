"""A peer's processes die with it: the kernel's parent-death signal, set in one place.

hivemind starts p2pd (and its DHT runs in a child process) without tying their lives to ours, so a
SIGKILLed peer would leave them running. Two uses of PR_SET_PDEATHSIG(SIGTERM):
  - `die_with_parent()`: this process gets SIGTERM when the process that started it dies
    (`noloco local` starts its peers so);
  - `children_die_with_us()`: subprocesses started through asyncio inside the block get it too,
    so the kernel signals p2pd when the thread that started it (our event loop's) exits.
And one for the DHT's forked process, `DHT` below: the kernel's signal follows the *thread* that
forked (a worker thread here, which may end first), so that child watches its parent instead and
exits within a second of being orphaned. An orphaned peer (`orphaned()`) stops at once, and
`exit_within` makes sure it is gone, with its children, seconds later however its shutdown goes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import ctypes
import faulthandler
import functools
import glob
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hivemind
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError

if TYPE_CHECKING:
    from noloco_swarm.peer.net.identity import Identity

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("children_die_with_us", default=False)


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A function that asks the kernel to send its caller `sig` when the thread that started the
    caller exits (Linux; elsewhere it does nothing). Called in a child before exec (a
    `preexec_fn`), it binds programs that do not do so themselves; it survives exec. libc is
    looked up here, in the parent: a forked child of a threaded process must not load libraries."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    return functools.partial(ctypes.CDLL(None, use_errno=True).prctl, _PR_SET_PDEATHSIG, int(sig))


_PARENT: list[int] = []  # the parent whose death ends us, once die_with_parent() was called


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux; a no-op elsewhere).

    The SIGTERM then means "stop now", not "leave at the next boundary": see `orphaned()`."""
    if sys.platform.startswith("linux"):
        _PARENT[:] = [os.getppid()]
        parent_death_signal()()


def orphaned() -> bool:
    """True if this process asked to die with its parent and that parent is gone: whoever
    started it (`noloco local`) will not collect its results, so it stops at once."""
    return bool(_PARENT) and os.getppid() != _PARENT[0]


ORPHAN_GRACE = 10.0  # seconds an orphaned peer may take to shut down cleanly before it is cut short


def exit_within(grace: float = ORPHAN_GRACE) -> None:
    """Make sure this process is gone `grace` seconds from now, however its shutdown goes: a
    daemon thread then writes every thread's stack to stderr (why it did not stop by itself),
    ends our child processes (p2pd) and exits with status 1. An orphan's clean shutdown waits on
    peers that are dying with it (gone reports to their DHT nodes, calls in flight): nobody
    waits for its result, and its launcher's killer expects it gone in seconds."""

    def cut_short() -> None:
        time.sleep(grace)
        sys.stderr.write(f"shutdown took over {grace:g} s; exiting now. Threads:\n")
        faulthandler.dump_traceback(all_threads=True)
        end_children()
        os._exit(1)

    threading.Thread(target=cut_short, name="exit-within", daemon=True).start()


def end_children(grace: float = 1.0) -> None:
    """SIGTERM this process's children (p2pd), SIGKILL those still running `grace` seconds later."""
    children = _children()
    _send(children, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(map(_running, children)):
        time.sleep(0.05)
    _send([pid for pid in children if _running(pid)], signal.SIGKILL)


def _send(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _children() -> list[int]:
    """Our child processes' pids, from every thread's /proc children list (Linux; else none)."""
    pids = []
    for task in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(OSError):
            pids += [int(pid) for pid in Path(task).read_text().split()]
    return pids


def _running(pid: int) -> bool:
    """Is `pid` a running (not a zombie) process? Our unreaped children stay zombies."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# hivemind puts p2pd's and its client's unix sockets in /tmp and removes them only on a clean
# shutdown. Ours go in a folder per process, which the next peer or launcher removes once the
# process is gone: a SIGKILLed peer leaves nothing behind for long.
SOCKETS = Path("/tmp")  # hivemind's own place: short paths (a unix socket's is at most 107 bytes)
SOCKETS_PREFIX = "noloco-p2p-"


class _P2P(P2P):
    """hivemind's P2P, its sockets in this process's folder (`sockets_folder`)."""


# The daemon's start-up deadline (peer.daemon_start_timeout), and how much longer the one retry waits.
DAEMON_START_TIMEOUT = 15.0
RETRY_FACTOR = 4.0


async def start_p2p(*, startup_timeout: float = DAEMON_START_TIMEOUT, **options: Any) -> P2P:
    """`hivemind.P2P.create(**options)`: a p2pd that dies with this process (children_die_with_us),
    its sockets in this process's own folder, after sweeping the folders of processes gone. A
    daemon that does not start within `startup_timeout` seconds is started once more with
    RETRY_FACTOR times as long (DAEMON_START_TIMEOUT at least), with a warning; P2PDaemonError
    saying what to do if that fails too."""
    _P2P._UNIX_SOCKET_PREFIX = f"/unix{sockets_folder()}/hivemind-"
    waits = (startup_timeout, max(startup_timeout * RETRY_FACTOR, DAEMON_START_TIMEOUT))
    for attempt, wait in enumerate(waits):
        try:
            with children_die_with_us():
                return await _P2P.create(startup_timeout=wait, **options)
        except P2PDaemonError as e:
            if "failed to start in" not in str(e):  # the daemon's own error: retrying would not help
                raise
            if attempt + 1 == len(waits):
                raise P2PDaemonError(
                    f"the libp2p daemon (p2pd) did not start within {waits[0]:.3g} s, nor within "
                    f"{wait:.3g} s when tried again: is this machine overloaded? Run `noloco doctor`, "
                    "or give it longer with --set peer.daemon_start_timeout=SECONDS"
                ) from e
            logger.warning(
                "the libp2p daemon did not start within %.3g s (peer.daemon_start_timeout); starting "
                "it again with %.3g s",
                wait,
                waits[attempt + 1],
            )
    raise AssertionError("unreachable")


def sockets_folder() -> Path:
    """This process's folder for its daemons' sockets (made now), the dead's swept first."""
    sweep_sockets()
    folder = SOCKETS / f"{SOCKETS_PREFIX}{os.getpid()}"
    if not folder.is_dir():
        folder.mkdir(mode=0o700, exist_ok=True)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # a clean exit leaves nothing
    return folder


def sweep_sockets() -> list[Path]:
    """Remove the socket folders of processes that no longer run; the folders removed. (Another
    user's folder stays: we may not remove it.)"""
    swept = []
    for folder in SOCKETS.glob(SOCKETS_PREFIX + "*"):
        pid = folder.name.removeprefix(SOCKETS_PREFIX)
        if pid.isdigit() and not _running(int(pid)) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                swept.append(folder)
    return swept


@contextlib.contextmanager
def children_die_with_us() -> Iterator[None]:
    """Within the block, asyncio subprocesses get SIGTERM when their starting thread exits."""
    _install_hook()
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _install_hook() -> None:
    original = asyncio.subprocess.create_subprocess_exec
    if not sys.platform.startswith("linux") or getattr(original, "_noloco_hook", False):
        return
    in_child = parent_death_signal()

    async def create_subprocess_exec(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        if _ACTIVE.get() and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = in_child
        return await original(*args, **kwargs)

    create_subprocess_exec._noloco_hook = True  # type: ignore[attr-defined]
    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec  # type: ignore[assignment]


ORPHAN_POLL = 1.0  # seconds between a child's checks that its parent still lives


def exit_when_orphaned(period: float = ORPHAN_POLL) -> None:
    """Exit this process (at once, no cleanup) as soon as its parent has died: it was reparented."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        os._exit(1)

    threading.Thread(target=watch, name="exit-when-orphaned", daemon=True).start()


class DHT(hivemind.DHT):
    """hivemind's DHT, whose forked process ends with the process that started it, however it ends.

    `identity` is the key its records are signed with, where the starter set one."""

    identity: Identity | None = None

    def run(self) -> None:  # runs in the forked child
        exit_when_orphaned()
        # Its daemon's sockets in the child's own folder: a group SIGTERM kills it without cleanup.
        # (A forked child ends with os._exit: no atexit handler removes the folder.)
        folder = sockets_folder()
        P2P._UNIX_SOCKET_PREFIX = f"/unix{folder}/hivemind-"
        try:
            super().run()
        finally:
            shutil.rmtree(folder, ignore_errors=True)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MAP_THRESHOLD = 1152 * 1024  # just above the transport's 1 MiB parts, which stay in the heap
THP_MAP_THRESHOLD = 4 << 20  # peer.release_memory = thp: smaller blocks stay in the heap
# peer.release_memory = thp: glibc's tunable that makes malloc ask for transparent huge pages on
# its heap and its mappings, so a block mapped again costs 2 MiB faults, not 4 KiB ones
# (bench/allocator.py). glibc reads its tunables once, as a process starts, so `noloco join` starts
# itself again with it, once (RESTARTED), and a launcher forks such peers from a preloader that
# started with it (harness/preload.py). Whether this process started with it is seen on import: a
# peer forked from the preloader has the preloader's malloc, whatever its os.environ says later.
HUGE_PAGES = "glibc.malloc.hugetlb=1"
# With thp, one arena for every thread: blocks under the mapping threshold stay in the heap, and a
# thread's own arena (the exchange's, the transport's) keeps what it freed out of the training
# thread's reach: 0.13x of the state less at the peak, at the same step time (bench/peer_memory.py).
ONE_ARENA = "glibc.malloc.arena_max=1"
STARTED_WITH_HUGE_PAGES = HUGE_PAGES in os.environ.get("GLIBC_TUNABLES", "").split(":")
RESTARTED = "NOLOCO_ALLOCATOR_RESTARTED"


def allocator_env(mode: str, env: dict[str, str]) -> dict[str, str]:
    """`env` with what a process of `mode` (peer.release_memory) must start with: for thp, glibc's
    huge-page tunable in GLIBC_TUNABLES, and one arena unless `env` chose a number; `env` itself
    otherwise."""
    if mode != "thp":
        return env
    tunables = [
        t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")
    ]
    arenas = [] if any(t.startswith("glibc.malloc.arena_max=") for t in tunables) else [ONE_ARENA]
    return env | {"GLIBC_TUNABLES": ":".join([*tunables, *arenas, HUGE_PAGES])}


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_unavailable() -> str | None:
    """Why glibc's huge-page tunable would do nothing here (None: it works): it needs glibc 2.35
    or later and a kernel whose THP mode is `madvise` or `always`."""
    libc = _glibc()
    if libc is None:
        return "this C library is not glibc"
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    version = libc.gnu_get_libc_version().decode()
    if tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
        return f"glibc {version} has no glibc.malloc.hugetlb tunable (2.35 and later do)"
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return "this kernel has no transparent huge pages"
    return "the kernel's transparent huge pages are off ([never])" if "[never]" in mode else None


def huge_pages_off() -> str | None:
    """Why this process's malloc is not on huge pages (None: it is): they do not work here, or
    the process did not start with HUGE_PAGES."""
    return huge_pages_unavailable() or (None if STARTED_WITH_HUGE_PAGES else "GLIBC_TUNABLES lacks it")


def needs_restart_for(mode: str) -> bool:
    """Whether this process must start again to run `mode` (peer.release_memory): thp needs the
    tunable from the start, where it works; one restart at most."""
    return (
        mode == "thp"
        and not STARTED_WITH_HUGE_PAGES
        and RESTARTED not in os.environ
        and huge_pages_unavailable() is None
    )


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, loaded once (trim_heap runs after every inner step); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018  (musl and others lack them: nothing to tune)
    except (OSError, AttributeError):
        return None
    return libc


def release_memory(mode: str) -> bool:
    """Set up how this process hands freed memory back (peer.release_memory): `map` gives blocks
    of MAP_THRESHOLD and more their own mapping, `thp` those of THP_MAP_THRESHOLD and more, on huge
    pages, if the process started with HUGE_PAGES (else it is `map`: without huge pages every
    mapped block costs 4 KiB faults, and only the lean setting is worth them). False where there
    is nothing to set."""
    libc = _glibc()
    if mode == "thp" and huge_pages_off() is not None:
        mode = "map"
    threshold = {"map": MAP_THRESHOLD, "thp": THP_MAP_THRESHOLD}.get(mode)
    if threshold is None or libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))


def trim_heap() -> None:
    """Hand the heap's free pages back to the system now (peer.release_memory = trim)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def pin_to_cpus(cpus: list[int]) -> None:
    """Run this process, every thread it has and every thread and process it starts later (torch's
    pool, p2pd) on `cpus` only (peer.cpus; Linux). ValueError if the system has no such call or
    `cpus` names a CPU this process may not use."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"peer.cpus needs Linux's CPU affinity, which {sys.platform} lacks: leave it empty")
    allowed = os.sched_getaffinity(0)
    if missing := sorted(set(cpus) - allowed):
        raise ValueError(
            f"peer.cpus names CPUs {missing} that this process may not run on (it may use "
            f"{sorted(allowed)}); choose among those"
        )
    # Threads that exist already keep their own affinity unless set one by one; new ones inherit
    # their creator's, and child processes (p2pd, started later) their parent's.
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)
