"""Fuzz targets of the pure decoders: the message codec (per message class), tensors, the wire
formats, the chunk plan a joiner runs on donors' manifests, checkpoints, config text, events."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import torch
from hypothesis import strategies as st

from noloco_swarm.peer import checkpoint, events
from noloco_swarm.protocol import chunks, codec, records, rpc, subspace, wire
from noloco_swarm.train import layering
from tests.fuzz.target import INTS, VALUES, Target, mutated_bytes

ACT = codec.TensorMeta((2, 16, 32), "float32")
TOK = codec.TensorMeta((2, 16), "int64")
Q8 = codec.TensorMeta((2, 16, 32), "int8")
SCALE = codec.TensorMeta((2, 16), "float32")
SUB, WINDOWS = codec.TensorMeta((2, 16, 8), "bfloat16"), codec.TensorMeta((2, 17), "int32")
HASH = "ab" * 32

# One valid instance of every message class (two where an optional part changes the checks).
EXAMPLES: list[codec.Message] = [
    records.RunManifest.create("run-1", {"model.preset": "tiny", "outer.inner_steps": 50}),
    records.PeerAnnouncement("run-1", "12D3KooWabc", 1, 4, ("/ip4/127.0.0.1/tcp/4001",), "cuda", 9),
    records.PeerAnnouncement("run-1", "12D3KooWabc", 1, 4, (), "cpu", 9, b"\x83\xa1v\x02"),
    records.GoneReport("run-1", "12D3KooWabc", "12D3KooWdef", 3),
    records.JoinTicket("run-1", "12D3KooWabc", 1.8e9, b"c2lnbmF0dXJl"),
    records.RunListing("run-1", HASH),
    rpc.ForwardHeader("run-1", 2, 117, 0, 3, (936, 937), ACT, TOK, "v" * 8),
    rpc.ForwardHeader("run-1", 2, 117, 0, 3, (936, 937), Q8, TOK, "", SCALE),
    rpc.ForwardHeader("run-1", 2, 117, 0, 3, (936, 937), SUB, WINDOWS, "v" * 8),
    rpc.BackwardHeader("run-1", 2, 117, 0, 1, (936, 937), ACT, (3.5, 4.25)),
    rpc.BackwardHeader("run-1", 2, 117, 0, 1, (936, 937), Q8, (), SCALE),
    rpc.ExchangeHeader(
        "run-1", 2, 150, 1, 0, ("theta", "phi"), codec.TensorMeta((1000,), "float32"), 1 << 20
    ),
    rpc.StateRequest("run-1", 1, 7),
    rpc.StateManifest("run-1", 1, 7, 70, (("a", "b"), ("c",)), 70, HASH, 9, 4, (HASH,) * 12),
    rpc.ChunkRequest("run-1", 1, 7, HASH, 11),
    rpc.StateChunk("run-1", 1, 7, HASH, 11, codec.TensorMeta((4,), "float32")),
    rpc.StatusRequest("run-1"),
    rpc.Decline("run-1", 2, 150, 1, 2),
    rpc.PeerStatus("run-1", "12D3KooWabc", 0, 71, 7, 1, 7, 9088, 4.5, True, 70),
    rpc.ErrorReply("busy", "try again next round"),
    rpc.Ack("received"),
    rpc.Envelope("rpc_forward", b"\x81\xa1v\x02", (ACT, TOK)),
    rpc.EvalHeader("run-1", 40, 0, 1, 3, ACT, TOK),
    rpc.EvalReply((3.5, 4.0)),
    records.Sealed(b"\x81\xa1v\x0a", b"ssh-rsa AAAA", b"\x01" * 256),
    rpc.PassedRecords("run-1", b"session!", (b"\x81\xa1v\x0a",)),
    rpc.NeighbourhoodRequest("run-1", 1),
    rpc.Neighbourhood(
        "run-1", 1, 7, (("a", "b"), ("c",)), ("a", "c"), (("/ip4/1.2.3.4/tcp/1",), ()), (b"\x81",)
    ),
]
TAGS = sorted({type(e).TAG for e in EXAMPLES})
assert set(TAGS) == set(codec._REGISTRY), "every message class needs an example here"


def body_of(message: codec.Message) -> dict[str, Any]:
    return msgpack.unpackb(codec.encode(message))["b"]


@st.composite
def message_bytes(draw: st.DrawFn, tag: str) -> bytes:
    """Bytes that claim to be a `tag` message: a valid one with a field replaced, dropped or
    added, under the wrong tag or version, or edited byte by byte."""
    base = draw(st.sampled_from([e for e in EXAMPLES if tag == e.TAG]))
    body: dict[str, Any] = body_of(base)
    how = draw(st.sampled_from(["field", "field", "drop", "add", "tag", "version", "bytes", "valid"]))
    if how == "field":
        body[draw(st.sampled_from(sorted(body)))] = draw(VALUES)
    elif how == "drop":
        del body[draw(st.sampled_from(sorted(body)))]
    elif how == "add":
        body[draw(st.text(max_size=8))] = draw(VALUES)
    if how == "bytes":
        return draw(mutated_bytes(codec.encode(base)))
    wrapper = {
        "v": draw(VALUES) if how == "version" else codec.PROTOCOL_VERSION,
        "t": draw(st.sampled_from(TAGS)) if how == "tag" else tag,
        "b": body,
    }
    return msgpack.packb(wrapper, use_bin_type=True)


def check_decode(data: bytes) -> None:
    """decode: a valid message that round-trips, or MessageError."""
    try:
        message = codec.decode(data)
    except codec.MessageError:
        return
    assert isinstance(message, codec.Message)
    assert codec.decode(codec.encode(message), type(message)) == message


def message_target(tag: str) -> Target:
    return Target(
        f"messages.decode[{tag}]",
        message_bytes(tag),
        check_decode,
        "a valid message (re-encodes to itself) or MessageError",
        ci_examples=60,
    )


# -- tensors -------------------------------------------------------------------------------------

SMALL_METAS = st.builds(
    codec.TensorMeta,
    shape=st.lists(st.integers(0, 5), max_size=3).map(tuple),
    dtype=st.sampled_from(sorted(codec._DTYPES)),
)


@st.composite
def tensor_payloads(draw: st.DrawFn) -> tuple[codec.TensorMeta, bytes, bool]:
    meta = draw(SMALL_METAS)
    size = draw(st.one_of(st.just(meta.nbytes), st.integers(0, meta.nbytes + 16)))
    filler = draw(st.sampled_from([b"\x00", b"\xff", b"\x7f\x80\x00\x00", b"\x01\x02"]))
    payload = draw(st.one_of(st.binary(min_size=size, max_size=size), st.just((filler * size)[:size])))
    return meta, payload, draw(st.booleans())


def check_decode_tensor(args: tuple[codec.TensorMeta, bytes, bool]) -> None:
    """decode_tensor: a tensor of the meta's shape and dtype (finite if asked), or MessageError."""
    meta, payload, finite = args
    try:
        tensor = codec.decode_tensor(meta, payload, finite=finite)
    except codec.MessageError:
        return
    assert codec.TensorMeta.of(tensor) == meta
    if finite and tensor.is_floating_point():
        assert bool(torch.isfinite(tensor).all())


