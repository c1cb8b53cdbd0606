"""The decoder's attention (causal self-attention with its bias, cross-attention over the whole
encoder output) fused into Pallas kernels (Triton backend); `attention.Attention` is the spec.

Letter key as `attention`: B batch, T queries, S keys, H heads, K head dim; Q and C the query
and key tiles (64 each, fewer for short inputs).

Per program of the forward (grid B x H x T/Q), on chip: a [Q, K] query tile, one [C, K] key and
value tile at a time, their [Q, C] mask (int8, [B, T or 1, S] in HBM) and bias tiles, one online
softmax. HBM per program: q, all of k and v for its (b, h) (from L2 after the first query tile),
the mask and bias tiles, the output and a [Q] log-sum-exp. The backward recomputes from that:
dq by query tile, dk and dv by key tile, and the bias gradient ([H, T, S], one program per tile
summing over the batch). No [B, H, T, S] tensor reaches HBM. Rows that see no key output 0.
The forward and dq may split each query tile's keys into parts, a program each (`Tiles.split`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from longt5_jax.kernels import call, placement, softmax
from longt5_jax.kernels.decoder_tiles import (
    Tiles,
    key_tile,
    out_stat,
    out_tile,
    out_type,
    query_tile,
    stat,
)
from longt5_jax.kernels.dropout import DROP_AXES, Drop, drop_scale, dropped_grad


def _scores(tl: Tiles, q, k, b, h, rows, keys, mask_ref, bias_ref):
    """[Q, C] scores (with the bias) and their validity, or None where a mask shared by every
    query (cross-attention's) made invalid keys NEG: one add a key, taken into the matmul's
    accumulator, instead of a compare and a select an element (SASS, sm_90a)."""
    s = softmax.dot(q, k, trans_b=True)
    if tl.bias:
        s = s + bias_ref[h, rows, keys]
    if tl.mask_rows == 1:
        return s + jnp.where(mask_ref[b, pl.ds(0, 1), keys] != 0, 0.0, softmax.NEG), None
    return s, mask_ref[b, rows, keys] != 0


def _scale(tl: Tiles, drop, b, h, i, j):
    """Dropout's [Q, C] scale of query tile i x key tile j (token positions), or None."""
    queries, keys = i * tl.tq + jnp.arange(tl.tq), j * tl.tk + jnp.arange(tl.tk)
    return drop_scale(tl.rate, drop, b, h, queries, keys)


def _kernel(tl: Tiles, body, inputs: int):
    """body(tl, dropout refs, *refs) as a kernel: the dropout's arrays follow the inputs."""

    def kernel(*refs):
        drop = refs[inputs : inputs + 3] if tl.rate else ()
        return body(tl, drop, *refs[:inputs], *refs[inputs + len(drop) :])

    return kernel


def _fwd_kernel(tl: Tiles, drop, q_ref, k_ref, v_ref, mask_ref, bias_ref, o_ref, lse_ref):
    b, h, (i, part) = pl.program_id(0), pl.program_id(1), tl.program(pl.program_id(2))
    rows, q = pl.ds(i * tl.tq, tl.tq), q_ref[...]

    def chunk(j, state):
        keys = pl.ds(j * tl.tk, tl.tk)
        s, valid = _scores(tl, q, k_ref[b, keys, h, :], b, h, rows, keys, mask_ref, bias_ref)
        scale = _scale(tl, drop, b, h, i, j)
        return softmax.online(state, s, valid, v_ref[b, keys, h, :], scale)

    state = (
        jnp.full((tl.tq,), -jnp.inf, jnp.float32),
        jnp.zeros((tl.tq,), jnp.float32),
        jnp.zeros((tl.tq, tl.head_dim), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(*tl.key_tiles(part), chunk, state)
    seen = softmax.seen(m)
    safe = jnp.where(seen, l, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / safe[:, None], 0.0).astype(o_ref.dtype)
    # A part that sees no key weighs nothing in `_combine`; a whole row that sees none has 0.
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe), -jnp.inf if tl.parts > 1 else 0.0)


def _dq_kernel(tl: Tiles, drop, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, mask_ref,
               bias_ref, dq_ref):  # fmt: skip
    b, h, (i, part) = pl.program_id(0), pl.program_id(1), tl.program(pl.program_id(2))
    rows, q, do = pl.ds(i * tl.tq, tl.tq), q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def chunk(j, dq):
        keys = pl.ds(j * tl.tk, tl.tk)
        k = k_ref[b, keys, h, :]
        s, valid = _scores(tl, q, k, b, h, rows, keys, mask_ref, bias_ref)
        p = softmax.probs(s, valid, lse)
        dp = softmax.dot(do, v_ref[b, keys, h, :], trans_b=True)
        ds = dropped_grad(p, dp, delta, _scale(tl, drop, b, h, i, j))
        return dq + softmax.dot(ds.astype(k.dtype), k)

    zeros = jnp.zeros((tl.tq, tl.head_dim), jnp.float32)
    dq_ref[...] = jax.lax.fori_loop(*tl.key_tiles(part), chunk, zeros).astype(dq_ref.dtype)


def _dkv_kernel(tl: Tiles, drop, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, mask_ref,
                bias_ref, dk_ref, dv_ref):  # fmt: skip
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    keys, k, v = pl.ds(j * tl.tk, tl.tk), k_ref[...], v_ref[...]

    def chunk(i, carry):
        dk, dv = carry
        rows = pl.ds(i * tl.tq, tl.tq)
        q, do = q_ref[b, rows, h, :], do_ref[b, rows, h, :]
        s, valid = _scores(tl, q, k, b, h, rows, keys, mask_ref, bias_ref)
        p = softmax.probs(s, valid, lse_ref[b, h, rows])
        scale = _scale(tl, drop, b, h, i, j)
        dv += softmax.dot((p if scale is None else p * scale).astype(do.dtype).T, do)
        ds = dropped_grad(p, softmax.dot(do, v, trans_b=True), delta_ref[b, h, rows], scale)
        return dk + softmax.dot(ds.astype(q.dtype).T, q), dv

    zeros = jnp.zeros((tl.tk, tl.head_dim), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, tl.t // tl.tq, chunk, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dbias_kernel(tl: Tiles, drop, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, mask_ref,
                  bias_ref, out_ref):  # fmt: skip
    """The bias gradient of one [Q, C] tile, summed over the batch."""
    h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, keys = pl.ds(i * tl.tq, tl.tq), pl.ds(j * tl.tk, tl.tk)

    def one_row(b, acc):
        q, do = q_ref[b, rows, h, :], do_ref[b, rows, h, :]
        s, valid = _scores(tl, q, k_ref[b, keys, h, :], b, h, rows, keys, mask_ref, bias_ref)
        p = softmax.probs(s, valid, lse_ref[b, h, rows])
        dp = softmax.dot(do, v_ref[b, keys, h, :], trans_b=True)
        scale = _scale(tl, drop, b, h, i, j)
        return acc + dropped_grad(p, dp, delta_ref[b, h, rows], scale)

    zeros = jnp.zeros((tl.tq, tl.tk), jnp.float32)
    out_ref[...] = jax.lax.fori_loop(0, tl.batch, one_row, zeros)


def _forward(tl: Tiles, q, k, v, mask, bias, *drop):
    name = "decoder_attention_fwd"
    tl = tl.split(name)
    o, lse = call.call(
        _kernel(tl, _fwd_kernel, 5),
        name,
        flops=tl.flops(2),
        grid=(tl.batch, tl.heads, tl.t // tl.tq * tl.parts),
        in_specs=[query_tile(tl)] + [call.whole()] * (4 + len(drop)),
        out_specs=[out_tile(tl), out_stat(tl)],
        out_shape=[
            out_type(tl, q.shape, q.dtype, q),
            out_type(tl, (tl.batch, tl.heads, tl.t), jnp.float32, q),
        ],
    )(q, k, v, mask, bias, *drop)
    return (o, lse) if tl.parts == 1 else _combine(o, lse, q.dtype)


def _combine(o_PBTHK, lse_PBHT, dtype):
    """The parts' outputs as one row's: each part's (normalised) output weighted by its share
    of the row's sum of exponentials, exp(lse_part - lse); rows no part saw output 0, lse 0."""
    m = jnp.max(lse_PBHT, axis=0)
    seen = m > -jnp.inf
    m = jnp.where(seen, m, 0.0)
    weights = jnp.exp(lse_PBHT - m)
    total = jnp.where(seen, weights.sum(0), 1.0)
    o = jnp.einsum("pbht,pbthk->bthk", weights / total, o_PBTHK)
    return o.astype(dtype), jnp.where(seen, m + jnp.log(total), 0.0)


def _backward(tl: Tiles, q, k, v, mask, bias, o, lse, do, *drop):
    delta = jnp.einsum("bthk,bthk->bht", do.astype(jnp.float32), o.astype(jnp.float32))
    whole, extra = call.whole(), [call.whole()] * len(drop)
    dq_tl = tl.split("decoder_attention_dq")
    dq = call.call(
        _kernel(dq_tl, _dq_kernel, 8),
        "decoder_attention_dq",
        flops=tl.flops(3),
        grid=(tl.batch, tl.heads, tl.t // tl.tq * dq_tl.parts),
        in_specs=[query_tile(dq_tl)] * 2 + [stat(dq_tl)] * 2 + [whole] * 4 + extra,
        out_specs=out_tile(dq_tl),
        out_shape=out_type(dq_tl, q.shape, q.dtype, q),
    )(q, do, lse, delta, k, v, mask, bias, *drop)
    if dq_tl.parts > 1:
        dq = dq.sum(0).astype(q.dtype)
    dk, dv = call.call(
        _kernel(tl, _dkv_kernel, 8),
        "decoder_attention_dkv",
        flops=tl.flops(4),
        grid=(tl.batch, tl.heads, tl.s // tl.tk),
        in_specs=[key_tile(tl), key_tile(tl)] + [whole] * 6 + extra,
        out_specs=[key_tile(tl), key_tile(tl)],
        out_shape=[placement.out(k.shape, k.dtype, q), placement.out(v.shape, v.dtype, q)],
    )(k, v, q, do, lse, delta, mask, bias, *drop)
    if not tl.bias:
        return dq, dk, dv
    dbias = call.call(
        _kernel(tl, _dbias_kernel, 8),
        "decoder_attention_dbias",
        flops=tl.flops(2),
        grid=(tl.heads, tl.t // tl.tq, tl.s // tl.tk),
        in_specs=[whole] * 8 + extra,
        out_specs=pl.BlockSpec((None, tl.tq, tl.tk), lambda h, i, j: (h, i, j)),
        out_shape=placement.out(bias.shape, jnp.float32, q),
    )(q, do, lse, delta, k, v, mask, bias, *drop)
    return dq, dk, dv, dbias


_STAT = ("batch", "heads", None)


def _placed(tl: Tiles, run, arrays: list, drop, outs: tuple):
    """run(tiles of each device's shard, *arrays, *drop) on each device's own rows and heads
    (the forward and the backward are placed apart, so their residuals are ordinary arrays);
    the bias' gradient lacks `batch` and is summed over the rows' devices."""
    bias = ("heads", None, None) if tl.bias else (None, None, None)
    axes = [placement.ROWS] * 3 + [
        ("batch", None, None),
        bias,
        placement.ROWS,
        _STAT,
        placement.ROWS,
    ]
    axes = axes[: len(arrays)] + (DROP_AXES if drop is not None else [])

    def on_shard(*shards):
        return run(dataclasses.replace(tl, batch=shards[0].shape[0], heads=shards[0].shape[2]),
                    *shards)  # fmt: skip

    outs = tuple(bias if o == "bias" else o for o in outs)
    arrays = arrays + ([] if drop is None else list(drop))
    return placement.on_own_rows_and_heads(on_shard, arrays, axes, outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(tl, q, k, v, mask, bias, drop):
    return _placed(tl, _forward, [q, k, v, mask, bias], drop, (placement.ROWS, _STAT))[0]


def _attention_fwd(tl, q, k, v, mask, bias, drop):
    o, lse = _placed(tl, _forward, [q, k, v, mask, bias], drop, (placement.ROWS, _STAT))
    o, lse = call.saveable(o, lse)
    return o, (q, k, v, mask, bias, o, lse, drop)


def _attention_bwd(tl, res, do):
    outs = (placement.ROWS,) * 3 + (("bias",) if tl.bias else ())
    *arrays, drop = res
    grads = _placed(tl, _backward, [*arrays, do], drop, outs)
    bias = res[4]
    return (*grads[:3], None, grads[3] if tl.bias else jnp.zeros_like(bias), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _tile_size(n: int) -> int:
    return min(64, max(16, call.pow2(n)))


def attention(
    q_BTHK: jax.Array,
    k_BSHK: jax.Array,
    v_BSHK: jax.Array,
    mask_BTS: jax.Array,
    bias_HTS: jax.Array | None = None,
    dropout: tuple[jax.Array, jax.Array, float] | None = None,
) -> jax.Array:
    """[B, T, H, K] softmax(q k + bias, masked) v, in q's dtype (0 for rows that see no key);
    the mask may be shared by the batch ([1, T, S]) or by the queries ([B, 1, S]). Under a mesh,
    on each device's own rows and heads (`placement.on_own_rows_and_heads`). `dropout`: (the
    layer's int32 seed, the rows' global ids [B], rate), as `dropout.attention_keep`."""
    b, t, h, k = q_BTHK.shape
    mask = jnp.broadcast_to(mask_BTS, (b, *mask_BTS.shape[1:]))
    tq, tk = _tile_size(t), _tile_size(k_BSHK.shape[1])
    tp, sp = -(-t // tq) * tq, -(-k_BSHK.shape[1] // tk) * tk
    rows, rate = mask.shape[1], dropout[2] if dropout else 0.0
    tl = Tiles(b, h, k, tq, tk, tp, sp, rows, bias_HTS is not None, rate)
    q = call.pad(q_BTHK, {1: tp})
    keys, values = call.pad(k_BSHK, {1: sp}), call.pad(v_BSHK, {1: sp})
    mask = call.pad(mask.astype(jnp.int8), {1: tp if rows > 1 else 1, 2: sp})
    if bias_HTS is None:
        bias = jnp.zeros((1, 1, 1), jnp.float32)
    else:
        bias = call.pad(bias_HTS.astype(jnp.float32), {1: tp, 2: sp})
    drop = Drop.of(dropout[0], dropout[1], h) if rate else None
    return _attention(tl, q, keys, values, mask, bias, drop)[:, :t]
