"""Encoder and decoder stacks (scanned over a leading `layers` axis) and the LongT5 model.

Letter key: B batch, L encoder length, T decoder length, S key length, D embed, V vocab.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from longt5_jax.model import relpos, stack
from longt5_jax.model.blocks import DecoderLayer, EncoderLayer, rows_of
from longt5_jax.model.cache import Cache, cache_length, updated
from longt5_jax.model.config import LongT5Config
from longt5_jax.model.layers import (
    Dropout,
    Embed,
    Projection,
    RMSNorm,
    truncated_normal_fan_in,
)
from longt5_jax.model.long_attention import GlobalBlocks, global_blocks, local_bias


class EncoderRowInputs(NamedTuple):
    """An encoder layer's inputs with a leading batch axis: a pipeline splits them into
    microbatches that follow their rows through the stages."""

    row_ids: jax.Array | None  # [B]; None when deterministic
    segment_ids: jax.Array  # [B, L]
    blocks: GlobalBlocks | None  # transient-global attention only


class EncoderSharedInputs(NamedTuple):
    """An encoder layer's inputs every row reads, whole on every stage."""

    local_bias_HWX: jax.Array
    side_table_HR: jax.Array | None  # transient-global attention only


class DecoderRowInputs(NamedTuple):
    """A decoder layer's inputs with a leading batch axis (for a runner, the masks broadcast to
    it): a pipeline splits them into microbatches that follow their rows through the stages."""

    row_ids: jax.Array | None  # [B]; None when deterministic
    encoded: jax.Array  # [B, L, D]
    self_mask: jax.Array
    cross_mask: jax.Array


class DecoderSharedInputs(NamedTuple):
    """A decoder layer's inputs every row reads, whole on every stage."""

    self_bias_HTS: jax.Array
    cache_index: jax.Array


# The layers' arguments after the layer index (and the decoder's cache), in their order.
_ENCODER_ARGS = ("row_ids", "segment_ids", "local_bias_HWX", "blocks", "side_table_HR")
_DECODER_ARGS = ("row_ids", "encoded", "self_mask", "self_bias_HTS", "cross_mask", "cache_index")


def _layer_args(rows: NamedTuple, shared: NamedTuple, names: tuple[str, ...]) -> tuple:
    """A layer's arguments `names`, each read by name from the rows' or the shared inputs."""
    return tuple(getattr(rows if n in rows._fields else shared, n) for n in names)


class Encoder(nn.Module):
    config: LongT5Config
    runner: stack.StackRunner | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        deterministic: bool,
        row_ids: jax.Array | None = None,
    ) -> jax.Array:
        c = self.config
        table_HR = relpos.RelposTable(c.num_heads, c.relpos_buckets, name="relpos_bias")()
        local_bias_HWX = local_bias(c, table_HR)
        blocks = side_table_HR = None
        if c.attention == "transient-global":
            blocks = global_blocks(segment_ids, positions, c.global_block_size)
            side_table_HR = relpos.RelposTable(
                c.num_heads, c.relpos_buckets, name="side_relpos_bias"
            )()
        x = Dropout(c.dropout_rate, deterministic)(x, rows_of(row_ids))
        in_axes = (0,) + (nn.broadcast,) * 5
        layers = stack.scanned(
            EncoderLayer, c, c.num_encoder_layers, in_axes, deterministic, "layers"
        )
        rows = EncoderRowInputs(row_ids, segment_ids, blocks)
        shared = EncoderSharedInputs(local_bias_HWX, side_table_HR)
        if self.is_initializing():
            x, _ = layers(
                x, jnp.arange(c.num_encoder_layers), *_layer_args(rows, shared, _ENCODER_ARGS)
            )
        else:

            def call(apply, h, rows, shared):
                return apply(h, *_layer_args(rows, shared, _ENCODER_ARGS))

            x = stack.run(
                self,
                layers,
                EncoderLayer,
                in_axes,
                self.runner or stack.WholeStack(),
                deterministic,
                call,
                x,
                rows,
                shared,
            )
        x = RMSNorm(c.layer_norm_eps, c.compute_dtype, name="encoder_norm")(x)
        return Dropout(c.dropout_rate, deterministic)(x, rows_of(row_ids))


