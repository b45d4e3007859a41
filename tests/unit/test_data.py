"""Tests of noloco_swarm.data: the embedded corpus and tokenizer, sharded streams, the hub path on local files."""

from __future__ import annotations

import ast
import itertools
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noloco_swarm.data import (
    EOS_TOKEN,
    BPETokenizer,
    Corpus,
    DataConfig,
    HFTokenizer,
    TextTokenizer,
    TokenStream,
    build_corpus,
    corpus_tokens,
    default_cache_dir,
    embedded_stream,
    embedded_tokenizer,
    load_tokenizer,
    split_window,
    train_batches,
    validation_batches,
    validation_windows,
)
from noloco_swarm.data import tokenizer as tokenizer_module
from noloco_swarm.data.corpus import (
    Document,
    collect_documents,
    corpus_sha256,
    deduplicate_validation,
    html_to_text,
    source_document,
)
from noloco_swarm.data.hub import buffer_shuffle, open_split, pack_windows, shard_records
from noloco_swarm.data.tokenizer import embedded_tokenizer_path, train_bpe

SEQ_LEN = 64
SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\nand a carriage return",
    "héllo wörld — naïve café, Ελληνικά, русский, 漢字, 😀🚀",
    "def f(x):\n    return x ** 2  # code too\n",
    "",
]


@pytest.fixture(scope="session")
def corpus(cache: Path) -> Corpus:
    return build_corpus(cache)


@pytest.fixture(scope="session")
def cfg() -> DataConfig:
    return DataConfig(seq_len=SEQ_LEN)


@pytest.fixture(scope="session")
def tokenizer(cache: Path, corpus: Corpus) -> BPETokenizer:
    return embedded_tokenizer(4096, cache)


@pytest.fixture(scope="session")
def train_tokens(cfg: DataConfig, cache: Path, tokenizer: BPETokenizer) -> np.ndarray:
    return corpus_tokens(cfg, "train", cache)


class CharTokenizer:
    """Code points as ids, eos = 0: a stand-in `TextTokenizer` for testing packing."""

    vocab_size = 0x110000
    eos_id = 0
    fingerprint = "chars"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)


# --- corpus ---------------------------------------------------------------------------------------


def test_corpus_is_megabytes_of_prose(corpus: Corpus) -> None:
    assert corpus.train_chars + corpus.val_chars >= 3_000_000
    names = [d.name for d in corpus.train + corpus.val]
    assert len(names) == len(set(names)) > 500
    assert "topic:assert" in names
    assert any(n.startswith("stdlib:json/") for n in names)
    assert not any("/test/" in n or "/tests/" in n or "site-packages" in n for n in names)


def test_validation_split_is_small_fixed_and_disjoint(corpus: Corpus) -> None:
    train, val = {d.name for d in corpus.train}, {d.name for d in corpus.val}
    assert not train & val
    assert 0.005 <= len(val) / (len(train) + len(val)) <= 0.05
    assert 0 < corpus.val_chars < 0.1 * corpus.train_chars


def test_no_validation_text_occurs_in_the_training_split(corpus: Corpus) -> None:
    # pydoc's topic:else is byte-identical to topic:if; whichever side holds it, it must not be both.
    seen = "\n\n".join(d.text for d in corpus.train)
    assert "topic:else" not in {d.name for d in corpus.val}
    for doc in corpus.val:
        assert doc.text not in seen, doc.name
        for paragraph in doc.text.split("\n\n"):
            if len(paragraph.strip()) >= 40:
                assert paragraph.strip() not in seen, (doc.name, paragraph[:60])
    assert len(corpus.val) >= 10 and corpus.val_chars > 40_000  # a few shared lines, not the split


