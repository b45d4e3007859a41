"""The one typed config tree: model, data, inner optimiser, outer step, wire format, topology,
peer, network.

Every front end fills this same tree: `noloco sim`, `noloco local` and `noloco join` flags, config
files and `NOLOCO_*` environment variables (see `noloco_swarm.train.layering`). The run's part of it
is the swarm manifest's content: `RunConfig.manifest()` is what peers compare before joining a
run; the `peer` and `network` sections say how one peer runs and are its own business.

Two tiers of keys (`USER_KEYS`): the keys a volunteer or run organiser sets say what to train,
on which data, with whom, where and with what records kept; every other key is experimental: lab
tuning (model shape beyond the preset, microbatches, overlap, transport, deadlines, pacing, memory,
checks) whose defaults were set by measurement (docs/config.md), listed only by `noloco keys --all`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from noloco_swarm.data.config import EMBEDDED, MAX_EMBEDDED_VOCAB, DataConfig
from noloco_swarm.model.presets import SCHEDULES, ModelConfig, get_preset
from noloco_swarm.protocol.clock import StepClock
from noloco_swarm.protocol.config import InnerConfig, OuterConfig, WireConfig
from noloco_swarm.protocol.plan import RunPlan

EVENT_LOOPS = ("uvloop", "asyncio")


RELEASE_MEMORY = ("map", "thp", "trim", "off")  # peer.release_memory


MAX_CPUS = 8192  # Linux's largest CPU count (NR_CPUS); a CPU list names CPUs below it


def parse_cpus(text: str) -> list[int]:
    """The CPUs of a Linux CPU list such as `0-3,8` (peer.cpus), sorted; [] for an empty text;
    ValueError naming the malformed part."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"peer.cpus: {part!r} is not a CPU number or a range like 0-3 (in {text!r})")
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise ValueError(f"peer.cpus: the range {part!r} ends before it starts (in {text!r})")
        if high >= MAX_CPUS:
            raise ValueError(f"peer.cpus: {part!r} names a CPU beyond Linux's {MAX_CPUS} (in {text!r})")
        cpus.update(range(low, high + 1))
    if text.strip() and not cpus:
        raise ValueError(f"peer.cpus: {text!r} names no CPU; leave it empty to run anywhere")
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    """A Linux CPU list for `cpus` (the inverse of parse_cpus): [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class PeerConfig:
    """How one peer runs (not part of the run's identity, so not in the manifest)."""

    run_id: str = ""
    """The run's name; peers of one run share it (`noloco join --run-id`)."""
    stage: int | None = None
    """The stage this peer hosts; None: the stage with the fewest replicas (`--stage auto`)."""
    metrics: str | None = None
    """Append the peer's typed events as JSON lines to this file."""
    metrics_port: int | None = None
    """Serve the peer's Prometheus metrics at http://metrics_host:PORT/metrics (None: no endpoint).
    Under `noloco local` this is the first peer's port, and the others' follow it."""
    metrics_host: str = "0.0.0.0"
    """The address the metrics endpoint listens on (127.0.0.1: this machine only)."""
    metrics_linger: float = 0.0
    """Seconds the metrics endpoint keeps serving after the peer finishes, so that the last scrape
    sees its final values."""
    device: str = "cpu"
    """Where this stage computes (cpu or cuda); tensors cross the network from the CPU."""
    deterministic: bool = False
    """Only deterministic CUDA kernels, so that a GPU swarm reproduces the simulator bit for bit on the
    same GPU (scripts/gpu_check.sh), more slowly. No effect with device cpu."""
    step_timeout: float = 120.0
    """Seconds: deadline of one pipeline round trip or one collected batch."""
    exchange_timeout: float = 120.0
    """Seconds: deadline of an outer exchange with one partner (follows step_timeout unless set)."""
    deadline_factor: float = 8.0
    """Adapted deadlines: this many times the longest recent step (exchange), within
    [min_deadline, step_timeout (exchange_timeout)]. 0 keeps them fixed (peer/deadlines.py)."""
    min_deadline: float = 10.0
    """Seconds: the shortest an adapted deadline gets."""
    start_timeout: float = 120.0
    """Seconds: deadline for the manifest and a complete round-0 membership to appear."""
    join_timeout: float = 280.0
    """Seconds: deadline for joining a running swarm (waiting for our round, fetching state)."""
    state_serve_rate: float = 0.0
    """MiB/s at most that this peer sends its state to joiners at, to spare a volunteer's upload
    (0: no cap)."""
    exchange_pacing: float = 0.5
    """With an overlapped outer step (outer.overlap_steps = k > 0), spread the exchange's sending over
    this share (0..1) of the k inner steps, leaving a shared link room for the rows; 0: full speed.
    Give every peer of a swarm the same value (docs/config.md)."""
    exchange_max_mbit: float | None = None
    """Mbit/s at most that this peer sends its outer-exchange tensors at; about 93% of its link's
    upload rate keeps the link's queue empty while both partners send (docs/config.md). auto (the
    default): 97% of the payload rate its partners measured its exchanges arriving at (the first goes
    uncapped; peer/net/uplink.py); 0: no cap. A cap that would outlast half the exchange's deadline
    gives way to one that fits, with a warning."""
    heartbeat_ttl: float = 30.0
    """Seconds an announcement lives in the DHT; re-stored every third of it."""
    daemon_start_timeout: float = 15.0
    """Seconds the libp2p daemon (p2pd) has to start; one that takes longer is started once more
    with four times as long, 15 s at least (a loaded or slow machine), saying so."""
    checkpoint_dir: str | None = None
    """Write this replica's full state here at outer-step boundaries (None: no checkpoints)."""
    checkpoint_every: int = 1
    """Outer steps between checkpoints."""
    checkpoint_keep: int = 3
    """Checkpoints kept; older ones are deleted after each write."""
    release_memory: str = "thp"
    """How the peer process hands freed memory back to the system: thp (blocks of 4 MiB and more
    get mappings of their own, returned when freed, and malloc works on transparent huge pages with
    one arena and trims its heap at every boundary: glibc's tunables, so `noloco join` starts itself
    again with them; where huge pages do not work it is map), map (blocks of 1.125 MiB and more
    get mappings of their own: the leanest, and slower), trim (malloc_trim after every inner step)
    or off (glibc's own: fast, and keeps what it frees)."""
    event_loop: str = "uvloop"
    """The peer's asyncio event loop: uvloop (libuv-based, the default) or asyncio (the standard one)."""
    cpus: str = ""
    """The CPUs this peer process and its libp2p daemon run on, as a Linux CPU list such as 0-3,8
    (empty: anywhere). `noloco local` gives each of its peers a share itself (--no-pin: none)."""
    ticket: str | None = None
    """Join ticket file for a closed run (from its organiser's `noloco ticket`; ~ is expanded)."""

    def __post_init__(self) -> None:
        if self.stage is not None and self.stage < 0:
            raise ValueError(f"peer.stage must be >= 0 or auto, got {self.stage}")
        if self.release_memory not in RELEASE_MEMORY:
            raise ValueError(
                f"peer.release_memory must be one of {', '.join(RELEASE_MEMORY)}, got {self.release_memory!r}"
            )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"peer.device must be cpu or cuda, got {self.device!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"peer.metrics_port must be a TCP port 0..65535, got {self.metrics_port}")
        if not self.metrics_linger >= 0:
            raise ValueError(f"peer.metrics_linger must be >= 0 seconds, got {self.metrics_linger}")
        if self.checkpoint_every < 1 or self.checkpoint_keep < 1:
            raise ValueError("peer.checkpoint_every and peer.checkpoint_keep must be >= 1")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"peer.event_loop must be uvloop or asyncio, got {self.event_loop!r}")
        parse_cpus(self.cpus)  # a malformed list is refused here, before any peer starts
        for name, unit in (("state_serve_rate", "MiB/s"), ("exchange_max_mbit", "Mbit/s")):  # caps
            value = getattr(self, name)
            if value is not None and not 0 <= value < float("inf"):
                raise ValueError(f"peer.{name} must be >= 0 {unit} (0: no cap), got {value}")
        if not 0 <= self.exchange_pacing <= 1:
            raise ValueError(
                f"peer.exchange_pacing must be within 0..1 of the overlap window (0: off), got {self.exchange_pacing}"
            )
        if self.ticket:
            object.__setattr__(self, "ticket", os.path.expanduser(self.ticket))
        if not 0 <= self.deadline_factor < float("inf"):
            raise ValueError(
                f"peer.deadline_factor must be >= 0 (0: fixed deadlines), got {self.deadline_factor}"
            )
        names = (
            "step_timeout",
            "exchange_timeout",
            "start_timeout",
            "join_timeout",
            "heartbeat_ttl",
            "min_deadline",
            "daemon_start_timeout",
        )
        for name in names:
            if not getattr(self, name) > 0:
                raise ValueError(f"peer.{name} must be > 0 seconds, got {getattr(self, name)}")


