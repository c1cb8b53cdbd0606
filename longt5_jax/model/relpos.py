"""T5 relative-position buckets and the shared bias tables (one per stack, used by every layer)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from longt5_jax.model.layers import uniform_fan_avg


def relative_position_bucket(
    rel: jax.Array, bidirectional: bool, num_buckets: int, max_distance: int
) -> jax.Array:
    """Mesh-TF bucketing of rel = memory_position - query_position.

    Half the buckets are exact distances, the rest logarithmic up to max_distance. In bidirectional
    mode keys after the query use the upper half. The float32 epsilon inside the log is
    flaxformer's: it keeps distances that are exact powers of two (16, 32, 64) from falling into
    the bucket below when the device log rounds down.
    """
    ret = jnp.zeros_like(rel)
    n = -rel
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n < 0).astype(rel.dtype) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    eps = np.finfo(np.float32).eps
    log_ratio = jnp.log(n.astype(jnp.float32) / max_exact + eps) / np.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(rel.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return ret + jnp.where(n < max_exact, n, large)


class RelposTable(nn.Module):
    """A learned bias per (head, bucket): T5X's `rel_embedding`, shared by all layers of a stack."""

    num_heads: int
    num_buckets: int

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param(
            "rel_embedding",
            nn.with_logical_partitioning(uniform_fan_avg(), ("heads", "relpos_buckets")),
            (self.num_heads, self.num_buckets),
            jnp.float32,
        )


def lookup(table_HR: jax.Array, buckets: jax.Array, heads_axis: int = -3) -> jax.Array:
    """table[:, buckets] with the heads axis moved to `heads_axis` (default: just before the last
    two bucket axes)."""
    bias = jnp.take(table_HR, buckets, axis=1)  # [H, *buckets.shape]
    return jnp.moveaxis(bias, 0, heads_axis)
