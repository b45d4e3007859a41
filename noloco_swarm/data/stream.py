"""Training and validation windows: deterministic, disjoint per-shard streams that can resume at any step.

A *window* is `seq_len + 1` consecutive tokens of the document stream (documents joined with the
end-of-text token); a model reads `w[:-1]` and predicts `w[1:]` (see `split_window`). Window `j`
starts at token `j * seq_len`, so neighbouring windows share one token and every next-token pair
of the stream is in exactly one window.

Embedded corpus (`TokenStream`): window `j` belongs to shard `j % num_shards`, so the shards of a
stage-0 replica set are disjoint and together cover every window. Within a shard, epoch `e` visits
the shard's windows in the order of a permutation drawn from
`numpy.random.default_rng([STREAM_TAG, seed, num_shards, shard, e])`, `batch_size` at a time; the
last `len % batch_size` windows of an epoch's order are left out of that epoch (a different few
each epoch). Batch `t` is a pure function of `(seed, shard, num_shards, batch_size, t)`, so a peer
that resumes at step `t` gets exactly the batches it would have had.

A swarm whose stage-0 replica count changes makes each peer build a new stream for the new
`num_shards`; the streams stay reproducible but windows may repeat across that change.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import torch

from noloco_swarm.data.config import EMBEDDED, DataConfig
from noloco_swarm.data.corpus import build_corpus, corpus_sha256, write_atomic
from noloco_swarm.data.tokenizer import TextTokenizer, load_tokenizer

# Separates the data stream's draws from any other use of the run seed.
STREAM_TAG = 0x5EED_DA7A
_ENCODE_CHUNK = 256


def split_window(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-token targets) of windows shaped (..., seq_len + 1)."""
    return windows[..., :-1], windows[..., 1:]


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many windows of `seq_len + 1` tokens, stride `seq_len`, fit in `num_tokens` tokens."""
    return max(0, (num_tokens - 1) // seq_len)


def gather_windows(tokens: np.ndarray, ids: np.ndarray, seq_len: int) -> torch.Tensor:
    """LongTensor (len(ids), seq_len + 1) holding the windows numbered `ids`."""
    index = ids.astype(np.int64)[:, None] * seq_len + np.arange(seq_len + 1, dtype=np.int64)
    return torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))


def _token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    # uint16 halves the cache and the resident memory for every vocabulary up to 65536.
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def tokenize_documents(texts: list[str], tokenizer: TextTokenizer) -> np.ndarray:
    """All `texts` tokenized and joined into one array, each followed by the end-of-text id."""
    parts: list[np.ndarray] = []
    dtype = _token_dtype(tokenizer.vocab_size)
    for start in range(0, len(texts), _ENCODE_CHUNK):
        for ids in tokenizer.encode_batch(texts[start : start + _ENCODE_CHUNK]):
            parts.append(np.asarray([*ids, tokenizer.eos_id], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def corpus_tokens(cfg: DataConfig, split: str, cache_dir: str | os.PathLike[str] | None = None) -> np.ndarray:
    """The embedded corpus' `split` ("train" or "val") as one token array, cached and memory-mapped."""
    if split not in ("train", "val"):
        raise ValueError(f"split is {split!r}; use 'train' or 'val'")
    corpus = build_corpus(cache_dir)
    tokenizer = load_tokenizer(cfg, cache_dir)
    docs = corpus.train if split == "train" else corpus.val
    # Named by the split's own content: a change of the split rule (e.g. deduplication) is a new file.
    digest = corpus_sha256(list(docs))[:16]
    path = corpus.directory / f"tokens-{digest}-{tokenizer.fingerprint[:16]}-{split}.npy"
    if not path.is_file():
        buffer = io.BytesIO()
        np.save(buffer, tokenize_documents([d.text for d in docs], tokenizer))
        write_atomic(path, buffer.getvalue())
    return np.load(path, mmap_mode="r")