WIRE_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.int8,
    torch.float16,
    torch.int64,
    torch.float64,
    torch.bool,
]


@st.composite
def wire_parts(draw: st.DrawFn) -> tuple[list[torch.Tensor], str, tuple[int, ...] | None, bool]:
    """Received wire tensors: random dtypes and shapes, or a valid encoding with its bits edited."""
    fmt = draw(st.sampled_from([*wire.FORMATS, "fp16", ""]))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)))
    if draw(st.booleans()) and fmt in wire.FORMATS:
        x = torch.tensor(draw(st.lists(st.floats(width=32), min_size=1, max_size=1)) * 64).float()
        x = x[: torch.Size(shape).numel()].reshape(shape) if torch.Size(shape).numel() <= 64 else x
        parts = [p.clone() for p in wire.encode(x, fmt)]
        if draw(st.booleans()) and parts[-1].numel():  # flip the bits of one element
            target = parts[draw(st.integers(0, len(parts) - 1))]
            if target.numel():
                raw = target.reshape(-1).view(torch.uint8)
                raw[draw(st.integers(0, raw.numel() - 1))] ^= 1 << draw(st.integers(0, 7))
    else:
        parts = []
        for _ in range(draw(st.integers(0, 3))):
            part_shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
            dtype = draw(st.sampled_from(WIRE_DTYPES))
            nbytes = torch.Size(part_shape).numel() * torch.empty((), dtype=dtype).element_size()
            raw = bytearray(draw(st.binary(min_size=nbytes, max_size=nbytes)))
            parts.append(
                torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(part_shape)
                if nbytes
                else torch.empty(part_shape, dtype=dtype)
            )
    expected = draw(st.one_of(st.none(), st.just(shape)))
    return parts, fmt, expected, draw(st.booleans())


