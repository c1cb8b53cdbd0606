"""Cotangents summed by relative distance: the transpose of `model.relpos.shifted_rows`, which
the XLA path's gradient and the side-bias gradient kernel (`encoder_grad`) both take."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sum_by_distance(cotangent_BHNWG: jax.Array, shift_BNW: jax.Array, cols: int) -> jax.Array:
    """[B, H, 2 cols]: the transpose of `shifted_rows`, each distance's cotangents summed."""
    index_BNWD = jnp.arange(2 * cols) + shift_BNW[..., None] - cols
    index_BNWD = jnp.where(index_BNWD < 0, cols, index_BNWD)  # negative would count from the end
    found_BHNWD = jnp.take_along_axis(
        cotangent_BHNWG, index_BNWD[:, None], axis=-1, mode="fill", fill_value=0
    )
    return found_BHNWD.sum((2, 3))
