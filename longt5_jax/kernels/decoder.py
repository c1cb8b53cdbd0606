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
    Forward,
    Inputs,
    KeyGrad,
    KeyGrads,
    Output,
    QueryGrad,
    Residuals,
    Tiles,
    combine,
    key_tile,
    out_stat,
    out_tile,
    out_type,
    query_tile,
    stat,
)
from longt5_jax.kernels.dropout import DROP_AXES, Drop, drop_scale, dropped_grad, whole_drop


def _scores(tl: Tiles, ops, q, k, *, b, h, rows, keys):
    """[Q, C] scores (with the bias) and their validity, or None where a mask shared by every
    query (cross-attention's) made invalid keys NEG: one add a key, taken into the matmul's
    accumulator, instead of a compare and a select an element (SASS, sm_90a)."""
    s = softmax.dot(q, k, trans_b=True)
    if tl.bias:
        s = s + ops.bias[h, rows, keys]
    if tl.mask_rows == 1:
        return s + jnp.where(ops.mask[b, pl.ds(0, 1), keys] != 0, 0.0, softmax.NEG), None
    return s, ops.mask[b, rows, keys] != 0


def _scale(tl: Tiles, drop, *, b, h, i, j):
    """Dropout's [Q, C] scale of query tile i x key tile j (token positions), or None."""
    queries, keys = i * tl.tq + jnp.arange(tl.tq), j * tl.tk + jnp.arange(tl.tk)
    return drop_scale(tl.rate, drop, b, h, queries=queries, keys=keys)


