"""The data spec of a run (`DataConfig`) and where data artifacts are cached on this machine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

EMBEDDED = "embedded"
HF = "hf"
SOURCES = (EMBEDDED, HF)

# Byte-level BPE needs the 256 byte symbols plus the end-of-text token before it can learn a
# single merge; anything smaller cannot represent arbitrary text.
MIN_EMBEDDED_VOCAB = 258
# The embedded tokenizer is for small offline runs; a vocabulary beyond this would be mostly
# unused merges on a corpus of a few MB.
MAX_EMBEDDED_VOCAB = 65_536


@dataclass(frozen=True)
class DataConfig:
    """Which text a run trains on, how it is tokenized and cut into training windows.

    Every field is part of the run's identity: peers of one run must hold equal `DataConfig`s
    (the swarm manifest compares them), so nothing machine-local (such as the cache directory)
    lives here.
    """

    source: str = EMBEDDED
    """Where documents come from: "embedded" (the offline corpus built from the Python standard
    library, see `noloco_swarm.data.corpus`) or "hf" (a streaming Hugging Face dataset)."""

    dataset: str = "allenai/c4"
    """Hugging Face dataset name or loader (e.g. "json"), used when `source` is "hf"."""

    dataset_config: str | None = "en"
    """Dataset configuration name passed to `datasets.load_dataset` (None for none)."""

    split: str = "train"
    """Split that training windows are read from (source "hf")."""

    val_split: str = "validation"
    """Split that validation windows are read from (source "hf")."""

    text_field: str = "text"
    """Name of the field of each record that holds the document text (source "hf")."""

    data_files: tuple[str, ...] = ()
    """Local files for file-based loaders such as "json" (source "hf"); empty for hub datasets.
    With a file loader the training split reads these files; validation reads `val_data_files`."""

    val_data_files: tuple[str, ...] = ()
    """Local files for the validation split of a file-based loader (source "hf")."""

    tokenizer: str = EMBEDDED
    """"embedded" for the byte-level BPE trained on the embedded corpus, or a Hugging Face
    tokenizer name or local directory for `transformers.AutoTokenizer.from_pretrained`."""

    vocab_size: int = 4096
    """Vocabulary size of the embedded tokenizer, including `<|endoftext|>`; ignored for a
    Hugging Face tokenizer, whose vocabulary is fixed."""

    seq_len: int = 256
    """Tokens of context per training sample; each window holds `seq_len + 1` tokens so that
    inputs are `w[:-1]` and next-token targets are `w[1:]`."""

    val_max_windows: int = 512
    """At most this many validation windows are used; the same ones on every call."""

    shuffle_buffer: int = 10_000
    """Documents held in the shuffle buffer of a streaming dataset (source "hf"); 0 reads them in
    stored order. The embedded corpus is shuffled exactly and ignores this."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(
                f"DataConfig.source is {self.source!r}; set it to 'embedded' (offline corpus) "
                "or 'hf' (a Hugging Face streaming dataset)"
            )
        for name in ("dataset", "split", "val_split", "text_field", "tokenizer"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"DataConfig.{name} is {value!r}; give a non-empty string")
        if self.dataset_config is not None and not self.dataset_config.strip():
            raise ValueError("DataConfig.dataset_config is an empty string; use None for no config name")
        for name in ("data_files", "val_data_files"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)) or not all(isinstance(f, str) and f for f in value):
                raise ValueError(f"DataConfig.{name} is {value!r}; give a list of file paths (not a string)")
            # Config files and flags give lists; a tuple keeps the config hashable and frozen.
            object.__setattr__(self, name, tuple(value))
        if self.data_files and not self.val_data_files:
            raise ValueError(
                "DataConfig.data_files is set but val_data_files is empty; give the local files "
                "that hold the validation documents too"
            )
        if self.data_files and self.split == self.val_split:
            raise ValueError(
                f"DataConfig.split and val_split are both {self.split!r}; name the training and "
                "validation splits differently so their local files stay apart"
            )
        if self.tokenizer == EMBEDDED and not (MIN_EMBEDDED_VOCAB <= self.vocab_size <= MAX_EMBEDDED_VOCAB):
            raise ValueError(
                f"DataConfig.vocab_size is {self.vocab_size}; the embedded byte-level tokenizer needs "
                f"{MIN_EMBEDDED_VOCAB} <= vocab_size <= {MAX_EMBEDDED_VOCAB} (4096 is the default)"
            )
        if self.seq_len < 1:
            raise ValueError(f"DataConfig.seq_len is {self.seq_len}; it must be at least 1 token")
        if self.val_max_windows < 1:
            raise ValueError(
                f"DataConfig.val_max_windows is {self.val_max_windows}; use at least 1 validation window"
            )
        if self.shuffle_buffer < 0:
            raise ValueError(
                f"DataConfig.shuffle_buffer is {self.shuffle_buffer}; use 0 (no shuffle) or a positive size"
            )


def default_cache_dir() -> Path:
    """`$NOLOCO_CACHE` if set, else `~/.cache/noloco-swarm`: where corpus and tokenizer are kept."""
    env = os.environ.get("NOLOCO_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "noloco-swarm"


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The given cache directory, or the default one, created if missing."""
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path