@dataclass(frozen=True)
class NetworkConfig:
    """How a peer listens and is reached; maps one to one onto hivemind's P2P options."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of any live peers of the swarm (the bootstrap node prints one), or swarm files
    that list them (`noloco dht --swarm-file`; train/layering.py, SwarmFile)."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Addresses to listen on; a fixed port (e.g. /ip4/0.0.0.0/tcp/31337) helps port forwarding."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses to announce instead of the listen ones (your public IP behind a forwarded port)."""
    identity_path: str | None = None
    """Private key file; keeps the peer id across restarts (created if missing; ~ is expanded)."""
    use_relay: bool = True
    """Let libp2p circuit relays carry our traffic when direct connections fail."""
    use_auto_relay: bool = False
    """Look for relays automatically and announce relayed addresses (for peers behind NAT)."""
    client_mode: bool = False
    """Do not accept incoming DHT requests (peers that cannot be reached at all)."""

    def __post_init__(self) -> None:
        if not self.host_maddrs:
            raise ValueError("network.host_maddrs needs at least one address to listen on")
        if self.identity_path:
            object.__setattr__(self, "identity_path", os.path.expanduser(self.identity_path))

    def p2p_kwargs(self) -> dict[str, object]:
        """hivemind's P2P/DHT keyword arguments for these settings."""
        kwargs: dict[str, object] = {
            "host_maddrs": list(self.host_maddrs),
            "use_relay": self.use_relay,
            "use_auto_relay": self.use_auto_relay,
        }
        if self.announce_maddrs:
            kwargs["announce_maddrs"] = list(self.announce_maddrs)
        if self.identity_path:
            kwargs["identity_path"] = self.identity_path
        return kwargs