def test_deduplication_drops_copies_and_cuts_shared_paragraphs() -> None:
    shared = "This paragraph is repeated word for word in both of the splits."
    train = (Document("a", f"Intro that only training has, long enough to count.\n\n{shared}"),)
    val = (
        Document("copy", shared),
        Document("mixed", f"{shared}\n\nA held-out paragraph that training never saw at all.\n\nshort"),
        Document("own", "Entirely new text."),
    )
    out = deduplicate_validation(train, val)
    assert [d.name for d in out] == ["mixed", "own"]
    assert out[0].text == "A held-out paragraph that training never saw at all.\n\nshort"


def test_corpus_build_is_deterministic_and_cached(corpus: Corpus, cache: Path) -> None:
    assert corpus_sha256(collect_documents()) == corpus.sha256
    meta = corpus.directory / "meta.json"
    mtime = meta.stat().st_mtime_ns
    again = build_corpus(cache)
    assert again == corpus
    assert meta.stat().st_mtime_ns == mtime
    assert json.loads(meta.read_text())["sha256"] == corpus.sha256


def test_source_document_keeps_prose_only() -> None:
    source = b'''"""A module docstring that is long enough to count as prose here."""

# This comment block explains why the code below does what it does,
# across two lines of plain English words.
x = 1  # a trailing comment about x is left out
# y = compute(x, 2) + [3, 4]

class C:
    """Short."""

    def f(self):
        """Return the answer, which is computed by a long-winded method."""
        raise ValueError("the argument must be a positive number of seconds")

    def g(self, n):
        raise ValueError(f"the argument {n} must be a positive number of seconds")
'''
    text = source_document(source)
    assert text.split("\n\n") == [
        "A module docstring that is long enough to count as prose here.",
        "This comment block explains why the code below does what it does,\n"
        "across two lines of plain English words.",
        "Return the answer, which is computed by a long-winded method.",
        "the argument must be a positive number of seconds",
    ]
    assert source_document(b"def broken(:\n") == ""
    assert ast.parse(source)  # the fixture itself is valid Python


def test_html_to_text() -> None:
    html = "<html><style>p {}</style><body><h1>Title</h1><p>Some &amp; <b>bold</b>\n text.</p></body>"
    assert html_to_text(html) == "Title\nSome & bold text."