def check_wire_decode(args: tuple[list[torch.Tensor], str, tuple[int, ...] | None, bool]) -> None:
    """wire.decode: float32 of the expected shape (finite if checked), MessageError for received
    tensors no encoder sends, ValueError only for a format name that is not one (our own input)."""
    parts, fmt, shape, check_finite = args
    try:
        out = wire.decode(parts, fmt, shape, check_finite=check_finite)
    except codec.MessageError:
        return
    except ValueError:
        assert fmt not in wire.FORMATS, "ValueError for a valid format"
        return
    assert out.dtype == torch.float32
    if shape is not None:
        assert tuple(out.shape) == shape
    if check_finite or fmt == "int8":
        assert bool(torch.isfinite(out).all()), "decoded rows hold NaN or inf"


# A small subspace (d = 32, k = 8, V = 64) for the receiver's side of the subspace format.
SPACE_D, SPACE_K, SPACE_V, SPACE_T = 32, 8, 64, 4
SPACE = subspace.Subspace(
    torch.linalg.qr(torch.randn(SPACE_D, SPACE_K, generator=torch.Generator().manual_seed(0)))[0],
    torch.randn(SPACE_V, SPACE_D, generator=torch.Generator().manual_seed(1)),
)
SPACE_DTYPES = [torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.float16]


@st.composite
def subspace_parts(draw: st.DrawFn) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Received subspace rows and token windows: random dtypes, shapes, ids and bits."""
    rows = draw(st.integers(0, 3))

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        if draw(st.booleans()):  # another shape
            shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
        dtype = draw(st.sampled_from(SPACE_DTYPES))
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = bytearray(draw(st.binary(min_size=nbytes, max_size=nbytes)))
        return (
            torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
            if nbytes
            else torch.empty(shape, dtype=dtype)
        )

    parts = [tensor((rows, SPACE_T, SPACE_K)) for _ in range(draw(st.integers(0, 2)))]
    if draw(st.booleans()):
        windows = torch.tensor(
            draw(
                st.lists(
                    st.integers(-2, SPACE_V + 1), min_size=rows * (SPACE_T + 1), max_size=rows * (SPACE_T + 1)
                )
            ),
            dtype=torch.int32,
        ).reshape(rows, SPACE_T + 1)
    else:
        windows = tensor((rows, SPACE_T + 1))
    return parts, windows


def check_subspace_decode(args: tuple[list[torch.Tensor], torch.Tensor]) -> None:
    """Boundary(subspace): ids_from_wire then decode_rows give float32 (rows, T, d), finite, or a
    MessageError; nothing else, whatever arrives."""
    parts, windows = args
    boundary = wire.Boundary("subspace", SPACE)
    rows = parts[0].shape[0] if parts and parts[0].dim() else 0
    try:
        ids = boundary.ids_from_wire(windows, rows, SPACE_T, SPACE_V)
        out = boundary.decode_rows(parts, ids)
    except codec.MessageError:
        return
    assert out.dtype == torch.float32 and tuple(out.shape) == (rows, SPACE_T, SPACE_D)
    assert bool(torch.isfinite(out).all()), "decoded rows hold NaN or inf"


# -- the chunk plan, run on donors' manifests and their answers -----------------------------------

DIGESTS = ["0" * 64, "1" * 64, "2" * 64]


@st.composite
def chunk_plans(draw: st.DrawFn) -> tuple[dict[str, rpc.StateManifest], list[str], list[tuple[Any, ...]]]:
    """Manifests from 1-3 donors (layouts and hashes that agree or not), then what the donors do."""
    manifests = {}
    for donor in draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True)):
        numel, elements = draw(st.integers(1, 12)), draw(st.integers(1, 6))
        count = len(chunks.layout(numel, elements))
        hashes = tuple(draw(st.lists(st.sampled_from(DIGESTS), min_size=count, max_size=count)))
        manifests[donor] = rpc.StateManifest(
            "run-1", 0, 1, 10, (("a", "b", "c"),), 10, HASH, numel, elements, hashes
        )
    preference = draw(st.permutations([*manifests, "ghost"]))
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["take", "accept", "accept", "fail", "release", "lose"]),
                st.sampled_from([*manifests, "ghost"]),
                st.one_of(st.integers(-2, 40), INTS),
                st.sampled_from([*DIGESTS, "", "zz"]),
                st.booleans(),
            ),
            max_size=40,
        )
    )
    return manifests, preference, ops


def check_chunk_plan(args: tuple[dict[str, rpc.StateManifest], list[str], list[tuple[Any, ...]]]) -> None:
    """ChunkPlan: any sequence of donor answers (any index, any hash) keeps it consistent: what it
    holds matches the target's manifest, and it finishes only with every chunk held."""
    manifests, preference, ops = args
    plan = chunks.ChunkPlan(manifests, preference)
    for op, donor, index, received, fatal in ops:
        if op == "take":
            got = plan.take(donor)
            assert got is None or (0 <= got < len(plan.manifest.chunks) and plan.holds(donor, got))
        elif op == "accept":
            plan.accept(donor, index, received)
        elif op == "fail":
            plan.fail(donor, index, "fuzz", fatal=fatal)
        elif op == "release":
            plan.release(donor, index)
        else:
            plan.lose(donor, "fuzz")
        if plan.failed:
            assert not plan.done and not plan.finished
            continue
        target = plan.manifest.chunks
        assert all(0 <= i < len(target) and target[i] == h for i, h in plan.done.items())
        assert plan.finished == (len(plan.done) == len(target))


