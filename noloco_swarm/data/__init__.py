"""Training data: the embedded offline corpus and tokenizer, and streaming datasets for real runs."""

from noloco_swarm.data.config import DataConfig, default_cache_dir
from noloco_swarm.data.corpus import Corpus, Document, build_corpus
from noloco_swarm.data.stream import (
    TokenStream,
    corpus_tokens,
    embedded_stream,
    split_window,
    train_batches,
    validation_batches,
    validation_windows,
)
from noloco_swarm.data.tokenizer import (
    EOS_TOKEN,
    BPETokenizer,
    HFTokenizer,
    TextTokenizer,
    embedded_tokenizer,
    hf_tokenizer,
    load_tokenizer,
)

__all__ = [
    "EOS_TOKEN",
    "BPETokenizer",
    "Corpus",
    "DataConfig",
    "Document",
    "HFTokenizer",
    "TextTokenizer",
    "TokenStream",
    "build_corpus",
    "corpus_tokens",
    "default_cache_dir",
    "embedded_stream",
    "embedded_tokenizer",
    "hf_tokenizer",
    "load_tokenizer",
    "split_window",
    "train_batches",
    "validation_batches",
    "validation_windows",
]
