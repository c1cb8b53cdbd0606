"""Blocked local / transient-global attention against a dense oracle written from the spec."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import max_rel
from transformers.models.longt5 import modeling_longt5 as hf_longt5

from longt5_jax.model import LongT5Config, relpos
from longt5_jax.model.long_attention import (
    LongSelfAttention,
    global_blocks,
    relative_positions_3block,
)
from longt5_jax.model.relpos import shifted_rows

_global_blocks = jax.jit(global_blocks, static_argnums=2)


def _ids(mask, k, positions=None):
    mask = jnp.asarray([mask], jnp.int32)
    if positions is None:
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    blocks = _global_blocks(mask, jnp.asarray(positions, jnp.int32).reshape(1, -1), k)
    return blocks.block_ids[0].tolist(), blocks.global_segment_ids[0].tolist()


def test_block_ids_match_the_spec_tables():
    # The spec's examples, checked against flaxformer's tests with tokens_per_block = 3.
    assert _ids([1, 1, 1, 1, 1, 0, 0, 0], 3) == ([0, 0, 0, 0, 0, -1, -1, -1], [1, 0])
    assert _ids([1] * 8, 3) == ([0, 0, 0, 1, 1, 1, 1, 1], [1, 1])
    # Fewer real tokens than a block: no globals at all.
    assert _ids([1, 1, 0, 0, 0, 0], 3) == ([-1, -1, -1, -1, -1, -1], [0, 0])


def test_block_ids_follow_the_integer_formula():
    rng = np.random.default_rng(0)
    for _ in range(60):
        length, k = int(rng.choice([1, 13, 64])), int(rng.integers(1, 9))
        n = int(rng.integers(0, length + 1))
        block_ids, gseg = _ids([1] * n + [0] * (length - n), k)
        full = n // k
        want = [min(p // k, full - 1) if full > 0 and p < n else -1 for p in range(length)]
        assert block_ids == want
        assert gseg == [1 if g < full else 0 for g in range(length // k)]


def test_packed_block_ids_restart_per_segment():
    # Segments of 7, 2 and 5 tokens with k = 3, then 2 padding tokens.
    seg = [1] * 7 + [2] * 2 + [3] * 5 + [0] * 2
    pos = list(range(7)) + [0, 1] + list(range(5)) + [0, 0]
    block_ids, gseg = _ids(seg, 3, pos)
    assert block_ids == [0, 0, 0, 1, 1, 1, 1, -1, -1, 2, 2, 2, 2, 2, -1, -1]
    assert gseg == [1, 1, 3, 0, 0]


def test_block_ids_match_transformers_and_need_no_float_arithmetic():
    """transformers derives block ids from a float cumsum of 1/k. torch's CPU cumsum happens to
    be exact, so its ids equal ours for every k; a plain float32 running sum (numpy here, and
    any backend that accumulates sequentially) misplaces tokens for k = 3, which the integer
    definition cannot do."""
    for k in (2, 3, 5, 7, 12, 16):
        for length, n in ((4096, 4096), (20000, 19000), (97, 50)):
            mask = torch.zeros(1, length)
            mask[0, :n] = 1
            theirs, theirs_gseg = hf_longt5._make_global_fixed_block_ids(mask, k)
            ours, ours_gseg = _ids(mask[0].int().tolist(), k)
            assert theirs[0].tolist() == ours and theirs_gseg[0].tolist() == ours_gseg, (k, length)
    k = 3
    running = np.cumsum(np.full(4096, 1 / k, np.float32), dtype=np.float32) - np.float32(1 / k)
    float_ids = np.floor(running).astype(int)
    assert (float_ids != np.arange(4096) // k).sum() > 0  # e.g. position 6 lands in block 1


# --- dense oracle ------------------------------------------------------------------------------


def _oracle_blocks(segment_ids, k, length):
    """Per-row python loops over segments: block id per token and segment per global."""
    block_ids = np.full(segment_ids.shape, -1)
    gseg = np.zeros((segment_ids.shape[0], length // k), np.int64)
    for b, row in enumerate(segment_ids):
        offset, i = 0, 0
        while i < length:
            if row[i] == 0:
                i += 1
                continue
            j = i
            while j < length and row[j] == row[i]:
                j += 1
            full = (j - i) // k
            for p in range(j - i):
                if full:
                    block_ids[b, i + p] = offset + min(p // k, full - 1)
            gseg[b, offset : offset + full] = row[i]
            offset, i = offset + full, j
    return block_ids, gseg


def _bucket(rel, c, bidirectional=True):
    return np.asarray(
        relpos.relative_position_bucket(
            jnp.asarray(rel), bidirectional, c.relpos_buckets, c.relpos_max_distance
        )
    )


def dense_long_attention(c, p, x, segment_ids, local_table, side_table):
    """Every token against every token with a [L, L] mask; globals built by loops."""
    length = x.shape[1]
    q = np.einsum("bld,dhk->blhk", x, p["query"]["kernel"])
    k = np.einsum("bld,dhk->blhk", x, p["key"]["kernel"])
    v = np.einsum("bld,dhk->blhk", x, p["value"]["kernel"])
    idx = np.arange(length)
    rel = idx[None, :] - idx[:, None]
    allowed = (
        (np.abs(rel) <= c.local_radius)[None]
        & (segment_ids[:, :, None] == segment_ids[:, None, :])
        & (segment_ids[:, :, None] > 0)
    )
    logits = np.einsum("bihk,bjhk->bhij", q, k) + local_table[:, _bucket(rel, c)][None]
    logits = logits + np.where(allowed, 0.0, -1e10)[:, None]
    values = v
    if side_table is not None:
        g = length // c.global_block_size
        block_ids, gseg = _oracle_blocks(segment_ids, c.global_block_size, length)
        agg = np.zeros((x.shape[0], g, x.shape[2]))
        for b in range(x.shape[0]):
            for i in range(length):
                if block_ids[b, i] >= 0:
                    agg[b, block_ids[b, i]] += x[b, i]
        scale = p["global_input_layer_norm"]["scale"]
        gin = agg / np.sqrt(np.mean(agg**2, axis=-1, keepdims=True) + c.layer_norm_eps) * scale
        side_k = np.einsum("bgd,dhk->bghk", gin, p["key"]["kernel"])
        side_v = np.einsum("bgd,dhk->bghk", gin, p["value"]["kernel"])
        side_rel = np.arange(g)[None, None, :] - block_ids[:, :, None]
        side_bias = np.moveaxis(side_table[:, _bucket(side_rel, c)], 0, 1)  # [B, H, L, G]
        side_mask = segment_ids[:, :, None] == gseg[:, None, :]
        side = np.einsum("bihk,bghk->bhig", q, side_k) + side_bias
        side = side + np.where(side_mask, 0.0, -1e10)[:, None]
        logits = np.concatenate([logits, side], axis=-1)
        values = np.concatenate([v, side_v], axis=1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhij,bjhk->bihk", probs, values)
    return np.einsum("bihk,hkd->bid", out, p["out"]["kernel"])


def _segments(rng, length, packed):
    """Right-padded rows; packed rows hold several contiguous segments."""
    seg = np.zeros(length, np.int64)
    pos = np.zeros(length, np.int64)
    i, s = 0, 1
    end = int(rng.integers(1, length + 1))
    while i < end:
        n = int(rng.integers(1, end - i + 1)) if packed else end - i
        seg[i : i + n], pos[i : i + n] = s, np.arange(n)
        i, s = i + n, s + 1
    return seg, pos


@pytest.mark.parametrize("attention", ["local", "transient-global"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "radius,k,length", [(3, 4, 1), (3, 4, 23), (3, 3, 40), (5, 6, 37), (2, 5, 64)]
)
def test_blocked_attention_equals_dense_oracle(attention, packed, radius, k, length):
    c = LongT5Config.preset("tiny", attention, local_radius=radius, global_block_size=k)
    rng = np.random.default_rng(length * 7 + radius)
    rows = [_segments(rng, length, packed) for _ in range(3)]
    seg = np.stack([r[0] for r in rows]).astype(np.int32)
    pos = np.stack([r[1] for r in rows]).astype(np.int32)
    x = rng.normal(size=(3, length, c.d_model)).astype(np.float32)
    local_table = rng.normal(size=(c.num_heads, c.relpos_buckets)).astype(np.float32)
    side_table = rng.normal(size=(c.num_heads, c.relpos_buckets)).astype(np.float32)

    layer = LongSelfAttention(c, True)
    local_bias = relpos.lookup(
        jnp.asarray(local_table), jnp.asarray(_bucket(relative_positions_3block(c.block_len), c))
    )
    blocks = global_blocks(jnp.asarray(seg), jnp.asarray(pos), k) if attention != "local" else None
    side = jnp.asarray(side_table) if blocks is not None else None
    args = (jnp.asarray(x), jnp.asarray(seg), local_bias, blocks, side)
    params = nn.unbox(jax.jit(layer.init)(jax.random.key(0), *args))["params"]
    params = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(1), a.shape), params)
    ours = np.asarray(jax.jit(layer.apply)({"params": params}, *args))

    p = jax.tree.map(np.asarray, params)
    want = dense_long_attention(
        c, p, x.astype(np.float64), seg, local_table, side_table if blocks is not None else None
    )
    real = seg > 0
    # float32 against the float64 oracle, outputs up to 18 in size: the largest error over the
    # cases measured 6.2e-7 of the largest output (jax 0.10.2) and 1.2e-6 (0.12.0.1, TGlobal
    # packed, radius 3, blocks of 4, 23 tokens).
    assert max_rel(ours, want, real)[1] <= 2e-6


def test_relative_position_buckets_match_the_spec_table():
    c = LongT5Config()
    got = dict(zip(range(-130, 131), _bucket(np.arange(-130, 131), c).tolist(), strict=True))
    table = {
        0: 0,
        -1: 1,
        -7: 7,
        -8: 8,
        -11: 8,
        -12: 9,
        -15: 9,
        -16: 10,
        -22: 10,
        -23: 11,
        -31: 11,
        -32: 12,
        -45: 12,
        -46: 13,
        -63: 13,
        -64: 14,
        -90: 14,
        -91: 15,
        -130: 15,
    }
    for rel, bucket in table.items():
        assert got[rel] == bucket, rel
        assert got[-rel] == (16 + bucket if rel else 0), -rel
    assert 16 not in got.values()  # bidirectional bucket 16 is never used
    causal = _bucket(np.arange(-200, 5), c, bidirectional=False)
    assert causal[-5:].tolist() == [0] * 5  # keys after the query clamp to 0
    assert causal[200 - 15] == 15 and causal[200 - 16] == 16 and causal[200 - 113] == 31


@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (8, 16), (16, 32)])
def test_relative_position_buckets_match_transformers(buckets, max_distance):
    rel = torch.arange(-3 * max_distance, 3 * max_distance)
    for bidirectional in (True, False):
        theirs = hf_longt5.LongT5Attention._relative_position_bucket(
            rel, bidirectional=bidirectional, num_buckets=buckets, max_distance=max_distance
        )
        ours = relpos.relative_position_bucket(
            jnp.asarray(rel.numpy()), bidirectional, buckets, max_distance
        )
        assert (np.asarray(ours) == theirs.numpy()).all()
    assert math.isfinite(float(max_distance))


def test_shifted_rows_and_their_gathered_gradient_equal_a_plain_gather():
    """Every shift from 0 to cols, so both ends of the 2 cols distances are read."""
    cols = 6
    v = jax.random.normal(jax.random.key(0), (2, 3, 2 * cols))
    shift = jnp.arange(2 * 4 * 7).reshape(2, 4, 7) % (cols + 1)
    cotangent = jax.random.normal(jax.random.key(1), (2, 3, 4, 7, cols))

    def plain(v):  # out[b, h, n, w, g] = v[b, h, g - shift + cols], element by element
        b, h, n, w, g = np.indices((2, 3, 4, 7, cols))
        return v[b, h, g - np.asarray(shift)[b, n, w] + cols]

    out, pull = jax.vjp(lambda v: shifted_rows(v, shift, cols), v)
    want, want_pull = jax.vjp(plain, v)
    np.testing.assert_array_equal(out, want)
    # Each entry sums 28 cotangents, in another order than the scatter's: float32 rounding may
    # differ (measured equal on the CPU).
    np.testing.assert_allclose(pull(cotangent)[0], want_pull(cotangent)[0], rtol=1e-6, atol=1e-6)


def test_a_bias_tables_gradient_on_a_gpu_is_its_one_hot_sums():
    """`relpos.take_buckets` on a GPU: the gather, and each bucket's cotangents summed by a
    one-hot matmul (the GPU branch, run here directly) as the gather's own gradient sums them;
    a deviceless H100 compile of the lookup's gradient holds no scatter."""
    table = jax.random.normal(jax.random.key(0), (3, 8))
    buckets = relpos.relative_position_bucket(
        jnp.arange(40)[None] - jnp.arange(30)[:, None], False, 8, 16
    )
    cotangent = jax.random.normal(jax.random.key(1), (3, 30, 40))
    out, pull = jax.vjp(lambda t: relpos._take_buckets(8, t, buckets), table)
    want, want_pull = jax.vjp(lambda t: jnp.take(t, buckets, axis=1), table)
    np.testing.assert_array_equal(out, want)
    # Each entry sums up to 1200 cotangents in another order than the scatter's (measured 1.3e-6
    # relative).
    np.testing.assert_allclose(pull(cotangent)[0], want_pull(cotangent)[0], rtol=2e-6, atol=2e-6)
    gpu_grad = jax.jit(jax.grad(lambda t: jnp.sum(relpos.lookup(t, buckets) * cotangent)))
    text = gpu_grad.trace(table).lower(lowering_platforms=("cuda",)).as_text()
    cpu_text = gpu_grad.trace(table).lower(lowering_platforms=("cpu",)).as_text()
    assert "scatter" not in text and "dot_general" in text
    assert "scatter" in cpu_text  # a CPU keeps the gather's own gradient
    # A half-precision run's tables are bfloat16 (or float16): so is their gradient.
    half = jax.tree.map(lambda t: t.astype(jnp.bfloat16), (table, cotangent))
    assert jax.grad(lambda t: jnp.sum(relpos.lookup(t, buckets) * half[1]))(half[0]).dtype == (
        jnp.bfloat16
    )
    assert "scatter" not in gpu_grad.trace(half[0]).lower(lowering_platforms=("cuda",)).as_text()
