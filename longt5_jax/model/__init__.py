"""LongT5 in Flax Linen, written with logical axis names only."""

from longt5_jax.model.config import LongT5Config
from longt5_jax.model.transformer import LongT5, count_params, init_cache

__all__ = ["LongT5", "LongT5Config", "count_params", "init_cache"]
