"""How many global batches one pass over a split serves, in the loaders' window layout (data/reader.py's
module docstring): plain arithmetic, importable without NumPy (the verdict's rules, which `--help` lists,
count passes with it)."""

from __future__ import annotations


def batches_per_pass(split_tokens: int, seq_len: int, windows_per_batch: int) -> int:
    """Global batches of `windows_per_batch` windows that one pass over a split of `split_tokens` tokens
    serves (the incomplete tail dropped): the loaders' pass, and what the plan and the verdict count passes
    in (a mixture's source restarts alone, by its windows: `windows_per_batch` 1)."""
    windows = (split_tokens - 1) // seq_len if split_tokens > seq_len else 0
    return windows // windows_per_batch
