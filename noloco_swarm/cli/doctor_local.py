"""`noloco doctor`'s checks of this machine: the ports, the config, memory, installed versions.

Each check does the real thing where it can (binds the port) and estimates where it cannot
(memory: train/memory.py against what is free); its network checks are in doctor_net.py.
"""

from __future__ import annotations

import socket
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from noloco_swarm.train import memory
from noloco_swarm.train.config import RunConfig

SETUP = "run bash scripts/setup.sh (or pip install -c constraints.txt -e .) in your noloco-swarm checkout"


@dataclass(frozen=True)
class Check:
    """One preflight check's outcome; `fix` says in one line what to do when it failed."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


# ------------------------------------------------------------------------ ports


def port_check(host: str, port: int, what: str, fix: str) -> Check:
    """Bind `host:port` as the daemon would (SO_REUSEADDR, as Go sets it): held by another
    listening socket, the bind fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as e:
            return Check(f"port {port}", False, f"{what} {host}:{port} is not free: {e.strerror}", fix)
    return Check(f"port {port}", True, f"{what} {host}:{port} is free")


def listen_ports(maddrs: Sequence[str]) -> list[tuple[str, int]]:
    """(host, port) of every listen multiaddr with a fixed TCP port (port 0 is picked at start)."""
    out = []
    for maddr in maddrs:
        parts = maddr.strip("/").split("/")
        fixed = len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp"
        if fixed and parts[3].isdigit() and int(parts[3]) != 0:
            out.append((parts[1], int(parts[3])))
    return out


# ------------------------------------------------------------------------ memory


def free_memory(device: str) -> tuple[int, str]:
    """Bytes free for a new peer on `device`, and where the figure comes from."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return 0, "no CUDA device visible to torch"
        free, _ = torch.cuda.mem_get_info()
        return free, f"free on {torch.cuda.get_device_name()}"
    meminfo = dict(
        (line.split(":")[0], int(line.split()[1]) * 1024)
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.split()[-1] == "kB"
    )
    free, source = meminfo.get("MemAvailable", 0), "MemAvailable"
    cgroup = Path("/sys/fs/cgroup")
    try:  # a container's cgroup v2 limit may be tighter than the machine's free memory
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((cgroup / "memory.current").read_text())
            if room < free:
                free, source = room, "room under this cgroup's memory.max"
    except (OSError, ValueError):
        pass
    return free, source


def memory_check(cfg: RunConfig, stage: int | None, limit_gib: float | None) -> Check:
    need = memory.estimate(cfg, stage) if stage is not None else memory.largest(cfg)
    free, source = free_memory(cfg.peer.device)
    name = f"memory ({cfg.peer.device})"
    if cfg.peer.device == "cuda" and free == 0:
        return Check(
            name, False, source, "use --device cpu, or install torch's CUDA build on a machine with a GPU"
        )
    if limit_gib is not None and limit_gib * memory.GIB < free:
        free, source = int(limit_gib * memory.GIB), "--memory-limit"
    detail = f"needs about {need.describe()}; {free / memory.GIB:.2f} GiB {source}"
    if need.total <= free:
        return Check(name, True, detail)
    return Check(
        name,
        False,
        detail,
        "lower inner.batch_size (--set inner.batch_size=N), run more stages (--stages), a smaller "
        "--preset, or a device with more memory",
    )


# ------------------------------------------------------------------------ versions


def declared_requirements() -> list[str]:
    """The package's dependencies: from the source checkout's pyproject.toml if this runs from one
    (the editable install's metadata may be older), else from the installed metadata."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.exists():
        return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])
    return [r for r in metadata.requires("noloco-swarm") or [] if "extra ==" not in r]


def pinned() -> dict[str, str]:
    """constraints.txt's exact pins (name -> version), where the checkout has one."""
    path = Path(__file__).resolve().parents[2] / "constraints.txt"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            out[_canonical(name)] = version.strip()
    return out


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def versions_check() -> Check:
    from packaging.requirements import Requirement

    pins, problems = pinned(), []
    for text in declared_requirements():
        req = Requirement(text)
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req.name} is not installed")
            continue
        if installed.split("+")[0] not in req.specifier and installed not in req.specifier:
            problems.append(f"{req.name} {installed} is outside {req.specifier}")
        elif (pin := pins.get(_canonical(req.name))) is not None and installed.split("+")[0] != pin:
            problems.append(f"{req.name} {installed} is not the tested {pin} (constraints.txt)")
    if problems:
        return Check("versions", False, "; ".join(problems), SETUP)
    return Check("versions", True, f"{len(declared_requirements())} dependencies match pyproject/constraints")


def config_check(refusals: Sequence[str]) -> Check:
    """What `noloco join` would refuse in this config before starting (RunConfig.refusals)."""
    if not refusals:
        return Check("config", True, "noloco join can run this config")
    more = f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else ""
    return Check(
        "config",
        False,
        refusals[0] + more,
        "noloco join refuses this config before it starts: change what the message names (--print-config shows its source)",
    )