# -- checkpoints, config text and event logs (local files, read back after a crash or by hand) ----


@contextmanager
def scratch_file(name: str, data: bytes) -> Iterator[Path]:
    """`data` in a file of its own, removed (with its directory) afterwards."""
    with tempfile.TemporaryDirectory(prefix="noloco-fuzz-") as directory:
        path = Path(directory) / name
        path.write_bytes(data)
        yield path


def checkpoint_dict() -> dict[str, Any]:
    parts = {p: torch.zeros(3) for p in checkpoint.PARTS}
    ckpt = checkpoint.Checkpoint(
        "run-1", HASH, 1, "12D3KooWabc", 20, 2, (("a",), ("b",)), 0, 2, 640, 20, HASH, parts
    )
    return ckpt.to_dict()


def _saved(obj: object) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


_VALID_CHECKPOINT = _saved(checkpoint_dict())


@st.composite
def checkpoint_files(draw: st.DrawFn) -> bytes:
    """A saved checkpoint with a field replaced or dropped, a non-dict, or edited bytes."""
    how = draw(st.sampled_from(["field", "drop", "parts", "other", "bytes", "random"]))
    raw = checkpoint_dict()
    if how == "field":
        raw[draw(st.sampled_from(sorted(raw)))] = draw(VALUES)
    elif how == "drop":
        del raw[draw(st.sampled_from(sorted(raw)))]
    elif how == "parts":
        parts = raw["parts"]
        parts[draw(st.sampled_from([*checkpoint.PARTS, "theta", "extra"]))] = draw(
            st.one_of(VALUES, st.just(torch.zeros(2, dtype=torch.int8)))
        )
    elif how == "other":
        return _saved(draw(VALUES))
    elif how == "bytes":
        return draw(mutated_bytes(_VALID_CHECKPOINT))
    else:
        return draw(st.binary(max_size=200))
    return _saved(raw)


def check_checkpoint(data: bytes) -> None:
    """checkpoint.read: a Checkpoint with the four state tensors, or ValueError."""
    with scratch_file("step-000000020.pt", data) as path:
        try:
            ckpt = checkpoint.read(path)
        except ValueError:
            return
    assert set(checkpoint.PARTS) <= set(ckpt.parts)
    assert all(isinstance(t, torch.Tensor) for t in ckpt.parts.values())
    for f in dataclasses.fields(ckpt):
        if f.type in ("int", "str"):
            assert type(getattr(ckpt, f.name)).__name__ == f.type, f"{f.name} is {getattr(ckpt, f.name)!r}"


KEYS = layering.valid_keys()
CONFIG_WORDS = st.sampled_from(
    ["1", "0", "-1", "1e400", "nan", "inf", "true", "none", "auto", "a,b", "1,2,3", ""]
)
ASSIGNMENT = st.tuples(st.sampled_from(KEYS) | st.text(max_size=10), CONFIG_WORDS | st.text(max_size=10))