class TokenStream:
    """One shard's batches of windows of a token array; `batch(step)` is a pure function of the step."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        shard: int,
        num_shards: int,
        seed: int,
    ) -> None:
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(
                f"shard {shard} of {num_shards}: need num_shards >= 1 and 0 <= shard < num_shards"
            )
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be at least 1")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.shard = shard
        self.num_shards = num_shards
        self.seed = seed
        self.total_windows = num_windows(len(tokens), seq_len)
        self.window_ids = np.arange(shard, self.total_windows, num_shards, dtype=np.int64)
        self.steps_per_epoch = len(self.window_ids) // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"shard {shard} of {num_shards} holds {len(self.window_ids)} windows of {seq_len + 1} "
                f"tokens, fewer than one batch of {batch_size}; use fewer shards, a smaller batch, "
                "a shorter seq_len or more data"
            )
        # Each call of the bound method would otherwise redraw a permutation every step.
        self._order = lru_cache(maxsize=2)(self._draw_order)

    def _draw_order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([STREAM_TAG, self.seed, self.num_shards, self.shard, epoch])
        return self.window_ids[rng.permutation(len(self.window_ids))]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Window ids of this shard in the order epoch `epoch` visits them."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        return self._order(epoch)

    def batch_window_ids(self, step: int) -> np.ndarray:
        """Ids of the windows of batch `step` (counting from 0 across epochs)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, k = divmod(step, self.steps_per_epoch)
        return self.epoch_order(epoch)[k * self.batch_size : (k + 1) * self.batch_size]

    def batch(self, step: int) -> torch.Tensor:
        """LongTensor (batch_size, seq_len + 1): the windows of batch `step`."""
        return gather_windows(self.tokens, self.batch_window_ids(step), self.seq_len)

    def iter_from(self, start_step: int = 0) -> Iterator[torch.Tensor]:
        """Batches `start_step`, `start_step + 1`, ... without end (epochs repeat, reshuffled)."""
        step = start_step
        while True:
            yield self.batch(step)
            step += 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.iter_from(0)


def embedded_stream(
    cfg: DataConfig,
    shard: int,
    num_shards: int,
    batch_size: int,
    seed: int,
    cache_dir: str | os.PathLike[str] | None = None,
) -> TokenStream:
    """The `TokenStream` of shard `shard` of `num_shards` over the embedded corpus' training split."""
    if cfg.source != EMBEDDED:
        raise ValueError(f"embedded_stream needs DataConfig.source 'embedded', got {cfg.source!r}")
    tokens = corpus_tokens(cfg, "train", cache_dir)
    return TokenStream(tokens, cfg.seq_len, batch_size, shard, num_shards, seed)


def train_batches(
    cfg: DataConfig,
    shard: int,
    num_shards: int,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Iterator[torch.Tensor]:
    """Endless LongTensor (batch_size, seq_len + 1) batches of one shard, from batch `start_step` on.

    Shards are disjoint; the same arguments give the same batches on every machine (with equal
    corpus and tokenizer fingerprints). Use `split_window` for inputs and targets.
    """
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    if cfg.source == EMBEDDED:
        return embedded_stream(cfg, shard, num_shards, batch_size, seed, cache_dir).iter_from(start_step)
    from noloco_swarm.data.hub import hub_train_batches

    tokenizer = load_tokenizer(cfg, cache_dir)
    return hub_train_batches(cfg, tokenizer, shard, num_shards, batch_size, seed, start_step)


def validation_windows(cfg: DataConfig, cache_dir: str | os.PathLike[str] | None = None) -> torch.Tensor:
    """LongTensor (N, seq_len + 1), N <= `cfg.val_max_windows`: the same held-out windows every call."""
    if cfg.source == EMBEDDED:
        tokens = corpus_tokens(cfg, "val", cache_dir)
        count = min(num_windows(len(tokens), cfg.seq_len), cfg.val_max_windows)
        if count == 0:
            raise ValueError(f"the validation split is shorter than one window of {cfg.seq_len + 1} tokens")
        return gather_windows(tokens, np.arange(count), cfg.seq_len)
    from noloco_swarm.data.hub import hub_validation_windows

    return hub_validation_windows(cfg, load_tokenizer(cfg, cache_dir))


def validation_batches(
    cfg: DataConfig,
    batch_size: int,
    max_batches: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Iterator[torch.Tensor]:
    """`validation_windows` in batches of up to `batch_size` (the last may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    windows = validation_windows(cfg, cache_dir)
    for i, start in enumerate(range(0, len(windows), batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        yield windows[start : start + batch_size]
