"""A pytree leaf's key path as names: dict keys, attribute names and indices, as strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

KeyPath = Sequence[Any]


def key_names(path: KeyPath) -> tuple[str, ...]:
    """('params', 'encoder', 'layers', ...): what `path` names, key by key."""
    return tuple(jax.tree_util.keystr((k,), simple=True) for k in path)


def path_text(path: KeyPath) -> str:
    """'params/encoder/layers/...', as checkpoints and tools name an array."""
    return "/".join(key_names(path))
