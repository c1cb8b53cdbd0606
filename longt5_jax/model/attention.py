"""Full multi-head attention for the decoder: causal self-attention and cross-attention.

Letter key: B batch, T query length, S key length, D embed, H heads, K head dim.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from longt5_jax.kernels import interface as kernels
from longt5_jax.kernels.dropout import dropout_scale
from longt5_jax.model.config import LongT5Config
from longt5_jax.model.layers import AttentionDropout, Projection, Rows, joined_product, normal

HEADS = ("batch", "length", "heads", "kv")
# A decoding step's self-attention kernels side by side (`blocks.joined_for_decoding`).
JOINED_QKV = "qkv_joined"
MASKED = -1e10  # both references use -1e10, not finfo.min; encoder outputs only match with it


def qkvo_projections(c: LongT5Config) -> tuple[Projection, Projection, Projection, Projection]:
    """Query, key, value and output kernels with T5X's initialisers."""
    qkv = functools.partial(
        Projection,
        shape=(c.num_heads, c.d_kv),
        in_axes=("embed",),
        out_axes=("heads", "kv"),
        dtype=c.compute_dtype,
    )
    # No 1/sqrt(d_kv) on the logits: T5 folds it into the query initialiser.
    return (
        qkv(kernel_init=normal((c.d_model * c.d_kv) ** -0.5)),
        qkv(kernel_init=normal(c.d_model**-0.5)),
        qkv(kernel_init=normal(c.d_model**-0.5)),
        Projection(
            (c.d_model,),
            ("heads", "kv"),
            ("embed",),
            normal((c.num_heads * c.d_kv) ** -0.5),
            c.compute_dtype,
        ),
    )


class Attention(nn.Module):
    """Bias-free multi-head attention with an additive bias; keys/values may come precomputed."""

    config: LongT5Config
    deterministic: bool

    def setup(self):
        self.query, self.key, self.value, self.out = qkvo_projections(self.config)
        self.dropout = AttentionDropout(self.config.dropout_rate, self.deterministic)

    def keys_values(self, x_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.has_variable("params", JOINED_QKV):
            _, k, v = self._joined(x_BSD)
            return nn.with_logical_constraint(k, HEADS), nn.with_logical_constraint(v, HEADS)
        k = nn.with_logical_constraint(self.key(x_BSD), HEADS)
        v = nn.with_logical_constraint(self.value(x_BSD), HEADS)
        return k, v

    def _queries(self, x_BTD: jax.Array) -> jax.Array:
        q = self._joined(x_BTD)[0] if self.has_variable("params", JOINED_QKV) else self.query(x_BTD)
        return nn.with_logical_constraint(q, HEADS)

    def _joined(self, x_BTD: jax.Array) -> tuple[jax.Array, ...]:
        """Queries, keys and values by one product with the kernels side by side (a decoding
        step's self-attention: `blocks.joined_for_decoding`). The keys' caller and the queries'
        multiply the same operands, which XLA computes once."""
        out = joined_product(self, JOINED_QKV, x_BTD, self.config.compute_dtype)  # [B, T, 3, H, K]
        return out[:, :, 0], out[:, :, 1], out[:, :, 2]

    def __call__(
        self,
        x_BTD: jax.Array,
        k: jax.Array,
        v: jax.Array,
        mask_BTS: jax.Array,
        bias_HTS: jax.Array | None = None,
        rows: Rows | None = None,
        cached: bool = False,
        layouts: tuple[str, str] = ("bshk", "bshk"),
    ) -> jax.Array:
        """Attention of x's queries over keys and values that lie as `layouts` says: [B, S, H, K]
        ('bshk', as `keys_values` makes them) or as a decoding cache holds them, where a step
        reads them in place (`cache.cross_layouts`)."""
        c = self.config
        q_BTHK = self._queries(x_BTD)
        seed = self.dropout(rows)
        # Cached decoding (one query a step, or a document's beams) stays on XLA: there is no
        # score tensor to save.
        if kernels.fused(c) and not cached and q_BTHK.shape[1] > 1:
            assert layouts == ("bshk", "bshk")  # other layouts are a decoding cache's
            dropout = None
            if seed is not None:
                assert rows is not None  # a seed is drawn only for rows (AttentionDropout)
                dropout = (seed, rows.ids, c.dropout_rate)
            out_BTHK = kernels.decoder_attention(
                q_BTHK, k, v, mask_BTS, bias_HTS=bias_HTS, dropout=dropout
            )
            return self.out(nn.with_logical_constraint(out_BTHK, HEADS))
        # A cached step's few queries (a document's beams) against many keys: products and sums,
        # which XLA reads each layer's keys and values for in place; as a matmul it would first
        # copy them into its operand layout, every step (`estimate.decode_bytes`).
        few = cached and q_BTHK.shape[1] > 1
        keys, values = layouts
        # Logits and softmax in float32 whatever the compute dtype.
        if few:
            logits_BHTS = _summed_products(f"bthk,{keys}->bhts", q_BTHK, k, _order(keys))
        else:
            logits_BHTS = _einsum_f32(f"bthk,{keys}->bhts", q_BTHK, k)
        if bias_HTS is not None:
            logits_BHTS = logits_BHTS + bias_HTS
        logits_BHTS = logits_BHTS + jnp.where(mask_BTS, 0.0, MASKED)[:, None]
        probs = jax.nn.softmax(logits_BHTS, axis=-1)
        if seed is not None:
            assert rows is not None  # a seed is drawn only for rows (AttentionDropout)
            _, h, t, s = probs.shape
            row, head = rows.ids[:, None, None, None], jnp.arange(h)[:, None, None]
            query, key = jnp.arange(t)[:, None], jnp.arange(s)
            scale = dropout_scale(seed, row, head, query=query, key=key, rate=c.dropout_rate)
            probs = probs * scale
        probs = probs.astype(c.compute_dtype)
        if few:
            # Written in the compute dtype: XLA left the softmax's float32 output to convert.
            probs = jax.lax.optimization_barrier(probs)
            out = _summed_products(f"bhts,{values}->bthk", probs, v, _order(values))
            out = out.astype(c.compute_dtype)
        else:
            out = jnp.einsum(f"bhts,{values}->bthk", probs, v)
        out_BTHK = nn.with_logical_constraint(out, HEADS)
        return self.out(out_BTHK)


def _order(layout: str) -> str:
    """Summed products' order over keys or values lying in `layout`: the batch, heads and
    queries, then the operand's own dimensions."""
    return "bht" + layout.replace("b", "").replace("h", "")


def _einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _summed_products(spec: str, a: jax.Array, b: jax.Array, order: str) -> jax.Array:
    """einsum(spec, a, b) in float32 as broadcast products summed: the same sums (a product of
    two compute-dtype values is exact in float32), which XLA fuses with reading its operands.
    The products lie in `order`, the keys' and values' own: in another, XLA transposed a copy
    of the values each layer and step."""
    ins, out = spec.split("->")
    left, right = ins.split(",")
    f32 = jnp.float32

    def spread(x: jax.Array, have: str) -> jax.Array:
        x = jnp.einsum(f"{have}->{''.join(c for c in order if c in have)}", x.astype(f32))
        return jnp.expand_dims(x, [i for i, c in enumerate(order) if c not in have])

    contracted = tuple(i for i, c in enumerate(order) if c not in out)
    summed = jnp.sum(spread(a, left) * spread(b, right), axis=contracted)
    kept = "".join(c for c in order if c in out)
    return jnp.einsum(f"{kept}->{out}", summed)
