"""LongT5 in Flax Linen, written with logical axis names only."""

from longt5_jax.model.cache import init_cache
from longt5_jax.model.config import LongT5Config
from longt5_jax.model.transformer import LongT5, abstract_params, count_params, init_params

__all__ = [
    "LongT5",
    "LongT5Config",
    "abstract_params",
    "count_params",
    "init_cache",
    "init_params",
]