# Sections that say how one peer runs; every other key is the run's and goes into its manifest.
LOCAL_SECTIONS = ("peer", "network")

# The keys a volunteer or run organiser sets (`noloco keys`); every other key is experimental
# (`noloco keys --all`). At most 40 (tests/sim/test_config_keys.py).
USER_KEYS = frozenset(
    """
    preset method num_stages num_replicas stage_replicas seed authority description
    model.vocab_size model.subspace_rank
    data.source data.dataset data.tokenizer data.data_files data.val_data_files
    inner.batch_size inner.lr inner.min_lr inner.warmup_steps inner.total_steps
    outer.inner_steps outer.group_size outer.outer_momentum outer.outer_lr wire.activations
    peer.run_id peer.stage peer.device peer.metrics peer.metrics_port peer.state_serve_rate
    peer.checkpoint_dir peer.checkpoint_every peer.checkpoint_keep peer.ticket
    network.initial_peers network.host_maddrs network.announce_maddrs network.identity_path
    network.use_auto_relay
    """.split()  # noqa: SIM905 - a table, one topic a line
)


def experimental(key: str) -> bool:
    """Whether `key` is a lab key, listed only by `noloco keys --all`."""
    return key not in USER_KEYS


# Keys that were removed, and the key that replaced each: a config file or --set that still names
# one is refused with its replacement (layering.field_type). The model.* schedule keys shadowed
# inner.*, which alone set the schedule now (a preset's defaults: model/presets.py SCHEDULES).
REMOVED_KEYS = {f"model.{name}": f"inner.{name}" for name in ("lr", "min_lr", "warmup_steps", "total_steps")}


def removed_key(key: str) -> str:
    """The refusal of a removed key, naming the key to use instead."""
    return f"config key {key!r} was removed; use {REMOVED_KEYS[key]!r} instead (it sets the same value)"


# Who runs a config: the in-process simulator (`noloco sim`, `noloco local --in-process`), one real
# peer (`noloco join`), or `noloco local`, which starts real peers and names their run id, stages, CPUs,
# metrics files and loopback addresses itself.
Runner = Literal["simulator", "peer", "local"]
LOCAL_OWNED = ("peer.run_id", "peer.stage", "peer.metrics", "peer.ticket", "peer.cpus")


