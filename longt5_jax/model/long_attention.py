"""LongT5 encoder self-attention: Local (sliding window) and Transient-Global (TGlobal).

Letter key: B batch, L length, D embed, H heads, K head dim, N blocks, W block length,
X = 3W keys of a query block's local window, G transient global tokens.

Both work on blocks of W = local_radius + 1 tokens: a query in block n sees blocks n-1, n, n+1
(3W keys), masked down to |i - j| <= local_radius. TGlobal adds G = L // global_block_size
side keys, one per block of global_block_size tokens, made afresh in every layer as the RMS-normed
sum of that block's attention inputs. Local and side logits share one softmax; unlike the
reference implementations, side keys and values are never tiled across the N blocks.

Packed rows (T5X fine-tuning format: `segment_ids` 0 = padding, `positions` restarting at 0 in
each contiguous segment) are exact: no attention and no global aggregate crosses a segment.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from longt5_jax.kernels import interface as kernels
from longt5_jax.kernels.dropout import SIDE_KEYS, dropout_scale
from longt5_jax.model import relpos
from longt5_jax.model.attention import HEADS, MASKED, qkvo_projections
from longt5_jax.model.config import LongT5Config
from longt5_jax.model.layers import AttentionDropout, RMSNorm, Rows


def heads_major(x_BLHK: jax.Array) -> jax.Array:
    """[B, L, H, K] -> [B, H, L, K]."""
    return x_BLHK.transpose(0, 2, 1, 3)


def split_blocks(x: jax.Array, w: int, axis: int = 1) -> jax.Array:
    """Split `axis` (length L) into [N, W], zero-padding L up to a multiple of w."""
    n = -(-x.shape[axis] // w)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n * w - x.shape[axis])
    return jnp.pad(x, pad).reshape(*x.shape[:axis], n, w, *x.shape[axis + 1 :])


def concat_3_blocks(x: jax.Array, axis: int = 1) -> jax.Array:
    """Blocks [.., N, W, ..] at `axis` -> [.., N, 3W, ..]: each block with its two neighbours
    (zeros at the ends)."""
    n = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (1, 1)
    xp = jnp.pad(x, pad)
    parts = [jax.lax.slice_in_dim(xp, i, i + n, axis=axis) for i in range(3)]
    return jnp.concatenate(parts, axis=axis + 1)


def relative_positions_3block(w: int) -> jax.Array:
    """[W, 3W] key index minus query index; query j of a block sits at W + j of its window."""
    return jnp.arange(3 * w)[None, :] - (w + jnp.arange(w))[:, None]


def local_mask(segment_ids: jax.Array, w: int) -> jax.Array:
    """[B, N, W, X]: same segment, not padding, and within the radius."""
    seg_BNW = split_blocks(segment_ids, w)
    seg_BNX = concat_3_blocks(seg_BNW)
    same = (seg_BNW[..., :, None] == seg_BNX[..., None, :]) & (seg_BNW[..., :, None] > 0)
    return same & (jnp.abs(relative_positions_3block(w)) < w)


@flax.struct.dataclass
class GlobalBlocks:
    """Which transient global each token feeds, and the segment each global belongs to."""

    block_ids: jax.Array  # [B, L] int32, -1 for padding and segments shorter than one block
    global_segment_ids: jax.Array  # [B, G] int32, 0 for globals no segment fills


def local_bias(config, table_HR: jax.Array) -> jax.Array:
    """[H, W, 3W]: the local relative-position bias of `config`'s layers, the table's entry for
    each query's distance to each key of its three blocks. With the kernels, NEG beyond the
    radius (they rely on it and need no distance mask): read from an extra NEG column by the
    same lookup, once per stack, so no pass over [H, W, 3W] is added (a mask after the lookup
    moved more bytes: docs/journal.md, "What the kernels issue")."""
    w, heads, r = config.block_len, table_HR.shape[0], table_HR.shape[1]
    relative = relative_positions_3block(w)
    buckets = relpos.relative_position_bucket(
        relative, True, config.relpos_buckets, config.relpos_max_distance
    )
    if kernels.fused(config):
        table_HR = jnp.concatenate([table_HR, jnp.full((heads, 1), kernels.NEG, table_HR.dtype)], 1)
        buckets = jnp.where(jnp.abs(relative) < w, buckets, r)
    return relpos.lookup(table_HR, buckets)


def global_blocks(segment_ids: jax.Array, positions: jax.Array, k: int) -> GlobalBlocks:
    """Fixed blocks of k tokens per segment, in integer arithmetic.

    Every complete block of a segment gets one global (numbered along the row); the trailing
    n mod k tokens of a segment join its last complete block; a segment of fewer than k tokens has
    none. Unpacked this is block_id = min(p // k, n // k - 1). transformers derives the ids from a
    float cumsum of 1/k, which misplaces tokens when k is not a power of two (e.g. k = 3); these
    integer ids are flaxformer's definition.
    """
    b, length = segment_ids.shape
    num_globals = length // k
    valid = segment_ids > 0
    # A complete block starts at i when token i + k - 1 is in the same segment, k - 1 further on.
    seg_ahead = jnp.pad(segment_ids, [(0, 0), (0, k - 1)])[:, k - 1 :]
    pos_ahead = jnp.pad(positions, [(0, 0), (0, k - 1)], constant_values=-1)[:, k - 1 :]
    starts = (
        valid & (positions % k == 0) & (seg_ahead == segment_ids) & (pos_ahead == positions + k - 1)
    )
    count = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
    segment_start = jnp.clip(jnp.arange(length) - positions, 0, length - 1)
    before_segment = jnp.take_along_axis(count - starts, segment_start, axis=1)
    block_ids = jnp.where(valid & (count > before_segment), count - 1, -1)
    # Each global takes the segment id of its block's first token.
    target = jnp.where(starts, count - 1, num_globals)
    global_segment_ids = (
        jnp.zeros((b, num_globals), jnp.int32)
        .at[jnp.arange(b)[:, None], target]
        .set(segment_ids.astype(jnp.int32), mode="drop")
    )
    return GlobalBlocks(block_ids.astype(jnp.int32), global_segment_ids)


def global_aggregates(x_BLD: jax.Array, block_ids: jax.Array, num_globals: int) -> jax.Array:
    """[B, G, D] float32 sum of each block's tokens (a sum, as the references; not a mean)."""
    ids = jnp.where(block_ids >= 0, block_ids, num_globals)

    def one_row(x_LD, ids_L):
        return jax.ops.segment_sum(x_LD, ids_L, num_segments=num_globals + 1)[:num_globals]

    return jax.vmap(one_row)(x_BLD.astype(jnp.float32), ids)


class LongSelfAttention(nn.Module):
    """Local or transient-global self-attention over blocks (per `config.attention`)."""

    config: LongT5Config
    deterministic: bool

    def setup(self):
        c = self.config
        self.query, self.key, self.value, self.out = qkvo_projections(c)
        if c.attention == "transient-global":
            self.global_input_layer_norm = RMSNorm(c.layer_norm_eps, c.compute_dtype)
        self.dropout = AttentionDropout(c.dropout_rate, self.deterministic)

    def __call__(
        self,
        x_BLD: jax.Array,
        segment_ids: jax.Array,
        local_bias_HWX: jax.Array,
        blocks: GlobalBlocks | None,
        side_table_HR: jax.Array | None,
        rows: Rows | None = None,
    ) -> jax.Array:
        c, length = self.config, x_BLD.shape[1]
        q_BLHK = nn.with_logical_constraint(self.query(x_BLD), HEADS)
        side = None
        if blocks is None:
            k_BLHK, v_BLHK = self.key(x_BLD), self.value(x_BLD)
        else:  # also when G = 0 (inputs shorter than a block), for the params
            num_globals = length // c.global_block_size
            agg_BGD = global_aggregates(x_BLD, blocks.block_ids, num_globals)
            g_BGD = self.global_input_layer_norm(agg_BGD)
            # The tokens' and the side keys (values) by one kernel each, used twice.
            (k_BLHK, side_k), (v_BLHK, side_v) = self.key(x_BLD, g_BGD), self.value(x_BLD, g_BGD)
            side = (side_k, side_v)
        k_BLHK = nn.with_logical_constraint(k_BLHK, HEADS)
        v_BLHK = nn.with_logical_constraint(v_BLHK, HEADS)
        if kernels.fused(c):
            out_BLHK = self._fused(q_BLHK, k_BLHK, v_BLHK, segment_ids, local_bias_HWX, blocks,
                                   side, side_table_HR, rows)  # fmt: skip
        else:
            out_BLHK = self._blocked(q_BLHK, k_BLHK, v_BLHK, segment_ids, local_bias_HWX, blocks,
                                     side, side_table_HR, rows)  # fmt: skip
        out_BLHK = nn.with_logical_constraint(out_BLHK, HEADS)
        return self.out(out_BLHK)

    def _fused(
        self, q_BLHK, k_BLHK, v_BLHK, segment_ids, local_bias_HWX, blocks, side, table_HR, rows
    ):
        """The Pallas kernels (`kernels.encoder`): no score tensor in memory."""
        c = self.config
        seed = self.dropout(rows)
        dropout = None if seed is None else (seed, rows.ids, c.dropout_rate)
        fused_side = None
        if side is not None and side[0].shape[1]:
            by_distance_HD = relpos.by_distance(
                table_HR, side[0].shape[1], c.relpos_buckets, c.relpos_max_distance
            )
            fused_side = kernels.Side(
                *side, by_distance_HD, blocks.block_ids, blocks.global_segment_ids
            )
        return kernels.encoder_attention(
            q_BLHK,
            k_BLHK,
            v_BLHK,
            segment_ids,
            local_bias_HWX=local_bias_HWX,
            side=fused_side,
            global_block_size=c.global_block_size,
            dropout=dropout,
        )

    def _blocked(
        self, q_BLHK, k_BLHK, v_BLHK, segment_ids, local_bias_HWX, blocks, side, table_HR, rows
    ) -> jax.Array:
        """The reference: score tensors over [B, H, N, W, 3W + G] in XLA."""
        c, w, length = self.config, self.config.block_len, q_BLHK.shape[1]
        # Heads-major blocks: every attention matmul then batches over leading (b, h, n) axes and
        # the score tensors need no transposes, which on CPU cost as much as the matmuls.
        q_BHNWK = split_blocks(heads_major(q_BLHK), w, axis=2)
        k_BHNXK = concat_3_blocks(split_blocks(heads_major(k_BLHK), w, axis=2), axis=2)
        v_BHNXK = concat_3_blocks(split_blocks(heads_major(v_BLHK), w, axis=2), axis=2)

        # Logits, biases and softmax in float32 whatever the compute dtype: in half precision the
        # -1e10 mask overflows and fully masked rows turn into NaN.
        mask_BNWX = local_mask(segment_ids, w)
        local_BHNWX = jnp.einsum(
            "bhnwk,bhnxk->bhnwx", q_BHNWK, k_BHNXK, preferred_element_type=jnp.float32
        )
        local_BHNWX = (
            local_BHNWX + local_bias_HWX[:, None] + jnp.where(mask_BNWX, 0.0, MASKED)[:, None]
        )
        logits = [local_BHNWX]
        values = [("bhnwx,bhnxk->bhnwk", v_BHNXK)]
        if side is not None:
            num_globals = side[0].shape[1]
            side_k_BHGK, side_v_BHGK = heads_major(side[0]), heads_major(side[1])
            side_BHNWG = jnp.einsum(
                "bhnwk,bhgk->bhnwg", q_BHNWK, side_k_BHGK, preferred_element_type=jnp.float32
            )
            side_BHNWG = side_BHNWG + self._side_bias(segment_ids, blocks, table_HR, num_globals)
            logits.append(side_BHNWG)
            values.append(("bhnwg,bhgk->bhnwk", side_v_BHGK))

        out_BHNWK = self._attend(logits, values, self._dropout_scales(logits, rows))
        b, h, n = out_BHNWK.shape[:3]
        return out_BHNWK.reshape(b, h, n * w, c.d_kv)[:, :, :length].transpose(0, 2, 1, 3)

    def _dropout_scales(self, logits: list[jax.Array], rows: Rows | None) -> list:
        """Attention dropout's scale of each local and side score ([B, H, N, W, 3W] and
        [B, H, N, W, G]), or Nones: `attention_keep` of (row, head, query, key) positions."""
        seed = self.dropout(rows)
        if seed is None:
            return [None] * len(logits)
        assert rows is not None  # a seed is drawn only for rows (AttentionDropout)
        b, h, n, w = logits[0].shape[:4]
        row, head = rows.ids[:, None, None, None, None], jnp.arange(h)[:, None, None, None]
        query = (jnp.arange(n)[:, None] * w + jnp.arange(w))[:, :, None]
        keys = [(jnp.arange(n)[:, None] * w + jnp.arange(3 * w) - w)[:, None, :]]
        if len(logits) > 1:
            keys.append(SIDE_KEYS + jnp.arange(logits[1].shape[-1]))
        rate = self.config.dropout_rate
        return [dropout_scale(seed, row, head, query=query, key=k, rate=rate) for k in keys]

    def _attend(
        self, logits: list[jax.Array], values: list[tuple[str, jax.Array]], scales: list
    ) -> jax.Array:
        """One softmax over local and side keys without concatenating them, normalised after
        the value matmuls: dividing the [.., W, K] output moves (3W + G) / K times fewer bytes than
        dividing the [.., W, 3W + G] probabilities (dropout(e) / total = dropout(e / total))."""
        peak = jnp.max(jnp.stack([jnp.max(s, axis=-1, initial=-jnp.inf) for s in logits]), axis=0)
        exps = [jnp.exp(s - peak[..., None]) for s in logits]
        total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
        out_BHNWK: jax.Array | float = 0.0
        for e, scale, (spec, v) in zip(exps, scales, values, strict=True):
            e = (e if scale is None else e * scale).astype(self.config.compute_dtype)
            out_BHNWK = out_BHNWK + jnp.einsum(spec, e, v, preferred_element_type=jnp.float32)
        assert isinstance(out_BHNWK, jax.Array)  # `logits` always holds the local scores
        return (out_BHNWK / total).astype(self.config.compute_dtype)

    def _side_bias(
        self, segment_ids: jax.Array, blocks: GlobalBlocks, table_HR: jax.Array, num_globals: int
    ) -> jax.Array:
        """[B, H, N, W, G]: side relative-position bias plus the same-segment mask.

        A token's bias to global g depends on g - q alone (q its own global block, -1 for
        none): it is read from the bias of each of the 2G distances (`shifted_rows`).
        """
        c, w = self.config, self.config.block_len
        seg_BNW = split_blocks(segment_ids, w)
        if num_globals == 0:  # inputs shorter than a global block: no side keys
            return jnp.zeros((*seg_BNW.shape[:1], table_HR.shape[0], *seg_BNW.shape[1:], 0))
        by_distance_HD = relpos.by_distance(
            table_HR, num_globals, c.relpos_buckets, c.relpos_max_distance
        )
        shift_BNW = split_blocks(blocks.block_ids, w) + 1
        # One copy per row, typed like the rows: inside a shard_map the rows vary over its axes
        # and the table does not, and a custom gradient must come back typed as it went in.
        by_distance_BHD = jnp.where(shift_BNW[:, :1, :1] >= 0, by_distance_HD, 0.0)
        bias_BHNWG = relpos.shifted_rows(by_distance_BHD, shift_BNW, num_globals)
        # A token of a segment shorter than a global block is in none and sees no side key
        # (only a segment id reused by another run of the row would have matched); padding
        # keeps the references' mask.
        same_BNWG = seg_BNW[..., None] == blocks.global_segment_ids[:, None, None, :]
        short_BNW = (shift_BNW == 0) & (seg_BNW > 0)
        same_BNWG = same_BNWG & ~short_BNW[..., None]
        return bias_BHNWG + jnp.where(same_BNWG, 0.0, MASKED)[:, None]