def test_default_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NOLOCO_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("NOLOCO_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "noloco-swarm"


# --- tokenizer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_embedded_tokenizer_round_trips(tokenizer: BPETokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_embedded_tokenizer_shape(tokenizer: BPETokenizer, corpus: Corpus) -> None:
    assert isinstance(tokenizer, TextTokenizer)
    assert tokenizer.vocab_size == 4096
    assert tokenizer.eos_id == 0
    assert tokenizer.decode([tokenizer.eos_id]) == EOS_TOKEN
    text = corpus.val[0].text
    ids = tokenizer.encode(text)
    assert max(ids) < tokenizer.vocab_size
    assert len(text) / len(ids) > 2.5  # a real BPE compresses English prose
    assert tokenizer.encode_batch([text, "x"]) == [ids, tokenizer.encode("x")]


def test_tokenizer_training_is_deterministic(tokenizer: BPETokenizer, corpus: Corpus) -> None:
    path = embedded_tokenizer_path(corpus.directory, corpus.sha256, 4096)
    retrained = train_bpe((d.text for d in corpus.train), 4096)
    assert retrained.to_str(pretty=True) == path.read_text("utf-8")


def test_tokenizer_cache_is_reused(
    tokenizer: BPETokenizer, corpus: Corpus, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = embedded_tokenizer_path(corpus.directory, corpus.sha256, 4096)
    mtime = path.stat().st_mtime_ns

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(tokenizer_module, "train_bpe", no_training)
    again = embedded_tokenizer(4096, cache)
    assert again.fingerprint == tokenizer.fingerprint
    assert path.stat().st_mtime_ns == mtime


def test_vocab_size_is_configurable(cache: Path, corpus: Corpus) -> None:
    small = load_tokenizer(DataConfig(vocab_size=512), cache)
    assert small.vocab_size == 512
    assert small.decode(small.encode(SAMPLES[3])) == SAMPLES[3]


def _save_as_hf(tokenizer: BPETokenizer, directory: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token=EOS_TOKEN).save_pretrained(
        directory
    )
    return directory


def test_hf_tokenizer_from_local_directory(
    tokenizer: BPETokenizer, cache: Path, tmp_path: Path, cfg: DataConfig
) -> None:
    directory = _save_as_hf(tokenizer, tmp_path / "tok")
    hf_cfg = DataConfig(seq_len=SEQ_LEN, tokenizer=str(directory))
    hf = load_tokenizer(hf_cfg, cache)
    assert isinstance(hf, HFTokenizer)
    assert isinstance(hf, TextTokenizer)
    assert (hf.vocab_size, hf.eos_id) == (4096, 0)
    for text in SAMPLES:
        assert hf.encode(text) == tokenizer.encode(text)
        assert hf.decode(hf.encode(text)) == text
    assert hf.encode_batch(SAMPLES) == tokenizer.encode_batch(SAMPLES)
    # The embedded corpus tokenized by a hub-path tokenizer gives the same windows.
    assert torch.equal(validation_windows(hf_cfg, cache), validation_windows(cfg, cache))


def test_hf_tokenizer_name_that_cannot_load_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="embedded"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing")))


# --- embedded streams -----------------------------------------------------------------------------


def test_shards_are_disjoint_and_cover_every_window(train_tokens: np.ndarray) -> None:
    streams = [TokenStream(train_tokens, SEQ_LEN, 8, s, 3, seed=7) for s in range(3)]
    owned = [set(s.window_ids.tolist()) for s in streams]
    assert sum(len(o) for o in owned) == len(set().union(*owned)) == streams[0].total_windows
    for stream in streams:
        order = stream.epoch_order(0)
        assert sorted(order.tolist()) == stream.window_ids.tolist()
        seen = np.concatenate([stream.batch_window_ids(t) for t in range(stream.steps_per_epoch)])
        assert len(set(seen.tolist())) == len(seen) == stream.steps_per_epoch * 8
        # Each epoch leaves out fewer than one batch of windows.
        assert len(stream.window_ids) - len(seen) < 8


def test_windows_are_consecutive_tokens(train_tokens: np.ndarray) -> None:
    stream = TokenStream(train_tokens, SEQ_LEN, 4, 1, 2, seed=0)
    batch = stream.batch(5)
    assert batch.dtype == torch.long and batch.shape == (4, SEQ_LEN + 1)
    for row, j in zip(batch, stream.batch_window_ids(5), strict=True):
        start = int(j) * SEQ_LEN
        assert row.tolist() == train_tokens[start : start + SEQ_LEN + 1].tolist()
    inputs, targets = split_window(batch)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_same_seed_and_shard_give_the_same_stream(
    cfg: DataConfig, cache: Path, tokenizer: BPETokenizer
) -> None:
    a = embedded_stream(cfg, 1, 4, 16, seed=3, cache_dir=cache)
    b = embedded_stream(cfg, 1, 4, 16, seed=3, cache_dir=cache)
    steps = [0, 1, a.steps_per_epoch - 1, a.steps_per_epoch, 3 * a.steps_per_epoch + 2]
    for t in steps:
        assert torch.equal(a.batch(t), b.batch(t))
    other_seed = embedded_stream(cfg, 1, 4, 16, seed=4, cache_dir=cache)
    assert not torch.equal(a.batch(0), other_seed.batch(0))


def test_epochs_reshuffle(train_tokens: np.ndarray) -> None:
    stream = TokenStream(train_tokens, SEQ_LEN, 8, 0, 2, seed=1)
    first, second = stream.epoch_order(0), stream.epoch_order(1)
    assert sorted(first.tolist()) == sorted(second.tolist())
    assert not np.array_equal(first, second)
    assert np.array_equal(stream.batch_window_ids(stream.steps_per_epoch), second[:8])


def test_resume_at_a_step_gives_the_same_batches(
    cfg: DataConfig, cache: Path, tokenizer: BPETokenizer
) -> None:
    full = list(itertools.islice(train_batches(cfg, 0, 2, 8, seed=5, cache_dir=cache), 12))
    resumed = list(itertools.islice(train_batches(cfg, 0, 2, 8, seed=5, start_step=7, cache_dir=cache), 5))
    assert all(torch.equal(x, y) for x, y in zip(full[7:], resumed, strict=True))


def test_validation_is_fixed(cfg: DataConfig, cache: Path, tokenizer: BPETokenizer) -> None:
    first = validation_windows(cfg, cache)
    assert first.dtype == torch.long and first.shape[1] == SEQ_LEN + 1
    assert 10 <= len(first) <= cfg.val_max_windows
    assert torch.equal(first, validation_windows(cfg, cache))
    batches = list(validation_batches(cfg, 16, cache_dir=cache))
    assert torch.equal(torch.cat(batches), first)
    assert len(list(validation_batches(cfg, 16, max_batches=2, cache_dir=cache))) == 2
    capped = DataConfig(seq_len=SEQ_LEN, val_max_windows=5)
    assert torch.equal(validation_windows(capped, cache), first[:5])


def test_stream_rejects_impossible_shapes(train_tokens: np.ndarray) -> None:
    with pytest.raises(ValueError, match="shard"):
        TokenStream(train_tokens, SEQ_LEN, 8, 3, 3, seed=0)
    with pytest.raises(ValueError, match="fewer shards"):
        TokenStream(train_tokens[:1000], SEQ_LEN, 64, 0, 2, seed=0)


# --- hub path on local files ----------------------------------------------------------------------


@pytest.fixture
def json_cfg(tmp_path: Path, corpus: Corpus) -> DataConfig:
    """A "json" streaming dataset of two train files and one validation file."""
    docs = [d.text[:2000] for d in corpus.train[:60]]
    files = []
    for i, part in enumerate((docs[:30], docs[30:])):
        path = tmp_path / f"train-{i}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{i}-{k}", "text": t}) + "\n" for k, t in enumerate(part)))
        files.append(str(path))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"text": d.text}) + "\n" for d in corpus.val))
    return DataConfig(
        source="hf",
        dataset="json",
        dataset_config=None,
        data_files=tuple(files),
        val_data_files=(str(val),),
        seq_len=32,
        shuffle_buffer=8,
    )