@dataclass(frozen=True)
class RunConfig:
    """A whole run. Replicas of one stage share every field; peers of one run share the tree."""

    model: ModelConfig = field(default_factory=lambda: get_preset("tiny"))
    """Model shape (preset plus overrides); `vocab_size` must match the tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and window length; `data.seq_len` must equal `model.seq_len`."""
    inner: InnerConfig = field(default_factory=InnerConfig)
    """Inner optimiser and schedule."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """Outer step: method, H, group size, alpha, beta, gamma."""
    wire: WireConfig = field(default_factory=WireConfig)
    """How activations and gradients cross between stages (fp32, bf16, int8, subspace)."""
    num_stages: int = 2
    """P: pipeline stages the model is split into."""
    num_replicas: int = 2
    """D: replicas of every stage (the simulator's N), unless stage_replicas says otherwise."""
    stage_replicas: tuple[int, ...] = ()
    """Replicas per stage when they differ (e.g. 3,2); empty: num_replicas for every stage."""
    seed: int = 0
    """Run seed: initial weights of every replica and the data order."""
    eval_every: int = 50
    """Inner steps between validation passes (0: only at the end)."""
    eval_windows: int = 64
    """Validation windows per evaluation (the same ones every time)."""
    description: str = ""
    """One line that says what the run trains and for whom; `noloco runs` shows it (at most 120
    characters)."""
    authority: str = ""
    """A closed run's authority: its RSA public key (ssh-rsa ..., from `noloco authority`); only
    peers with a join ticket it signed (`noloco ticket`) may serve. Empty: an open run."""
    peer: PeerConfig = field(default_factory=PeerConfig)
    """How one peer runs (`noloco join`); not part of the manifest."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """How one peer listens and is reached; not part of the manifest."""

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_replicas < 1:
            raise ValueError(
                f"need at least one stage and one replica, got P={self.num_stages}, D={self.num_replicas}"
            )
        if self.num_stages > self.model.num_layers:
            raise ValueError(
                f"{self.num_stages} stages but the model has {self.model.num_layers} layers; lower --stages"
            )
        if self.data.seq_len != self.model.seq_len:
            raise ValueError(
                f"data.seq_len {self.data.seq_len} != model.seq_len {self.model.seq_len}; set them equal"
            )
        if self.wire.activations == "subspace" and not self.model.subspace_rank:
            raise ValueError(
                "wire.activations=subspace sends k coefficients per token of a model constrained to a "
                "rank-k subspace: set model.subspace_rank=k (e.g. 16), or choose fp32, bf16 or int8"
            )
        if self.eval_every < 0 or self.eval_windows < 1:
            raise ValueError("eval_every must be >= 0 and eval_windows >= 1")
        if len(self.description) > 120 or not self.description.isprintable():
            raise ValueError(
                f"description must be one line of at most 120 printable characters, got {self.description!r}"
            )
        if self.authority and not self.authority.startswith("ssh-rsa "):
            raise ValueError(
                "authority must be an RSA public key (ssh-rsa ..., from `noloco authority`) or empty"
            )
        if self.stage_replicas and (
            len(self.stage_replicas) != self.num_stages or min(self.stage_replicas) < 1
        ):
            raise ValueError(
                f"stage_replicas {list(self.stage_replicas)} must give one count >= 1 for each of the "
                f"{self.num_stages} stages (or be empty)"
            )

    @property
    def replica_counts(self) -> tuple[int, ...]:
        """Replicas of every stage at the start of the run."""
        return self.stage_replicas or (self.num_replicas,) * self.num_stages

    @property
    def group_draw_seed(self) -> int | None:
        """The seed of the NoLoCo group draw (protocol.gossip): None, the official step-only draw,
        unless `outer.seeded_groups` is on, then the run seed."""
        return self.seed if self.outer.seeded_groups else None

    def run_plan(self) -> RunPlan:
        """The run's rules (clock, step plans, outer plans): the one place they are read from the
        config, for the simulator and the peer alike."""
        inner, o = self.inner, self.outer
        return RunPlan(
            StepClock(o.inner_steps, inner.batch_size, inner.total_steps),
            random_routing=o.random_routing,
            microbatches=inner.microbatches,
            sizes=inner.microbatch_sizes,
            method=o.method,
            group_size=o.group_size,
            draw_seed=self.group_draw_seed,
            diloco_variant=o.diloco_variant,
        )

    @classmethod
    def create(
        cls,
        preset: str = "tiny",
        method: str = "noloco",
        *,
        model: dict[str, Any] | None = None,
        data: dict[str, Any] | None = None,
        inner: dict[str, Any] | None = None,
        outer: dict[str, Any] | None = None,
        wire: dict[str, Any] | None = None,
        peer: dict[str, Any] | None = None,
        network: dict[str, Any] | None = None,
        **top: Any,
    ) -> RunConfig:
        """A config from a preset and a method's paper defaults, with per-section overrides.

        The inner schedule defaults to the preset's (lr, min_lr, warm-up, total steps) and the
        data window to the model's sequence length, so one override changes both ends.
        """
        for name in model or {}:
            if f"model.{name}" in REMOVED_KEYS:
                raise ValueError(removed_key(f"model.{name}"))
        model_cfg = get_preset(preset, **(model or {}))
        inner_defaults = SCHEDULES[preset]
        fields = {"seq_len": model_cfg.seq_len, "vocab_size": model_cfg.vocab_size, **(data or {})}
        if fields.get("tokenizer", EMBEDDED) == EMBEDDED and fields["vocab_size"] > MAX_EMBEDDED_VOCAB:
            raise ValueError(
                f"the {model_cfg.name} preset's vocabulary ({model_cfg.vocab_size:,} tokens) is a Llama "
                f"tokenizer's, and the embedded corpus's tokenizer makes at most {MAX_EMBEDDED_VOCAB:,}: "
                "train it on the embedded corpus with --set model.vocab_size=4096, or give a tokenizer "
                "of that size with --set data.tokenizer=NAME_OR_PATH"
            )
        data_cfg = DataConfig(**fields)
        return cls(
            model=model_cfg,
            data=data_cfg,
            inner=InnerConfig(**{**inner_defaults, **(inner or {})}),
            outer=OuterConfig.for_method(method, **(outer or {})),
            wire=WireConfig(**(wire or {})),
            peer=PeerConfig(**(peer or {})),
            network=NetworkConfig(**(network or {})),
            **top,
        )

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value for every leaf, in a stable order (the manifest and result files)."""
        out: dict[str, Any] = {}

        def walk(prefix: str, obj: Any) -> None:
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if dataclasses.is_dataclass(value):
                    walk(f"{prefix}{f.name}.", value)
                else:
                    out[f"{prefix}{f.name}"] = list(value) if isinstance(value, tuple) else value

        walk("", self)
        return out

    def manifest(self) -> dict[str, Any]:
        """The run's identity: every key but the peer's own sections. Peers of a run share it."""
        return {k: v for k, v in self.flat().items() if k.split(".", 1)[0] not in LOCAL_SECTIONS}

    def refusals(self, runner: Runner, explicit: Mapping[str, str] | None = None) -> list[str]:
        """Settings `runner` cannot honour, each with what to change; empty when it can run this.

        `explicit` maps the keys a source set (config file, NOLOCO_SET, --set, a flag) to that
        source: a default that a runner does not use is not the user's setting and is not refused.
        (`noloco join` and `noloco local` make eval_every's default 0, so that what they print is
        what their peers do.)
        """
        explicit = explicit or {}
        out: list[str] = []

        def given(key: str) -> str:
            return f" (set by {explicit[key]})" if key in explicit else ""

        # Tickets admit peers of their own (noloco join); the simulator and noloco local have none.
        if self.authority and runner != "peer":
            out.append(
                f"authority{given('authority')}: a closed run admits peers by their tickets, and "
                f"{'the simulator' if runner == 'simulator' else 'noloco local'} runs its own; drop it "
                "(closed runs are for noloco join)"
            )
        if runner == "simulator":  # the simulator runs every other setting, uneven stages included
            return out
        # Real peers average only through outer steps; per-step all-reduce exists in the simulator.
        if self.outer.method == "allreduce":
            out.append(
                f"method allreduce{given('method')} runs only in the simulator: use noloco sim or "
                "noloco local --in-process"
            )
        # Peers evaluate once, after the last step (peer/evaluation.py); a period would be ignored.
        if "eval_every" in explicit and self.eval_every != 0:
            out.append(
                f"eval_every={self.eval_every}{given('eval_every')}: peers evaluate only at the end of "
                "training; set eval_every=0, or use noloco sim / noloco local --in-process for curves"
            )
        if runner == "peer":
            if self.peer.stage is not None and self.peer.stage >= self.num_stages:
                out.append(
                    f"peer.stage {self.peer.stage}{given('peer.stage')} is outside 0..{self.num_stages - 1} "
                    f"for a run of {self.num_stages} stages; use --stage auto or a smaller stage"
                )
            # The peer's DHT node serves requests like any member's (peer/launch.py).
            if self.network.client_mode:
                out.append(
                    f"network.client_mode{given('network.client_mode')}: a peer that hosts a stage runs "
                    "a full DHT node; drop it (behind NAT, set network.use_auto_relay=true instead)"
                )
        if runner == "local":
            ours, unset = self.flat(), RunConfig.create().flat()
            for key in sorted(explicit):
                owned = key in LOCAL_OWNED or key.startswith("network.")
                if owned and ours[key] != unset[key]:  # a file may restate a default; that asks nothing
                    out.append(
                        f"{key}{given(key)}: noloco local names its peers' run id, stages, CPUs, metrics "
                        "files and loopback addresses itself; drop it, or run peers with noloco join"
                    )
        return out
