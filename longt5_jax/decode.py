"""Greedy decoding with a key/value cache: the encoder runs once, then one token per step."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from longt5_jax.model import LongT5, init_cache


@functools.partial(jax.jit, static_argnames=("model", "max_length"))
def greedy_decode(
    model: LongT5, params: Any, input_ids: jax.Array, attention_mask: jax.Array, max_length: int
) -> jax.Array:
    """[B, max_length] greedy continuation of the decoder start token; pad after each EOS."""
    c = model.config
    variables = {"params": params}
    b = input_ids.shape[0]
    encoded = model.apply(variables, input_ids, attention_mask, method=LongT5.encode)

    def step(token, cache, index):
        logits, cache = model.apply(
            variables,
            encoded,
            attention_mask,
            token[:, None],
            cache=cache,
            cache_index=index,
            method=LongT5.decode,
        )
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    start = jnp.full((b,), c.decoder_start_id, jnp.int32)
    # The first step also fills the cross-attention keys and values into the cache.
    first, cache = step(start, init_cache(c, b, max_length), 0)
    out = jnp.zeros((b, max_length), jnp.int32).at[:, 0].set(first)

    def body(i, carry):
        out, cache, done = carry
        token, cache = step(out[:, i - 1], cache, i)
        done = done | (out[:, i - 1] == c.eos_id)
        out = out.at[:, i].set(jnp.where(done, c.pad_id, token))
        return out, cache, done

    out, _, _ = jax.lax.fori_loop(1, max_length, body, (out, cache, jnp.zeros((b,), bool)))
    return out
