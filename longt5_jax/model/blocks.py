"""One encoder layer and one decoder layer: what the stacks scan over.

Letter key: B batch, L encoder length, T decoder length, S key length, D embed.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from longt5_jax.model.attention import JOINED_QKV, Attention
from longt5_jax.model.cache import SELF_LAYOUTS, Cache, ancestral, cross_layouts, laid_out
from longt5_jax.model.config import LongT5Config
from longt5_jax.model.layers import JOINED_WI, MLP, Dropout, RMSNorm, Rows, clamp_float16
from longt5_jax.model.long_attention import GlobalBlocks, LongSelfAttention

EMBED = ("batch", "length", "embed")


def rows_of(row_ids: jax.Array | None, layer: jax.Array | int = 0) -> Rows | None:
    return None if row_ids is None else Rows(row_ids, layer)


class EncoderLayer(nn.Module):
    """Pre-norm long self-attention and gated-GELU MLP, each with a residual."""

    config: LongT5Config
    deterministic: bool

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        layer: jax.Array,
        row_ids: jax.Array | None,
        segment_ids: jax.Array,
        local_bias_HWX: jax.Array,
        blocks: GlobalBlocks | None,
        side_table_HR: jax.Array | None,
    ):
        c, det, rows = self.config, self.deterministic, rows_of(row_ids, layer)
        norm = functools.partial(RMSNorm, eps=c.layer_norm_eps, dtype=c.compute_dtype)
        h = norm(name="pre_attention_layer_norm")(x)
        h = LongSelfAttention(c, det, name="attention")(
            h, segment_ids, local_bias_HWX, blocks, side_table_HR, rows
        )
        x = clamp_float16(x + Dropout(c.dropout_rate, det)(h, rows))
        h = MLP(c, det, name="mlp")(norm(name="pre_mlp_layer_norm")(x), rows)
        x = clamp_float16(x + Dropout(c.dropout_rate, det)(h, rows))
        return nn.with_logical_constraint(x, EMBED), None


class DecoderLayer(nn.Module):
    """Pre-norm causal self-attention, cross-attention and MLP; may read a KV cache.

    With a cache (every layer's, whole: the stack passes it to each layer unscanned), the layer
    reads its own slices and returns only what is new: this call's keys and values, and the
    cross-attention keys and values on the call that computes them. The decoder writes the new
    keys into the cache once for all layers, in place, so a step moves neither the self-attention
    cache it appends to nor the cross-attention keys it only reads.
    """

    config: LongT5Config
    deterministic: bool

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        layer: jax.Array,
        cache: Cache | None,
        row_ids: jax.Array | None,
        encoded: jax.Array,
        self_mask: jax.Array,
        self_bias_HTS: jax.Array,
        cross_mask: jax.Array,
        cache_index: jax.Array,
    ):
        c, det, rows = self.config, self.deterministic, rows_of(row_ids, layer)
        norm = functools.partial(RMSNorm, eps=c.layer_norm_eps, dtype=c.compute_dtype)
        h = norm(name="pre_self_attention_layer_norm")(x)
        attn = Attention(c, det, name="self_attention")
        k, v = attn.keys_values(h)
        new: Cache | None = None
        self_layouts = ("bshk", "bshk")
        if cache is not None:
            self_layouts = SELF_LAYOUTS
            k, v = laid_out(k, v, self_layouts)
            new = dict(self_k=k, self_v=v)
            k, v = (
                jax.lax.dynamic_update_slice_in_dim(
                    cache[name][:, layer], a, cache_index, axis=layout.index("s")
                )
                for name, a, layout in zip(("self_k", "self_v"), (k, v), self_layouts, strict=True)
            )
            if "self_rows" in cache:  # a beam search's: each position read from its row
                k, v = (
                    ancestral(a, cache["self_rows"], layout)
                    for a, layout in zip((k, v), self_layouts, strict=True)
                )
        h = attn(h, k, v, self_mask, self_bias_HTS, rows, cache is not None, self_layouts)
        x = clamp_float16(x + Dropout(c.dropout_rate, det)(h, rows))

        h = norm(name="pre_cross_attention_layer_norm")(x)
        cross = Attention(c, det, name="encoder_decoder_attention")
        if cache is not None and "cross_k" in cache:
            ck, cv = cache["cross_k"][layer], cache["cross_v"][layer]
        else:  # Training, or the first decoding step, which fills the cross-attention cache.
            ck, cv = cross.keys_values(encoded)
            if new is not None:
                ck, cv = laid_out(ck, cv, cross_layouts(x.shape[0] // encoded.shape[0]))
                new |= dict(cross_k=ck, cross_v=cv)
        h = _cross_attention(cross, h, ck, cv, cross_mask, rows, cache is not None)
        x = clamp_float16(x + Dropout(c.dropout_rate, det)(h, rows))

        h = MLP(c, det, name="mlp")(norm(name="pre_mlp_layer_norm")(x), rows)
        x = clamp_float16(x + Dropout(c.dropout_rate, det)(h, rows))
        x = nn.with_logical_constraint(x, EMBED)
        return x, new


def joined_for_decoding(layers: dict) -> dict:
    """The decoder layers' parameters (stacked, layers first) with the kernels a decoding step
    multiplies by the same input also side by side, as `Attention` and `MLP` then read them: the
    self-attention's queries, keys and values, the MLP's two input kernels. A step's token
    multiplies each group in one matrix-vector product, which XLA:CPU shares out over its
    threads; each kernel alone is too small to be, and was read on one."""
    attention, mlp = layers["self_attention"], layers["mlp"]
    qkv = jnp.stack([attention[name]["kernel"] for name in ("query", "key", "value")], axis=2)
    wi = jnp.concatenate([mlp["wi_0"]["kernel"], mlp["wi_1"]["kernel"]], axis=-1)
    return {
        **layers,
        "self_attention": {**attention, JOINED_QKV: qkv},
        "mlp": {**mlp, JOINED_WI: wi},
    }


def _cross_attention(
    cross: Attention,
    h_BTD: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask_BTS: jax.Array,
    rows: Rows | None,
    cached: bool,
) -> jax.Array:
    """Cross-attention over keys and values [B, S, H, K] (cached: `cache.cross_layouts`);
    decoder rows that are beams (N a document, the document's keys once: [B, ...] against
    [B * N, ...] queries) attend as N times the queries of their document, so a beam search
    reads each document's keys and values once a step, not once a beam."""
    b, bn = k.shape[0], h_BTD.shape[0]
    layouts = cross_layouts(bn // b) if cached else ("bshk", "bshk")
    attend = functools.partial(cross, rows=rows, cached=cached, layouts=layouts)
    if b == bn:
        return attend(h_BTD, k, v, mask_BTS)
    folded = h_BTD.reshape(b, bn // b * h_BTD.shape[1], h_BTD.shape[2])
    return attend(folded, k, v, mask_BTS).reshape(h_BTD.shape)