@pytest.mark.parametrize("num_shards", [2, 3])  # 2: whole files per shard; 3: every 3rd document
def test_hub_shards_are_disjoint(json_cfg: DataConfig, num_shards: int) -> None:
    dataset = open_split(json_cfg, json_cfg.split)
    ids = [[r["id"] for r in shard_records(dataset, s, num_shards)] for s in range(num_shards)]
    flat = [i for shard in ids for i in shard]
    assert len(flat) == len(set(flat)) == 60
    assert all(ids)


def test_hub_stream_produces_reproducible_windows(json_cfg: DataConfig, cache: Path) -> None:
    def take(shard: int, start: int, n: int, seed: int = 0) -> list[torch.Tensor]:
        stream = train_batches(json_cfg, shard, 3, 4, seed=seed, start_step=start, cache_dir=cache)
        return list(itertools.islice(stream, n))

    full = take(1, 0, 30)  # enough to cross into the second epoch
    assert all(b.dtype == torch.long and b.shape == (4, 33) for b in full)
    assert all(torch.equal(x, y) for x, y in zip(full, take(1, 0, 30), strict=True))
    assert all(torch.equal(x, y) for x, y in zip(full[20:], take(1, 20, 10), strict=True))
    assert not torch.equal(full[0], take(1, 0, 1, seed=1)[0])
    assert not torch.equal(full[0], take(0, 0, 1)[0])
    val = validation_windows(json_cfg, cache)
    assert val.shape[1] == 33 and torch.equal(val, validation_windows(json_cfg, cache))


