"""Streaming Hugging Face datasets (C4 by default) packed into windows, sharded per stage-0 replica.

Shard `shard` of `num_shards` reads a disjoint part of the training split: the dataset's files
`shard, shard + num_shards, ...` when it has at least `num_shards` of them (C4 "en" has 1024),
otherwise every `num_shards`-th document. The shard's documents pass a seeded shuffle buffer
(`numpy.random.default_rng([STREAM_TAG, seed, num_shards, shard, epoch])`), are tokenized,
joined with the end-of-text token and cut into windows of `seq_len + 1` tokens at stride
`seq_len`, as in `noloco_swarm.data.stream`. At the end of the split the next epoch starts with a
new shuffle, and packing carries on across the boundary.

Known limit: a stream cannot seek, so resuming at step `t` re-reads and discards the first
`t * batch_size` windows of the shard (exact, but it costs as much reading as the skipped steps).
Validation reads the validation split unsharded and unshuffled and keeps its first
`val_max_windows` windows, the same ones every call.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from noloco_swarm.data.config import DataConfig
from noloco_swarm.data.stream import STREAM_TAG
from noloco_swarm.data.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from datasets import IterableDataset

_ENCODE_CHUNK = 64


def open_split(cfg: DataConfig, split: str) -> IterableDataset:
    """`datasets.load_dataset(..., streaming=True)` for one split of the configured dataset."""
    from datasets import load_dataset

    kwargs: dict[str, Any] = {"split": split, "streaming": True}
    if cfg.data_files:
        # Map the configured split names onto the local files, so `split` means the same as on the hub.
        kwargs["data_files"] = {cfg.split: list(cfg.data_files), cfg.val_split: list(cfg.val_data_files)}
    return load_dataset(cfg.dataset, cfg.dataset_config, **kwargs)


def _texts(records: Iterable[dict[str, Any]], field: str) -> Iterator[str]:
    for record in records:
        if field not in record:
            raise ValueError(
                f"a dataset record has no field {field!r}; set DataConfig.text_field to one of {sorted(record)}"
            )
        text = record[field]
        if isinstance(text, str) and text:
            yield text


def shard_records(dataset: IterableDataset, shard: int, num_shards: int) -> Iterable[dict[str, Any]]:
    """The records of one shard, in stored order; the shards of `num_shards` are disjoint."""
    if dataset.num_shards >= num_shards:
        # Whole files per shard: each reader skips nothing it downloads.
        return dataset.shard(num_shards=num_shards, index=shard, contiguous=False)
    return itertools.islice(dataset, shard, None, num_shards)


def buffer_shuffle(items: Iterable[str], buffer_size: int, rng: np.random.Generator) -> Iterator[str]:
    """A seeded shuffle through a buffer of `buffer_size` items (0 or 1: no shuffle)."""
    if buffer_size <= 1:
        yield from items
        return
    buffer: list[str] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        i = int(rng.integers(buffer_size))
        yield buffer[i]
        buffer[i] = item
    for i in rng.permutation(len(buffer)):
        yield buffer[int(i)]


def pack_windows(texts: Iterable[str], tokenizer: TextTokenizer, seq_len: int) -> Iterator[np.ndarray]:
    """Windows of `seq_len + 1` tokens, stride `seq_len`, over the texts joined by end-of-text."""
    pending = np.zeros(0, dtype=np.int64)
    texts = iter(texts)
    while chunk := list(itertools.islice(texts, _ENCODE_CHUNK)):
        ids = [np.asarray([*doc, tokenizer.eos_id], dtype=np.int64) for doc in tokenizer.encode_batch(chunk)]
        pending = np.concatenate([pending, *ids])
        count = max(0, (len(pending) - 1) // seq_len)
        for j in range(count):
            yield pending[j * seq_len : j * seq_len + seq_len + 1]
        # The last window's final token starts the next window.
        pending = pending[count * seq_len :]


def _epoch_texts(cfg: DataConfig, shard: int, num_shards: int, seed: int) -> Iterator[str]:
    dataset = open_split(cfg, cfg.split)
    for epoch in itertools.count():
        rng = np.random.default_rng([STREAM_TAG, seed, num_shards, shard, epoch])
        texts = _texts(shard_records(dataset, shard, num_shards), cfg.text_field)
        empty = True
        for text in buffer_shuffle(texts, cfg.shuffle_buffer, rng):
            empty = False
            yield text
        if empty:
            raise ValueError(
                f"shard {shard} of {num_shards} of {cfg.dataset!r} split {cfg.split!r} has no documents; "
                "use fewer shards or a larger dataset"
            )


def hub_train_batches(
    cfg: DataConfig,
    tokenizer: TextTokenizer,
    shard: int,
    num_shards: int,
    batch_size: int,
    seed: int,
    start_step: int = 0,
) -> Iterator[torch.Tensor]:
    """Endless LongTensor (batch_size, seq_len + 1) batches of one shard of a streaming dataset."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} of {num_shards}: need num_shards >= 1 and 0 <= shard < num_shards")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    windows = pack_windows(_epoch_texts(cfg, shard, num_shards, seed), tokenizer, cfg.seq_len)
    # Resume: skip the windows of the steps already taken (see the module docstring's limit).
    return _batched(itertools.islice(windows, start_step * batch_size, None), batch_size)


def _batched(windows: Iterator[np.ndarray], batch_size: int) -> Iterator[torch.Tensor]:
    # The window stream never ends (epochs repeat), so every batch is full.
    while True:
        yield torch.from_numpy(np.stack(list(itertools.islice(windows, batch_size))))


def hub_validation_windows(cfg: DataConfig, tokenizer: TextTokenizer) -> torch.Tensor:
    """LongTensor (N, seq_len + 1): the first `val_max_windows` windows of the validation split."""
    texts = _texts(open_split(cfg, cfg.val_split), cfg.text_field)
    windows = list(itertools.islice(pack_windows(texts, tokenizer, cfg.seq_len), cfg.val_max_windows))
    if not windows:
        raise ValueError(
            f"split {cfg.val_split!r} of {cfg.dataset!r} is shorter than one window of {cfg.seq_len + 1} tokens"
        )
    return torch.from_numpy(np.stack(windows))
