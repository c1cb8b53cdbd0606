"""Backward kernels of the fused encoder attention (FlashAttention-2: the probabilities are
recomputed from the forward's log-sum-exp). See `encoder` for what each reads and
writes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from longt5_jax.kernels import call, placement, softmax
from longt5_jax.kernels import encoder_tiles as tiles
from longt5_jax.kernels.by_distance import sum_by_distance
from longt5_jax.kernels.dropout import Drop, drop_scale, dropped_grad, whole_drop
from longt5_jax.kernels.encoder_geometry import Geometry, Inputs
from longt5_jax.kernels.encoder_operands import (
    BiasGrad,
    KeyGrad,
    KeyGrads,
    QueryBlock,
    QueryGrad,
    RowTerms,
    Saved,
    SideGrad,
    SideGrads,
)


def _dq_kernel(geo: Geometry, ops: QueryGrad, dq_ref):
    b, h = pl.program_id(0), pl.program_id(1)
    n, half, rows = tiles.query_part(geo, pl.program_id(2))
    q, seg_q, do = ops.local.q[...], ops.local.seg_q[...], ops.do[...]
    lse, delta = ops.lse[...], ops.delta[...]

    def grad(keys, s, k, v):
        scale = drop_scale(geo.rate, ops.drop, b, h, queries=rows, keys=keys)
        p = softmax.probs(s, None, lse)
        ds = dropped_grad(p, softmax.dot(do, v, trans_b=True), delta, scale)
        return softmax.dot(ds.astype(k.dtype), k)

    def local(dq, s, k, v, *, keys):
        return dq + grad(keys, s, k, v)

    dq = jnp.zeros((geo.query_rows, geo.head_dim), jnp.float32)
    where = {"n": n, "b": b, "h": h, "half": half}
    dq = tiles.every_key(geo, ops, local, dq, **where, q=q, seg_q=seg_q)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(geo: Geometry, ops: KeyGrad, out: KeyGrads):
    """Local dk, dv of part p of key block m (one program each): it is part p of chunk c of
    query block m + 1 - c."""
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m, part = i // geo.parts, i % geo.parts
    k, v, seg_k = ops.k[...], ops.v[...], ops.seg[...]
    dk = jnp.zeros((geo.key_chunk, geo.head_dim), jnp.float32)
    dv = jnp.zeros((geo.key_chunk, geo.head_dim), jnp.float32)
    for c, block in enumerate(ops.queries):
        n = m + 1 - c
        q, do = block.q[...], block.do[...]
        s = softmax.dot(q, k, trans_b=True) + tiles.local_bias(geo, ops.bias, c, part)
        s = tiles.local_masked(geo, s, block.seg[...], seg_k, n=n, c=c, part=part)
        p = softmax.probs(s, None, block.lse[...])
        queries, keys = tiles.query_ids(geo, n), tiles.local_key_ids(geo, n, c, part)
        scale = drop_scale(geo.rate, ops.drop, b, h, queries=queries, keys=keys)
        dv += softmax.dot((p if scale is None else p * scale).astype(do.dtype).T, do)
        ds = dropped_grad(p, softmax.dot(do, v, trans_b=True), block.delta[...], scale)
        dk += softmax.dot(ds.astype(q.dtype).T, q)
    out.dk[...] = dk.astype(out.dk.dtype)
    out.dv[...] = dv.astype(out.dv.dtype)


def _dbias_kernel(geo: Geometry, ops: BiasGrad, out_ref):
    """Local bias gradient of query blocks i R .. i R + R - 1, summed over them and the batch:
    [W, 3W] per (h, i)."""
    h, i = pl.program_id(0), pl.program_id(1)
    for c, part in geo.local_chunks:
        bias = tiles.local_bias(geo, ops.bias, c, part)

        def one_block(r, acc, bias=bias, c=c, part=part):
            n = i * geo.bias_blocks + r
            rows = pl.ds(n * geo.w, geo.w)
            keys = pl.ds(
                jnp.clip(n - 1 + c, 0, geo.n - 1) * geo.w + part * geo.key_chunk, geo.key_chunk
            )
            queries, key_ids = tiles.query_ids(geo, n), tiles.local_key_ids(geo, n, c, part)

            def one_row(b, acc):
                q, do = ops.q[b, rows, h, :], ops.do[b, rows, h, :]
                s = softmax.dot(q, ops.k[b, keys, h, :], trans_b=True) + bias
                seg_q, seg_k = ops.seg[b, rows], ops.seg[b, keys]
                s = tiles.local_masked(geo, s, seg_q, seg_k, n=n, c=c, part=part)
                p = softmax.probs(s, None, ops.lse[b, h, rows])
                dp = softmax.dot(do, ops.v[b, keys, h, :], trans_b=True)
                scale = drop_scale(geo.rate, ops.drop, b, h, queries=queries, keys=key_ids)
                return acc + dropped_grad(p, dp, ops.delta[b, h, rows], scale)

            return jax.lax.fori_loop(0, geo.batch, one_row, acc)

        zeros = jnp.zeros((geo.w, geo.key_chunk), jnp.float32)
        out_ref[:, tiles.local_columns(geo, c, part)] = jax.lax.fori_loop(
            0, geo.bias_blocks, one_block, zeros
        )


def _side_kernel(geo: Geometry, ops: SideGrad, out: SideGrads):
    """Side dk, dv of chunk j over every query block, and each block's side bias gradient
    summed over the tokens of each global block ([U, C] per block)."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k, v = ops.k[...], ops.v[...]

    def block(n, carry):
        dk, dv = carry
        rows = pl.ds(n * geo.w, geo.w)
        q, do = ops.q[b, rows, h, :], ops.do[b, rows, h, :]
        side_rows = tiles.side_rows(geo, ops.blocks[b, rows], ops.segments, b)
        slab = tiles.side_slab(geo, side_rows, ops, j=j, h=h, b=b)
        s = softmax.select_sum(side_rows.onehot, slab, into=softmax.dot(q, k, trans_b=True))
        p = softmax.probs(s, None, ops.lse[b, h, rows])
        queries, keys = tiles.query_ids(geo, n), tiles.side_key_ids(geo, j)
        scale = drop_scale(geo.rate, ops.drop, b, h, queries=queries, keys=keys)
        dv += softmax.dot((p if scale is None else p * scale).astype(do.dtype).T, do)
        ds = dropped_grad(p, softmax.dot(do, v, trans_b=True), ops.delta[b, h, rows], scale)
        dk += softmax.dot(ds.astype(q.dtype).T, q)
        by_block = softmax.select_sum_t(ds, side_rows.onehot).T
        out.by_block[b, h, n, :, pl.ds(j * geo.side_chunk, geo.side_chunk)] = by_block
        return dk, dv

    zeros = jnp.zeros((geo.side_chunk, geo.head_dim), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, geo.n, block, (zeros, zeros))
    out.dk[...] = dk.astype(out.dk.dtype)
    out.dv[...] = dv.astype(out.dv.dtype)