def _fwd_kernel(tl: Tiles, ops: Forward, out: Output):
    b, h, (i, part) = pl.program_id(0), pl.program_id(1), tl.program(pl.program_id(2))
    rows, q = pl.ds(i * tl.tq, tl.tq), ops.q[...]

    def chunk(j, state):
        keys = pl.ds(j * tl.tk, tl.tk)
        s, valid = _scores(tl, ops, q, ops.k[b, keys, h, :], b=b, h=h, rows=rows, keys=keys)
        scale = _scale(tl, ops.drop, b=b, h=h, i=i, j=j)
        return softmax.online(state, s, valid, ops.v[b, keys, h, :], scale=scale)

    state = (
        jnp.full((tl.tq,), -jnp.inf, jnp.float32),
        jnp.zeros((tl.tq,), jnp.float32),
        jnp.zeros((tl.tq, tl.head_dim), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(*tl.key_tiles(part), chunk, state)
    seen = softmax.seen(m)
    safe = jnp.where(seen, l, 1.0)
    out.o[...] = jnp.where(seen[:, None], acc / safe[:, None], 0.0).astype(out.o.dtype)
    # A part that sees no key weighs nothing in `combine`; a whole row that sees none has 0.
    out.lse[...] = jnp.where(seen, m + jnp.log(safe), -jnp.inf if tl.parts > 1 else 0.0)


def _dq_kernel(tl: Tiles, ops: QueryGrad, dq_ref):
    b, h, (i, part) = pl.program_id(0), pl.program_id(1), tl.program(pl.program_id(2))
    rows, q, do = pl.ds(i * tl.tq, tl.tq), ops.q[...], ops.do[...]
    lse, delta = ops.lse[...], ops.delta[...]

    def chunk(j, dq):
        keys = pl.ds(j * tl.tk, tl.tk)
        k = ops.k[b, keys, h, :]
        s, valid = _scores(tl, ops, q, k, b=b, h=h, rows=rows, keys=keys)
        p = softmax.probs(s, valid, lse)
        dp = softmax.dot(do, ops.v[b, keys, h, :], trans_b=True)
        ds = dropped_grad(p, dp, delta, _scale(tl, ops.drop, b=b, h=h, i=i, j=j))
        return dq + softmax.dot(ds.astype(k.dtype), k)

    zeros = jnp.zeros((tl.tq, tl.head_dim), jnp.float32)
    dq_ref[...] = jax.lax.fori_loop(*tl.key_tiles(part), chunk, zeros).astype(dq_ref.dtype)


def _dkv_kernel(tl: Tiles, ops: KeyGrad, out: KeyGrads):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    keys, k, v = pl.ds(j * tl.tk, tl.tk), ops.k[...], ops.v[...]

    def chunk(i, carry):
        dk, dv = carry
        rows = pl.ds(i * tl.tq, tl.tq)
        q, do = ops.q[b, rows, h, :], ops.do[b, rows, h, :]
        s, valid = _scores(tl, ops, q, k, b=b, h=h, rows=rows, keys=keys)
        p = softmax.probs(s, valid, ops.lse[b, h, rows])
        scale = _scale(tl, ops.drop, b=b, h=h, i=i, j=j)
        dv += softmax.dot((p if scale is None else p * scale).astype(do.dtype).T, do)
        ds = dropped_grad(p, softmax.dot(do, v, trans_b=True), ops.delta[b, h, rows], scale)
        return dk + softmax.dot(ds.astype(q.dtype).T, q), dv

    zeros = jnp.zeros((tl.tk, tl.head_dim), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, tl.t // tl.tq, chunk, (zeros, zeros))
    out.dk[...] = dk.astype(out.dk.dtype)
    out.dv[...] = dv.astype(out.dv.dtype)


def _dbias_kernel(tl: Tiles, ops: QueryGrad, out_ref):
    """The bias gradient of one [Q, C] tile, summed over the batch."""
    h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, keys = pl.ds(i * tl.tq, tl.tq), pl.ds(j * tl.tk, tl.tk)

    def one_row(b, acc):
        q, do = ops.q[b, rows, h, :], ops.do[b, rows, h, :]
        k = ops.k[b, keys, h, :]
        s, valid = _scores(tl, ops, q, k, b=b, h=h, rows=rows, keys=keys)
        p = softmax.probs(s, valid, ops.lse[b, h, rows])
        dp = softmax.dot(do, ops.v[b, keys, h, :], trans_b=True)
        scale = _scale(tl, ops.drop, b=b, h=h, i=i, j=j)
        return acc + dropped_grad(p, dp, ops.delta[b, h, rows], scale)

    zeros = jnp.zeros((tl.tq, tl.tk), jnp.float32)
    out_ref[...] = jax.lax.fori_loop(0, tl.batch, one_row, zeros)


def _forward(tl: Tiles, x: Inputs, drop: Drop | None):
    name = "decoder_attention_fwd"
    tl = tl.split(name)
    whole = call.whole()
    specs = Forward(
        q=query_tile(tl), k=whole, v=whole, mask=whole, bias=whole, drop=whole_drop(drop)
    )
    (out,) = call.call(
        functools.partial(_fwd_kernel, tl),
        name,
        flops=tl.flops(2),
        grid=(tl.batch, tl.heads, tl.t // tl.tq * tl.parts),
        in_specs=(specs,),
        out_specs=(Output(out_tile(tl), out_stat(tl)),),
        out_shape=(
            Output(
                out_type(tl, x.q.shape, x.q.dtype, x.q),
                out_type(tl, (tl.batch, tl.heads, tl.t), jnp.float32, x.q),
            ),
        ),
    )(Forward(**x._asdict(), drop=drop))
    return tuple(out) if tl.parts == 1 else combine(out.o, out.lse, x.q.dtype)


def _backward(tl: Tiles, x: Inputs, res: Residuals, drop: Drop | None):
    q, do = x.q, res.do
    delta = jnp.einsum("bthk,bthk->bht", do.astype(jnp.float32), res.o.astype(jnp.float32))
    whole, drops = call.whole(), whole_drop(drop)
    dq_tl = tl.split("decoder_attention_dq")
    rows, st, keys = query_tile(dq_tl), stat(dq_tl), key_tile(tl)
    query_grad = QueryGrad(
        q=q, do=do, lse=res.lse, delta=delta, k=x.k, v=x.v, mask=x.mask, bias=x.bias, drop=drop
    )
    (dq,) = call.call(
        functools.partial(_dq_kernel, dq_tl),
        "decoder_attention_dq",
        flops=tl.flops(3),
        grid=(tl.batch, tl.heads, tl.t // tl.tq * dq_tl.parts),
        in_specs=(call.filled(QueryGrad, whole, q=rows, do=rows, lse=st, delta=st, drop=drops),),
        out_specs=(out_tile(dq_tl),),
        out_shape=(out_type(dq_tl, q.shape, q.dtype, q),),
    )(query_grad)
    if dq_tl.parts > 1:
        dq = dq.sum(0).astype(q.dtype)
    (grads,) = call.call(
        functools.partial(_dkv_kernel, tl),
        "decoder_attention_dkv",
        flops=tl.flops(4),
        grid=(tl.batch, tl.heads, tl.s // tl.tk),
        in_specs=(call.filled(KeyGrad, whole, k=keys, v=keys, drop=drops),),
        out_specs=(KeyGrads(dk=keys, dv=keys),),
        out_shape=(
            KeyGrads(
                placement.out(x.k.shape, x.k.dtype, q), placement.out(x.v.shape, x.v.dtype, q)
            ),
        ),
    )(
        KeyGrad(
            k=x.k, v=x.v, q=q, do=do, lse=res.lse, delta=delta, mask=x.mask, bias=x.bias,
            drop=drop,
        )
    )  # fmt: skip
    if not tl.bias:
        return dq, grads.dk, grads.dv
    (dbias,) = call.call(
        functools.partial(_dbias_kernel, tl),
        "decoder_attention_dbias",
        flops=tl.flops(2),
        grid=(tl.heads, tl.t // tl.tq, tl.s // tl.tk),
        in_specs=(call.filled(QueryGrad, whole, drop=drops),),
        out_specs=(pl.BlockSpec((None, tl.tq, tl.tk), lambda h, i, j: (h, i, j)),),
        out_shape=(placement.out(x.bias.shape, jnp.float32, q),),
    )(query_grad)
    return dq, grads.dk, grads.dv, dbias


_STAT = ("batch", "heads", None)


def _placed(tl: Tiles, run, records: tuple, outs: tuple):
    """run(tiles of each device's shard, *records) on each device's own rows and heads,
    `records` the inputs (the backward's residuals) and the dropout; the forward and the
    backward are placed apart, so their residuals are ordinary arrays. The bias' gradient lacks
    `batch` and is summed over the rows' devices."""
    bias = ("heads", None, None) if tl.bias else (None, None, None)
    rows = placement.ROWS
    inputs = Inputs(q=rows, k=rows, v=rows, mask=("batch", None, None), bias=bias)
    residuals = Residuals(o=rows, lse=_STAT, do=rows)
    axes: tuple[Inputs | Residuals | Drop, ...] = (inputs, residuals)[: len(records) - 1]
    axes += (Drop._make(DROP_AXES),)

    def on_shard(shards: tuple):
        q = shards[0].q
        return run(dataclasses.replace(tl, batch=q.shape[0], heads=q.shape[2]), *shards)

    outs = tuple(bias if o == "bias" else o for o in outs)
    return placement.on_own_records(on_shard, records, axes, outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(tl: Tiles, x: Inputs, drop: Drop | None):
    return _placed(tl, _forward, (x, drop), (placement.ROWS, _STAT))[0]


def _attention_fwd(tl: Tiles, x: Inputs, drop: Drop | None):
    o, lse = _placed(tl, _forward, (x, drop), (placement.ROWS, _STAT))
    o, lse = call.saveable(o, lse)
    return o, (x, o, lse, drop)


def _attention_bwd(tl: Tiles, saved, do):
    x, o, lse, drop = saved
    outs = (placement.ROWS,) * 3 + (("bias",) if tl.bias else ())
    grads = _placed(tl, _backward, (x, Residuals(o=o, lse=lse, do=do), drop), outs)
    dbias = grads[3] if tl.bias else jnp.zeros_like(x.bias)
    return Inputs(q=grads[0], k=grads[1], v=grads[2], mask=None, bias=dbias), None


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
    tl = Tiles(
        batch=b, heads=h, head_dim=k, tq=tq, tk=tk, t=tp, s=sp, mask_rows=rows,
        bias=bias_HTS is not None, rate=rate,
    )  # fmt: skip
    q = call.pad(q_BTHK, {1: tp})
    keys, values = call.pad(k_BSHK, {1: sp}), call.pad(v_BSHK, {1: sp})
    mask = call.pad(mask.astype(jnp.int8), {1: tp if rows > 1 else 1, 2: sp})
    if bias_HTS is None:
        bias = jnp.zeros((1, 1, 1), jnp.float32)
    else:
        bias = call.pad(bias_HTS.astype(jnp.float32), {1: tp, 2: sp})
    drop = Drop.of(dropout[0], dropout[1], h) if dropout and rate else None
    x = Inputs(q=q, k=keys, v=values, mask=mask, bias=bias)
    return _attention(tl, x, drop)[:, :t]
