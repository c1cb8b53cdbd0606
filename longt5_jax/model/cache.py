"""The decoding cache: what it holds for each layer, in which layout, and how a step updates it.

A cache is every layer's self-attention keys and values (`init_cache`, appended a position a
step) and, from the first step on, the documents' cross-attention keys and values. Each lies as
a step reads it (`Attention`'s layouts), where XLA reads it in place: in any other layout a step
copied each layer's keys or values every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longt5_jax.model.config import LongT5Config

Cache = dict[str, jax.Array]


# How a decoding cache holds each layer's self-attention keys and values (`Attention`'s
# layouts) after the rows and the layers: heads first and the keys positions minor, as one
# query's matmuls read them in place on XLA:CPU (as [B, T, H, K] it copied each layer's keys
# every token; `bench decode`'s CPU profile).
SELF_LAYOUTS = ("bhks", "bhsk")


def cross_layouts(beams: int) -> tuple[str, str]:
    """How a decoding cache holds a layer's cross-attention keys and values (`Attention`'s
    layouts): heads first, so that a step reads them where they lie. One query a document
    attends by matmuls, which on XLA:CPU take the keys positions minor; a document's beams by
    products summed over the minor dimension, which a GPU's fusions read in place only with the
    head dimension minor. In any other layout a step copied each layer's keys or values every
    token (`estimate.decode_bytes`; CPU profiles of `bench decode`)."""
    return ("bhks" if beams == 1 else "bhsk"), "bhsk"


def init_cache(config: LongT5Config, batch: int, max_length: int) -> Cache:
    """An empty self-attention KV cache of `max_length` positions (cross keys come later).

    Rows outermost, then the layers, each as `SELF_LAYOUTS` says.
    """
    sizes = dict(b=batch, h=config.num_heads, k=config.d_kv, s=max_length)
    return {
        name: jnp.zeros(
            (batch, config.num_decoder_layers, *(sizes[d] for d in layout[1:])),
            config.compute_dtype,
        )
        for name, layout in zip(("self_k", "self_v"), SELF_LAYOUTS, strict=True)
    }


def laid_out(k: jax.Array, v: jax.Array, layouts: tuple[str, str]) -> tuple[jax.Array, ...]:
    """Keys and values [B, S, H, K] (as `Attention.keys_values` makes them) in `layouts`."""
    return tuple(jnp.einsum(f"bshk->{to}", x) for x, to in zip((k, v), layouts, strict=True))


def cache_length(cache: Cache) -> int:
    """The positions a decoding cache holds."""
    return cache["self_v"].shape[1 + SELF_LAYOUTS[1].index("s")]


def updated(cache: Cache, new: Cache, index: jax.Array) -> Cache:
    """The cache with every layer's new keys and values ([layers, B, ...] from the layers' scan)
    written at `index` (in place, inside a decoding loop), and the cross-attention keys and
    values when this step made them."""
    out = dict(cache)
    for name, layout in zip(("self_k", "self_v"), SELF_LAYOUTS, strict=True):
        rows_first = jnp.swapaxes(new[name], 0, 1)
        at = 1 + layout.index("s")  # the positions' axis, after the rows' and the layers'
        out[name] = jax.lax.dynamic_update_slice_in_dim(cache[name], rows_first, index, axis=at)
    for name in ("cross_k", "cross_v"):
        if name in new:
            out[name] = new[name]
    return out


def with_ancestry(cache: Cache) -> Cache:
    """The cache of a beam search: rows stay where they are, and `self_rows` [R, T] says which
    row holds each position of a row's hypothesis (at first its own). A reorder rewrites the
    table, not the cache; a step reads its keys through it (`ancestral`)."""
    rows, length = cache["self_v"].shape[0], cache_length(cache)
    own = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], (rows, length))
    return {**cache, "self_rows": own}


def reordered(cache: Cache, order: jax.Array, index: jax.Array) -> Cache:
    """A beam search's cache after row r continues row order[r]'s hypothesis: the table's
    positions up to `index` as the parent's, those after it the row's own."""
    rows_RT = cache["self_rows"]
    later = jnp.arange(rows_RT.shape[1])[None, :] > index
    own = jnp.arange(rows_RT.shape[0], dtype=jnp.int32)[:, None]
    return {**cache, "self_rows": jnp.where(later, own, jnp.take(rows_RT, order, axis=0))}


def ancestral(x: jax.Array, rows_RT: jax.Array, layout: str) -> jax.Array:
    """x (one layer's keys or values, rows first, in `layout`) with each row's position p read
    from row rows_RT[r, p]."""
    at = layout.index("s")
    moved = jnp.moveaxis(x, at, 1)  # [R, T, ...]
    gathered = moved[rows_RT, jnp.arange(rows_RT.shape[1])[None, :]]
    return jnp.moveaxis(gathered, 1, at)