def backward(geo: Geometry, x: Inputs, extras, saved: Saved):
    """The gradients of q, k, v, the local bias and (TGlobal) the side keys, values and bias;
    `extras` the call's optional inputs (`encoder.Extras`)."""
    do, lse = saved.do, saved.lse
    delta = jnp.einsum("blhk,blhk->bhl", do.astype(jnp.float32), saved.o.astype(jnp.float32))
    dq_geo = geo.splits(geo.kernel("dq"))
    local, local_specs = tiles.local_operands(dq_geo, x)
    query = tiles.tile(dq_geo, rows=dq_geo.query_rows)
    stat = tiles.stat(dq_geo, rows=dq_geo.query_rows)
    side = side_specs = None
    if geo.g:
        side, side_specs = tiles.side_operands(dq_geo, extras.side, extras.gq)
    drop, drops = extras.drop, whole_drop(extras.drop)
    (dq,) = call.call(
        functools.partial(_dq_kernel, dq_geo),
        geo.kernel("dq"),
        flops=dq_geo.flops(3, 3),
        grid=(geo.batch, geo.heads, geo.n * dq_geo.split),
        in_specs=(
            QueryGrad(
                local=local_specs, do=query, lse=stat, delta=stat, side=side_specs, drop=drops
            ),
        ),
        out_specs=(query,),
        out_shape=(placement.out(x.q.shape, x.q.dtype, x.q),),
    )(QueryGrad(local=local, do=do, lse=lse, delta=delta, side=side, drop=drop))

    # Each kernel in its own geometry (`Geometry.splits`: the keys a tile takes, as launched).
    terms = RowTerms(do=do, lse=lse, delta=delta)
    dk, dv = _dkv(geo.splits(geo.kernel("dkv")), x, terms, drop)
    dbias = _dbias(geo.splits(geo.kernel("dbias")), x, terms, drop)
    d_side = (None,) * 3
    if geo.g:
        d_side = _side_backward(geo.splits(geo.kernel("dside")), x.q, terms, extras)
    return dq, dk, dv, dbias, d_side


def _query_block_specs(geo: Geometry, c: int) -> QueryBlock:
    """The block specs of query block m + c that a part of key block m reads."""
    rows, stats = tiles.tile(geo, c, per=geo.parts), tiles.stat(geo, c, per=geo.parts)
    return QueryBlock(q=rows, do=rows, lse=stats, delta=stats, seg=tiles.row(geo, c, per=geo.parts))


