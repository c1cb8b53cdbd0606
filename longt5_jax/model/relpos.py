"""T5 relative-position buckets and the shared bias tables (one per stack, used by every layer)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from longt5_jax.kernels.by_distance import sum_by_distance
from longt5_jax.model.layers import logical_param, uniform_fan_avg


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
        return logical_param(
            self,
            "rel_embedding",
            uniform_fan_avg(),
            ("heads", "relpos_buckets"),
            (self.num_heads, self.num_buckets),
        )


def take_buckets(table_HR: jax.Array, buckets: jax.Array) -> jax.Array:
    """[H, *buckets.shape]: table[:, buckets].

    The gradient sums each bucket's cotangents as a float32 matmul with the buckets' one-hot
    (exact: products with 0 and 1). Autodiff of the gather would scatter-add them instead, every
    position into one of H x buckets entries on atomics (the decoder's 512 x 512 positions); and
    XLA fused the side table's sums by distance into that scatter, which then added all
    B*H*N*W*2G gathered values (docs/journal.md, "The bias tables' gradients"). Of the forms
    tried, this one moves the fewest HBM bytes (`bench roofline`): a masked
    reduction over the positions, or three bfloat16 products, moved more. A CPU keeps the
    gather's own gradient: it adds without atomics, and its programs stay as they were (an
    offloaded run equals the run on the device bitwise; any reformulation there, even the
    same scatter behind a custom gradient, moved XLA's fusions and one rounding of it).
    """
    return jax.lax.platform_dependent(
        table_HR, buckets,
        cpu=lambda t, b: jnp.take(t, b, axis=1),
        default=functools.partial(_take_buckets, table_HR.shape[1]),
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _take_buckets(num_buckets: int, table_HR: jax.Array, buckets: jax.Array) -> jax.Array:
    return jnp.take(table_HR, buckets, axis=1)


def _take_buckets_fwd(num_buckets, table_HR, buckets):
    return _take_buckets(num_buckets, table_HR, buckets), buckets


def _take_buckets_bwd(num_buckets, buckets, cotangent_HX):
    """Summed in float32 whatever the table's dtype (a half-precision run keeps its parameters,
    these tables included, in bfloat16 or float16): rounded once, into the cotangent's dtype."""
    onehot_PR = (buckets.reshape(-1, 1) == jnp.arange(num_buckets)).astype(jnp.float32)
    cotangent_HP = cotangent_HX.reshape(cotangent_HX.shape[0], -1).astype(jnp.float32)
    sums_HR = jnp.dot(cotangent_HP, onehot_PR, precision=jax.lax.Precision.HIGHEST)
    return sums_HR.astype(cotangent_HX.dtype), None


_take_buckets.defvjp(_take_buckets_fwd, _take_buckets_bwd)


def lookup(table_HR: jax.Array, buckets: jax.Array, heads_axis: int = -3) -> jax.Array:
    """table[:, buckets] with the heads axis moved to `heads_axis` (default: just before the last
    two bucket axes)."""
    return jnp.moveaxis(take_buckets(table_HR, buckets), 0, heads_axis)


def by_distance(table_HR: jax.Array, num_globals: int, num_buckets: int, max_distance: int):
    """[H, 2G] side bias of each distance g - q + G - 1 between a token's global block q (-1 for
    none) and a side key g: TGlobal's side bias depends on that alone."""
    distances = jnp.arange(2 * num_globals) - num_globals + 1
    buckets = relative_position_bucket(distances, True, num_buckets, max_distance)
    return take_buckets(table_HR, buckets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def shifted_rows(v_BHD: jax.Array, shift_BNW: jax.Array, cols: int) -> jax.Array:
    """[B, H, N, W, cols] with out[b, h, n, w, g] = v[b, h, g - shift[b, n, w] + cols], for
    shifts in [0, cols] (D = 2 cols).

    The gradient gathers instead of scattering: autodiff of the gather would scatter-add all
    B*H*L*G cotangents into the 2G*H entries of v, which on a GPU serialises on atomics (most of
    a 16k-token base step on an H100: docs/journal.md); here each entry of v sums the cotangents
    found at its distance along every row, a gather fused into a reduction.
    """
    index_BNWG = jnp.arange(cols) - shift_BNW[..., None] + cols
    return jax.vmap(lambda v_HD, index: jnp.take(v_HD, index, axis=1))(v_BHD, index_BNWG)


def _shifted_rows_fwd(v_BHD, shift_BNW, cols):
    return shifted_rows(v_BHD, shift_BNW, cols), shift_BNW


def _shifted_rows_bwd(cols, shift_BNW, cotangent_BHNWG):
    return sum_by_distance(cotangent_BHNWG, shift_BNW, cols), None


shifted_rows.defvjp(_shifted_rows_fwd, _shifted_rows_bwd)