@st.composite
def noloco_set(draw: st.DrawFn) -> str:
    """NOLOCO_SET text: key=value;... with real keys and awkward values, or any text."""
    if draw(st.booleans()):
        return draw(st.text(max_size=60))
    items = draw(st.lists(ASSIGNMENT, max_size=4))
    return ";".join(f"{k}={v}" if draw(st.booleans()) or not k else k for k, v in items)


def check_noloco_set(text: str) -> None:
    """build_config from NOLOCO_SET: a RunConfig, or ConfigError that says what to change."""
    try:
        layering.build_config(env={"NOLOCO_SET": text})
    except layering.ConfigError as e:
        assert str(e)


@st.composite
def toml_files(draw: st.DrawFn) -> bytes:
    """A config file: real keys with TOML values of any type (arrays, tables, dates), or any text."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=80))
    lines = []
    for key, _ in draw(st.lists(ASSIGNMENT, max_size=4)):
        value = draw(
            st.sampled_from(
                [
                    "1",
                    "-1",
                    "1.5",
                    "nan",
                    "inf",
                    '"x"',
                    '""',
                    "true",
                    "[1, 2]",
                    '["a"]',
                    "{ a = 1 }",
                    "1979-05-27",
                    "[]",
                    '"1,2"',
                    "99999999999999999999",
                ]
            )
        )
        section, _, name = key.rpartition(".")
        lines.append(f"[{section}]\n{name} = {value}" if section else f"{name or 'x'} = {value}")
    return "\n".join(lines).encode()


def check_toml(data: bytes) -> None:
    """load_file then build_config: a RunConfig, or ConfigError."""
    with scratch_file("config.toml", data) as path:
        try:
            layering.resolve([layering.Layer("file", layering.load_file(path))])
        except layering.ConfigError as e:
            assert str(e)


EVENT_KINDS = sorted(events.KINDS)


@st.composite
def event_lines(draw: st.DrawFn) -> str:
    """A JSON line of an events log: a record with fields replaced, or any JSON, or any text."""
    how = draw(st.sampled_from(["record", "json", "text"]))
    if how == "text":
        return draw(st.text(max_size=40))
    if how == "json":
        return json.dumps(draw(VALUES), default=repr)
    kind = draw(st.sampled_from([*EVENT_KINDS, "nope"]))
    names = [f.name for f in dataclasses.fields(events.KINDS.get(kind, events.Event))]
    record: dict[str, Any] = {"event": kind}
    for name in draw(st.lists(st.sampled_from(names), max_size=len(names))) if names else []:
        record[name] = draw(VALUES)
    return json.dumps(record, default=repr)


def check_event_line(line: str) -> None:
    """events.from_dict(json.loads(line)): an Event, or ValueError (json's errors are ValueErrors)."""
    try:
        event = events.from_dict(json.loads(line))
    except ValueError:
        return
    assert isinstance(event, events.Event)


DECODER_TARGETS: list[Target] = [
    Target(
        "messages.decode[bytes]", st.binary(max_size=300), check_decode, "a valid message or MessageError"
    ),
    *(message_target(tag) for tag in TAGS),
    Target(
        "messages.decode_tensor",
        tensor_payloads(),
        check_decode_tensor,
        "a tensor of the meta's shape and dtype (finite floats) or MessageError",
    ),
    Target(
        "wire.decode",
        wire_parts(),
        check_wire_decode,
        "float32 rows of the expected shape, finite when checked, or MessageError",
    ),
    Target(
        "wire.Boundary[subspace]",
        subspace_parts(),
        check_subspace_decode,
        "float32 rows (rows, T, d), finite, or MessageError",
    ),
    Target(
        "chunks.ChunkPlan",
        chunk_plans(),
        check_chunk_plan,
        "held chunks always match the target's manifest; no exception",
    ),
    Target("checkpoint.read", checkpoint_files(), check_checkpoint, "a Checkpoint or ValueError", 60),
    Target(
        "options.build_config[NOLOCO_SET]", noloco_set(), check_noloco_set, "a RunConfig or ConfigError", 60
    ),
    Target("options.load_file[toml]", toml_files(), check_toml, "a RunConfig or ConfigError", 60),
    Target("events.from_dict[json line]", event_lines(), check_event_line, "an Event or ValueError"),
]