def _dkv(geo: Geometry, x: Inputs, terms: RowTerms, drop: Drop | None):
    """Local dk, dv: one program per part of a key block."""
    per = geo.parts
    blocks = tuple(_query_block_specs(geo, 1 - c) for c in range(3))
    part = tiles.key_part(geo)
    specs = KeyGrad(
        k=part, v=part, seg=tiles.key_part(geo, rows=True), bias=tiles.bias_spec(geo),
        queries=blocks, drop=whole_drop(drop),
    )  # fmt: skip
    query = QueryBlock(q=x.q, do=terms.do, lse=terms.lse, delta=terms.delta, seg=x.seg)
    (out,) = call.call(
        functools.partial(_dkv_kernel, geo),
        geo.kernel("dkv"),
        flops=geo.flops(4, 0),
        grid=(geo.batch, geo.heads, geo.n * per),
        in_specs=(specs,),
        out_specs=(KeyGrads(part, part),),
        out_shape=(
            KeyGrads(
                placement.out(x.k.shape, x.k.dtype, x.q), placement.out(x.v.shape, x.v.dtype, x.q)
            ),
        ),
    )(KeyGrad(k=x.k, v=x.v, seg=x.seg, bias=x.bias, queries=(query,) * 3, drop=drop))
    return out.dk, out.dv


def _dbias(geo: Geometry, x: Inputs, terms: RowTerms, drop: Drop | None):
    """The local bias gradient, [H, W, 3W]."""
    whole = call.whole()
    bias = pl.BlockSpec((None, geo.w, 3 * geo.w), lambda h, n: (h, 0, 0))
    specs = call.filled(BiasGrad, whole, bias=bias, drop=whole_drop(drop))
    arrays = BiasGrad(
        q=x.q, k=x.k, v=x.v, do=terms.do, lse=terms.lse, delta=terms.delta, seg=x.seg,
        bias=x.bias, drop=drop,
    )  # fmt: skip
    (out,) = call.call(
        functools.partial(_dbias_kernel, geo),
        geo.kernel("dbias"),
        flops=geo.flops(2, 0),
        grid=(geo.heads, geo.n // geo.bias_blocks),
        in_specs=(specs,),
        out_specs=(pl.BlockSpec((None, None, geo.w, 3 * geo.w), lambda h, i: (h, i, 0, 0)),),
        out_shape=(
            placement.out(
                (geo.heads, geo.n // geo.bias_blocks, geo.w, 3 * geo.w), jnp.float32, x.q
            ),
        ),
    )(arrays)
    return out.sum(1)


def _side_backward(geo: Geometry, q, terms: RowTerms, extras):
    """Side dk, dv and the side bias gradient by distance."""
    side, gq = extras.side, extras.gq
    gq_BNW = gq.reshape(geo.batch, geo.n, geo.w)
    present = gq_BNW >= 0
    gmin_BN = jnp.where(present.any(-1), jnp.min(jnp.where(present, gq_BNW, geo.g), -1), 0)
    chunk = pl.BlockSpec((None, geo.side_chunk, None, geo.head_dim), lambda b, h, j: (b, j, h, 0))
    whole = call.whole()
    specs = call.filled(SideGrad, whole, k=chunk, v=chunk, drop=whole_drop(extras.drop))
    arrays = SideGrad(
        q=q, do=terms.do, lse=terms.lse, delta=terms.delta, blocks=gq, k=side.k_BGHK,
        v=side.v_BGHK, segments=side.global_segment_ids, bias=side.bias_HD, drop=extras.drop,
    )  # fmt: skip
    (out,) = call.call(
        functools.partial(_side_kernel, geo),
        geo.kernel("dside"),
        flops=geo.flops(0, 4) + 2 * geo.batch * geo.heads * geo.n * geo.u * geo.w * geo.side_padded,
        grid=(geo.batch, geo.heads, geo.side_padded // geo.side_chunk),
        in_specs=(specs,),
        out_specs=(SideGrads(chunk, chunk, whole),),
        out_shape=(
            SideGrads(
                placement.out(side.k_BGHK.shape, side.k_BGHK.dtype, q),
                placement.out(side.v_BGHK.shape, side.v_BGHK.dtype, q),
                placement.out(
                    (geo.batch, geo.heads, geo.n, geo.u, geo.side_padded), jnp.float32, q
                ),
            ),
        ),
    )(arrays)
    # Row u of block n holds the tokens of global block gmin + u - 1 (row 0: of none), whose
    # bias to side key g is bias_HD[g - block - 1 + G]: `shifted_rows` with shift = block + 1.
    shift_BNU = jnp.where(jnp.arange(geo.u) == 0, 0, gmin_BN[..., None] + jnp.arange(geo.u))
    shift_BNU = jnp.clip(shift_BNU, 0, geo.g)
    d_bias_BHD = sum_by_distance(out.by_block[..., : geo.g], shift_BNU, geo.g)
    return out.dk, out.dv, d_bias_BHD.sum(0)
