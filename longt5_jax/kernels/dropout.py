"""Attention dropout as a counter-based hash, the same bits in XLA's attention and in every
kernel; a kernel's dropout inputs and its dropped-out gradient."""

from __future__ import annotations

from typing import Any, Generic, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from longt5_jax.kernels import call

# What a kernel's record holds: its arrays, their block specs, their logical axes or their refs.
T = TypeVar("T")


def _int32(x: int) -> np.int32:
    return np.uint32(x).view(np.int32)


# lowbias32 (C. Wellons' hash prospector) multipliers and odd constants spreading each counter.
_MIX = (_int32(0x7FEB352D), _int32(0x846CA68B))
_SPREAD = (_int32(0x9E3779B1), _int32(0x85EBCA77), _int32(0xC2B2AE3D))
# Side keys are counted from here, apart from token positions (< 2^30).
SIDE_KEYS = 1 << 30


def _mix32(x: jax.Array) -> jax.Array:
    """A bijective avalanche of 32 bits, in int32 (wrapping products, logical shifts) so that
    XLA and a Triton kernel compute the same bits."""
    srl = jax.lax.shift_right_logical
    x = (x ^ srl(x, 16)) * _MIX[0]
    x = (x ^ srl(x, 15)) * _MIX[1]
    return x ^ srl(x, 16)


def attention_keep(seed, row, head, *, query, key, rate: float) -> jax.Array:
    """Attention dropout as a counter-based hash: element (row, head, query, key) of a layer is
    kept iff the top 24 bits of a hash of those and the layer's seed clear rate * 2^24. Any
    device, layout or kernel computes the same mask for the same element (rows are global row
    ids, heads global head ids, queries and keys token positions or SIDE_KEYS + g); arguments
    broadcast, int32."""
    per_head = _mix32(seed ^ _mix32(row * _SPREAD[0] + head))
    per_query = _mix32(per_head ^ (query * _SPREAD[1]))
    bits = _mix32(per_query ^ (key * _SPREAD[2]))
    return jax.lax.shift_right_logical(bits, 8) >= int(round(rate * (1 << 24)))


def dropout_scale(seed, row, head, *, query, key, rate: float) -> jax.Array:
    """float32 1 / (1 - rate) where `attention_keep` keeps, else 0."""
    keep = attention_keep(seed, row, head, query=query, key=key, rate=rate)
    return jnp.where(keep, 1.0 / (1.0 - rate), 0.0).astype(jnp.float32)


class Drop(NamedTuple, Generic[T]):
    """Attention dropout's inputs to a kernel (`attention_keep`)."""

    seed: T  # [1] int32, the layer's
    rows: T  # [B] int32, global row ids
    heads: T  # [H] int32, global head ids (a device holds some heads)

    @classmethod
    def of(cls, seed: jax.Array, rows: jax.Array, heads: int) -> Drop[jax.Array]:
        """A layer's int32 seed, the rows' global ids and the call's `heads` (all global)."""
        seed = jnp.reshape(seed, (1,)).astype(jnp.int32)
        return Drop(seed, rows.astype(jnp.int32), jnp.arange(heads, dtype=jnp.int32))


DROP_AXES = [(None,), ("batch",), ("heads",)]


def whole_drop(drop: Drop | None) -> Drop[pl.BlockSpec] | None:
    """The dropout's block specs (its arrays whole), None without dropout."""
    return None if drop is None else Drop(call.whole(), call.whole(), call.whole())


def drop_scale(rate: float, drop: Drop[Any] | None, b, h, *, queries, keys):
    """[Q, C] dropout scale of `queries` x `keys` (token positions) of row b, head h, from the
    `drop` refs, or None without dropout."""
    if not rate:
        return None
    assert drop is not None  # a kernel takes the dropout's refs wherever its rate is set
    row, head = drop.rows[b], drop.heads[h]
    return dropout_scale(
        drop.seed[0], row, head, query=queries[:, None], key=keys[None, :], rate=rate
    )


def dropped_grad(p, dp, delta, scale):
    """dS of dropped-out attention: p * (scale * dP - delta)."""
    return p * ((dp if scale is None else dp * scale) - delta[:, None])