def test_hub_stream_with_local_hf_tokenizer(
    json_cfg: DataConfig, tokenizer: BPETokenizer, tmp_path: Path, cache: Path
) -> None:
    directory = _save_as_hf(tokenizer, tmp_path / "tok")
    cfg = replace(json_cfg, tokenizer=str(directory))
    hf_batch = next(train_batches(cfg, 0, 2, 4, seed=0, cache_dir=cache))
    embedded_batch = next(train_batches(json_cfg, 0, 2, 4, seed=0, cache_dir=cache))
    assert torch.equal(hf_batch, embedded_batch)


def test_hub_stream_names_a_missing_text_field(json_cfg: DataConfig, cache: Path) -> None:
    cfg = replace(json_cfg, text_field="body")
    with pytest.raises(ValueError, match="text_field to one of"):
        next(train_batches(cfg, 0, 1, 2, seed=0, cache_dir=cache))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(max_size=5), max_size=40), st.integers(0, 10), st.integers(0, 2**32))
def test_buffer_shuffle_is_a_seeded_permutation(items: list[str], size: int, seed: int) -> None:
    out = list(buffer_shuffle(items, size, np.random.default_rng(seed)))
    assert sorted(out) == sorted(items)
    assert out == list(buffer_shuffle(items, size, np.random.default_rng(seed)))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=30), max_size=20), st.integers(1, 9))
def test_packing_covers_the_stream_with_one_token_overlap(texts: list[str], seq_len: int) -> None:
    tok = CharTokenizer()
    stream = [i for t in texts for i in [*tok.encode(t), tok.eos_id]]
    windows = [w.tolist() for w in pack_windows(texts, tok, seq_len)]
    assert len(windows) == max(0, (len(stream) - 1) // seq_len)
    for j, w in enumerate(windows):
        assert w == stream[j * seq_len : j * seq_len + seq_len + 1]


# --- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"source": "s3"}, "source"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"vocab_size": 1 << 20}, "vocab_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"val_max_windows": 0}, "val_max_windows"),
        ({"shuffle_buffer": -1}, "shuffle_buffer"),
        ({"text_field": ""}, "text_field"),
        ({"dataset_config": ""}, "None"),
        ({"data_files": "a.jsonl", "val_data_files": ("b",)}, "list of file paths"),
        ({"data_files": ("a.jsonl",)}, "val_data_files"),
        ({"data_files": ("a",), "val_data_files": ("b",), "val_split": "train"}, "differently"),
    ],
)
def test_bad_config_says_what_to_change(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(**changes)  # type: ignore[arg-type]


def test_file_lists_become_tuples() -> None:
    cfg = DataConfig(data_files=["a.jsonl"], val_data_files=["b.jsonl"])  # type: ignore[arg-type]
    assert cfg.data_files == ("a.jsonl",) and cfg.val_data_files == ("b.jsonl",)
    assert hash(cfg) == hash(DataConfig(data_files=("a.jsonl",), val_data_files=("b.jsonl",)))


def test_hub_tokenizer_ignores_vocab_size() -> None:
    assert DataConfig(tokenizer="gpt2", vocab_size=50257 * 2).vocab_size == 100514


def test_data_imports_no_other_project_package() -> None:
    package = Path(__file__).resolve().parents[2] / "noloco_swarm" / "data"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("noloco_swarm"):
                assert node.module.startswith(("noloco_swarm.data", "noloco_swarm.protocol")), path
            elif isinstance(node, ast.Import):
                assert not any(
                    a.name.startswith("noloco_swarm") and not a.name.startswith("noloco_swarm.data")
                    for a in node.names
                ), path
