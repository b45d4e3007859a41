"""Flags that make any `noloco` run small enough for a test on 2 CPU cores."""

SMALL_RUN = [
    "--set",
    "model.seq_len=32",
    "--set",
    "inner.batch_size=2",
    "--set",
    "eval_windows=4",
    "--threads",
    "1",
]