class Decoder(nn.Module):
    config: LongT5Config
    runner: stack.StackRunner | None = None

    @nn.compact
    def __call__(
        self,
        y: jax.Array,
        encoded: jax.Array,
        self_mask: jax.Array,
        cross_mask: jax.Array,
        cache: Cache | None,
        cache_index: jax.Array,
        deterministic: bool,
        row_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        c = self.config
        table_HR = relpos.RelposTable(c.num_heads, c.relpos_buckets, name="relpos_bias")()
        bias_HTS = _decoder_bias(c, table_HR, self_mask.shape[-1], cache_index, y.shape[1])
        y = Dropout(c.dropout_rate, deterministic)(y, rows_of(row_ids))
        # The cache reaches every layer whole (a scan would rewrite it into its outputs each
        # step); a decoding step's layers are unrolled, to read their weights where they lie
        # (`infer.decode._stepper`), not sliced into copies.
        in_axes, unrolled = (0,) + (nn.broadcast,) * 7, True if cache is not None else None
        layers = stack.scanned(
            DecoderLayer, c, c.num_decoder_layers, in_axes, deterministic, "layers", unrolled
        )
        shared = DecoderSharedInputs(bias_HTS, cache_index)
        if cache is not None or self.is_initializing():
            rows = DecoderRowInputs(row_ids, encoded, self_mask, cross_mask)
            args = _layer_args(rows, shared, _DECODER_ARGS)
            y, new = layers(y, jnp.arange(c.num_decoder_layers), cache, *args)
            cache = None if cache is None else updated(cache, new, cache_index)
        else:  # training: the encoder output follows each microbatch to every stage

            def call(apply, h, rows, shared):
                return apply(h, None, *_layer_args(rows, shared, _DECODER_ARGS))

            def per_row(mask):  # split into microbatches with the rows it masks
                return jnp.broadcast_to(mask, (y.shape[0], *mask.shape[1:]))

            rows = DecoderRowInputs(row_ids, encoded, per_row(self_mask), per_row(cross_mask))
            runner = self.runner or stack.WholeStack()
            y = stack.run(
                self, layers, DecoderLayer, in_axes, runner, deterministic, call, y, rows, shared
            )
        y = RMSNorm(c.layer_norm_eps, c.compute_dtype, name="decoder_norm")(y)
        y = Dropout(c.dropout_rate, deterministic)(y, rows_of(row_ids))
        # The output projection is untied from the embedding and runs in float32.
        logits = Projection(
            (c.vocab_size,),
            ("embed",),
            ("vocab",),
            truncated_normal_fan_in(),
            jnp.float32,
            name="logits_dense",
        )(y)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab")), cache


def _decoder_bias(
    c: LongT5Config, table_HR: jax.Array, num_keys: int, cache_index: jax.Array, length: int
) -> jax.Array:
    """[H, T, S] relative-position bias of `length` queries from `cache_index` on."""
    rel_TS = jnp.arange(num_keys)[None, :] - (cache_index + jnp.arange(length))[:, None]
    buckets = relpos.relative_position_bucket(
        rel_TS, False, c.relpos_buckets, c.relpos_max_distance
    )
    return relpos.lookup(table_HR, buckets)


def _encoder_segments(
    attention_mask: jax.Array | None,
    segment_ids: jax.Array | None,
    positions: jax.Array | None,
    shape: tuple[int, ...],
):
    """(segment_ids, positions) for an unpacked batch (from the mask) or a packed one (as given)."""
    if segment_ids is None:
        mask = jnp.ones(shape, jnp.int32) if attention_mask is None else attention_mask
        mask = mask.astype(jnp.int32)
        return mask, jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    if positions is None:
        raise ValueError("packed inputs: encoder_segment_ids given without encoder_positions")
    if attention_mask is not None:
        segment_ids = jnp.where(attention_mask > 0, segment_ids, 0)
    return segment_ids.astype(jnp.int32), positions.astype(jnp.int32)


def _row_ids(row_ids: jax.Array | None, batch: int, deterministic: bool) -> jax.Array | None:
    if deterministic:
        return None
    return jnp.arange(batch, dtype=jnp.int32) if row_ids is None else row_ids


class LongT5(nn.Module):
    """LongT5: `apply({'params': p}, input_ids, attention_mask, decoder_input_ids)` -> logits.

    Packed rows pass `encoder_segment_ids`/`encoder_positions` and `decoder_segment_ids`
    (0 = padding, segments contiguous, positions restarting at 0 in each segment). With dropout
    (`deterministic=False`), `row_ids` [B] are the rows' indices in the global batch (default
    0..B-1): each row's masks are drawn from its index, not from where the row is computed.
    """

    config: LongT5Config
    # Runs the encoder and decoder stacks instead of a scan (the pipeline; training only).
    runner: stack.StackRunner | None = None

    def setup(self):
        self.token_embedder = Embed(self.config)
        self.encoder = Encoder(self.config, self.runner)
        self.decoder = Decoder(self.config, self.runner)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None,
        decoder_input_ids: jax.Array,
        decoder_attention_mask: jax.Array | None = None,
        *,
        encoder_segment_ids: jax.Array | None = None,
        encoder_positions: jax.Array | None = None,
        decoder_segment_ids: jax.Array | None = None,
        deterministic: bool = True,
        row_ids: jax.Array | None = None,
    ) -> jax.Array:
        if (encoder_segment_ids is None) != (decoder_segment_ids is None):
            raise ValueError(
                "packed inputs need both encoder_segment_ids and decoder_segment_ids, or neither"
            )
        segment_ids, positions = _encoder_segments(
            attention_mask, encoder_segment_ids, encoder_positions, input_ids.shape
        )
        encoded = self.encode(
            input_ids,
            segment_ids=segment_ids,
            positions=positions,
            deterministic=deterministic,
            row_ids=row_ids,
        )
        logits, _ = self.decode(
            encoded,
            segment_ids,
            decoder_input_ids,
            decoder_attention_mask,
            decoder_segment_ids=decoder_segment_ids,
            deterministic=deterministic,
            row_ids=row_ids,
        )
        return logits

    def encode(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        deterministic: bool = True,
        row_ids: jax.Array | None = None,
    ) -> jax.Array:
        """[B, L, D] encoder output (after the final norm)."""
        segment_ids, positions = _encoder_segments(
            attention_mask, segment_ids, positions, input_ids.shape
        )
        x = self.token_embedder(input_ids)
        row_ids = _row_ids(row_ids, input_ids.shape[0], deterministic)
        return self.encoder(x, segment_ids, positions, deterministic, row_ids)

    def decode(
        self,
        encoded: jax.Array,
        encoder_segment_ids: jax.Array,
        decoder_input_ids: jax.Array,
        decoder_attention_mask: jax.Array | None = None,
        *,
        decoder_segment_ids: jax.Array | None = None,
        cache: Cache | None = None,
        cache_index: jax.Array | int = 0,
        deterministic: bool = True,
        row_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """Logits [B, T, V] and the updated cache (None without one).

        `encoder_segment_ids` is the encoder attention mask (0/1) or, for packed rows (with
        `decoder_segment_ids`), the encoder's segment ids. With a `cache` (from `init_cache`),
        `decoder_input_ids` are the tokens at positions cache_index .. cache_index + T - 1; a
        cache without cross keys gets them on this call.
        """
        t = decoder_input_ids.shape[1]
        cache_index = jnp.asarray(cache_index, jnp.int32)
        num_keys = t if cache is None else cache_length(cache)
        q_pos = cache_index + jnp.arange(t)
        self_mask = (jnp.arange(num_keys)[None, :] <= q_pos[:, None])[None]
        if decoder_attention_mask is not None and cache is None:
            self_mask = self_mask & (decoder_attention_mask[:, None, :] > 0)
        cross_mask = (encoder_segment_ids > 0)[:, None, :]
        if decoder_segment_ids is not None:
            same = decoder_segment_ids[:, :, None] == decoder_segment_ids[:, None, :]
            self_mask = self_mask & same & (decoder_segment_ids[:, :, None] > 0)
            cross_mask = cross_mask & (
                decoder_segment_ids[:, :, None] == encoder_segment_ids[:, None, :]
            )
        y = self.token_embedder(decoder_input_ids)
        row_ids = _row_ids(row_ids, y.shape[0], deterministic)
        return self.decoder(
            y, encoded, self_mask, cross_mask, cache, cache_index, deterministic, row_ids
        )


def count_params(params: Any) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def init_params(model: LongT5, key: jax.Array) -> Any:
    """The model's parameters, boxed with their logical axes."""
    ids = jnp.ones((1, 1), jnp.int32)
    return model.init(key, ids, None, ids)["params"]


def abstract_params(model: LongT5) -> Any:
    """The parameters' shapes and dtypes, boxed with their logical axes; nothing is allocated."""
    return jax.eval_shape(functools.partial(init_params, model), jax.random.key(0))
