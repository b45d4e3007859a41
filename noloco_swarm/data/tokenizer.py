"""Tokenizers behind one small interface: the embedded byte-level BPE, or any Hugging Face tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from noloco_swarm.data.config import EMBEDDED, MIN_EMBEDDED_VOCAB, DataConfig
from noloco_swarm.data.corpus import build_corpus, write_atomic

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EOS_TOKEN = "<|endoftext|>"
# Bump when the training recipe below changes: it is part of the cached file's name.
TOKENIZER_VERSION = "bytebpe-v1"


@runtime_checkable
class TextTokenizer(Protocol):
    """What the data pipeline needs from a tokenizer; the embedded and the hub one both provide it."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids; every id is in `range(vocab_size)`."""
        ...

    @property
    def eos_id(self) -> int:
        """Id of the end-of-text token that separates documents in the token stream."""
        ...

    @property
    def fingerprint(self) -> str:
        """A hex digest of the exact text-to-ids mapping; equal fingerprints tokenize alike."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class BPETokenizer:
    """A `tokenizers.Tokenizer` (the embedded byte-level BPE) as a `TextTokenizer`."""

    def __init__(self, tokenizer: Tokenizer, eos_token: str = EOS_TOKEN) -> None:
        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise ValueError(f"tokenizer has no {eos_token!r} token to separate documents")
        self.backend = tokenizer
        self._eos = eos
        self._fingerprint = hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> BPETokenizer:
        return cls(Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        # As with GPT-2's tokenizer, a literal "<|endoftext|>" in a text reads as the token itself;
        # the embedded corpus contains none.
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


class HFTokenizer:
    """A `transformers` tokenizer (hub name or local directory) as a `TextTokenizer`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} has no end-of-sequence token, which the data "
                "pipeline needs between documents; choose a tokenizer for causal language models"
            )
        self.backend = tokenizer
        self._eos = int(eos)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # A fast tokenizer serialises completely; for a slow one the vocabulary is the best we have.
        state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
        self._fingerprint = hashlib.sha256(state.encode("utf-8")).hexdigest()

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too, unlike `.vocab_size`; the model must embed every id.
        return len(self.backend)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        # verbose=False: documents are longer than the model's context by design; they get packed.
        return list(self.backend.encode(text, add_special_tokens=False, verbose=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        out = self.backend(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [list(ids) for ids in out]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) with `<|endoftext|>` as id 0.

    The `tokenizers` trainer breaks ties between equally frequent pairs by the pair itself, so the
    result does not depend on thread count or hash seeds; `tests/unit/test_data.py` checks that two
    trainings give the same file. The cache makes it stable regardless.
    """
    if vocab_size < MIN_EMBEDDED_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is below {MIN_EMBEDDED_VOCAB}: 256 bytes + eos + 1 merge")
    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every string round-trips, with no unknown token; no prefix space keeps decode exact.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def embedded_tokenizer_path(corpus_dir: Path, corpus_sha256: str, vocab_size: int) -> Path:
    return corpus_dir / f"tokenizer-{TOKENIZER_VERSION}-{corpus_sha256[:16]}-v{vocab_size}.json"


def embedded_tokenizer(
    vocab_size: int = 4096, cache_dir: str | os.PathLike[str] | None = None
) -> BPETokenizer:
    """The byte-level BPE of the embedded corpus' training split, trained once (about a second)."""
    corpus = build_corpus(cache_dir)
    path = embedded_tokenizer_path(corpus.directory, corpus.sha256, vocab_size)
    if not path.is_file():
        tokenizer = train_bpe((d.text for d in corpus.train), vocab_size)
        write_atomic(path, tokenizer.to_str(pretty=True).encode("utf-8"))
    return BPETokenizer.from_file(path)


def hf_tokenizer(name: str) -> HFTokenizer:
    """`transformers.AutoTokenizer.from_pretrained(name)`: a hub name or a local directory."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as err:
        raise OSError(
            f"could not load tokenizer {name!r}: {err}. Check the name or path and that this machine "
            "can reach the Hugging Face hub, or set the data tokenizer to 'embedded' to work offline"
        ) from err
    return HFTokenizer(tokenizer)


def load_tokenizer(cfg: DataConfig, cache_dir: str | os.PathLike[str] | None = None) -> TextTokenizer:
    """The tokenizer that `cfg` names."""
    if cfg.tokenizer == EMBEDDED:
        return embedded_tokenizer(cfg.vocab_size, cache_dir)
    return hf_tokenizer(cfg.tokenizer)
