"""Data: record sources, the embedded ACLSum task, tokenizers, objectives and batching."""

import os
from pathlib import Path

from longt5_jax.errors import UsageError


class DataError(UsageError):
    """Bad input data or paths, in one line naming the file, the place in it and the field."""


def cache_dir() -> Path:
    """Where derived files (trained tokenizers, decompressed JSONL) are kept: $LONGT5_JAX_CACHE."""
    return Path(os.environ.get("LONGT5_JAX_CACHE") or Path.home() / ".cache" / "longt5_jax")
