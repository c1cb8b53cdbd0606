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
from longt5_jax.kernels.dropout import drop_scale, dropped_grad
from longt5_jax.kernels.encoder_geometry import Geometry, Side


def _dq_kernel(geo: Geometry, *refs):
    dq_ref, (own, side_refs, drop_refs) = refs[-1], tiles.split_refs(geo, refs[:-1], 15)
    q_ref, k_refs, v_refs = own[0], own[1:4], own[4:7]
    sq_ref, sk_refs, bias_ref = own[7], own[8:11], own[11]
    do_ref, lse_ref, delta_ref = own[12:15]
    b, h = pl.program_id(0), pl.program_id(1)
    n, half, rows = tiles.query_part(geo, pl.program_id(2))
    q, seg_q, do = q_ref[...], sq_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def grad(keys, s, k, v):
        scale = drop_scale(geo.rate, drop_refs, b, h, rows, keys)
        p = softmax.probs(s, None, lse)
        ds = dropped_grad(p, softmax.dot(do, v, trans_b=True), delta, scale)
        return softmax.dot(ds.astype(k.dtype), k)

    def local(dq, s, k, v, keys):
        return dq + grad(keys, s, k, v)

    dq = jnp.zeros((geo.qw, geo.head_dim), jnp.float32)
    local_refs = (k_refs, v_refs, sk_refs, bias_ref)
    dq = tiles.local_keys(geo, n, b, h, half, local_refs, q, seg_q, local, dq)
    if geo.g:
        side_rows = tiles.side_rows(geo, side_refs[2][...], side_refs[3], b)

        def chunk(j, dq):
            s, k, v = tiles.side_chunk(geo, q, j, b, h, side_rows, side_refs)
            return dq + grad(tiles.side_key_ids(geo, j), s, k, v)

        dq = jax.lax.fori_loop(0, geo.gp // geo.c, chunk, dq)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(geo: Geometry, *refs):
    """Local dk, dv of part p of key block m (one program each): it is part p of chunk c of
    query block m + 1 - c."""
    (dk_ref, dv_ref), (own, _, drop_refs) = refs[-2:], tiles.split_refs(geo, refs[:-2], 19)
    k_ref, v_ref, sk_ref, bias_ref = own[:4]
    per_query = [own[4 + 5 * c : 9 + 5 * c] for c in range(3)]
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m, part = i // geo.parts, i % geo.parts
    k, v, seg_k = k_ref[...], v_ref[...], sk_ref[...]
    dk = jnp.zeros((geo.kb, geo.head_dim), jnp.float32)
    dv = jnp.zeros((geo.kb, geo.head_dim), jnp.float32)
    for c, (q_ref, do_ref, lse_ref, delta_ref, sq_ref) in enumerate(per_query):
        n = m + 1 - c
        q, do = q_ref[...], do_ref[...]
        s = softmax.dot(q, k, trans_b=True) + tiles.local_bias(geo, bias_ref, c, part)
        s = tiles.local_masked(geo, s, n, c, part, sq_ref[...], seg_k)
        p = softmax.probs(s, None, lse_ref[...])
        queries, keys = tiles.query_ids(geo, n), tiles.local_key_ids(geo, n, c, part)
        scale = drop_scale(geo.rate, drop_refs, b, h, queries, keys)
        dv += softmax.dot((p if scale is None else p * scale).astype(do.dtype).T, do)
        ds = dropped_grad(p, softmax.dot(do, v, trans_b=True), delta_ref[...], scale)
        dk += softmax.dot(ds.astype(q.dtype).T, q)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dbias_kernel(geo: Geometry, *refs):
    """Local bias gradient of query blocks i R .. i R + R - 1, summed over them and the batch:
    [W, 3W] per (h, i)."""
    out_ref, (own, _, drop_refs) = refs[-1], tiles.split_refs(geo, refs[:-1], 8)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, bias_ref = own
    h, i = pl.program_id(0), pl.program_id(1)
    for c, part in geo.local_chunks:
        bias = tiles.local_bias(geo, bias_ref, c, part)

        def one_block(r, acc, bias=bias, c=c, part=part):
            n = i * geo.rb + r
            rows = pl.ds(n * geo.w, geo.w)
            keys = pl.ds(jnp.clip(n - 1 + c, 0, geo.n - 1) * geo.w + part * geo.kb, geo.kb)
            queries, key_ids = tiles.query_ids(geo, n), tiles.local_key_ids(geo, n, c, part)

            def one_row(b, acc):
                q, do = q_ref[b, rows, h, :], do_ref[b, rows, h, :]
                s = softmax.dot(q, k_ref[b, keys, h, :], trans_b=True) + bias
                s = tiles.local_masked(geo, s, n, c, part, seg_ref[b, rows], seg_ref[b, keys])
                p = softmax.probs(s, None, lse_ref[b, h, rows])
                dp = softmax.dot(do, v_ref[b, keys, h, :], trans_b=True)
                scale = drop_scale(geo.rate, drop_refs, b, h, queries, key_ids)
                return acc + dropped_grad(p, dp, delta_ref[b, h, rows], scale)

            return jax.lax.fori_loop(0, geo.batch, one_row, acc)

        zeros = jnp.zeros((geo.w, geo.kb), jnp.float32)
        out_ref[:, tiles.local_columns(geo, c, part)] = jax.lax.fori_loop(
            0, geo.rb, one_block, zeros
        )


def _side_kernel(geo: Geometry, *refs):
    """Side dk, dv of chunk j over every query block, and each block's side bias gradient
    summed over the tokens of each global block ([U, C] per block)."""
    (dk_ref, dv_ref, r_ref), (own, _, drop_refs) = refs[-3:], tiles.split_refs(geo, refs[:-3], 9)
    q_ref, do_ref, lse_ref, delta_ref, gq_ref = own[:5]
    sk_ref, sv_ref, gseg_ref, sbias_ref = own[5:]
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k, v = sk_ref[...], sv_ref[...]

    def block(n, carry):
        dk, dv = carry
        rows = pl.ds(n * geo.w, geo.w)
        q, do = q_ref[b, rows, h, :], do_ref[b, rows, h, :]
        side_rows = tiles.side_rows(geo, gq_ref[b, rows], gseg_ref, b)
        slab = tiles.side_slab(geo, side_rows, j, h, b, gseg_ref, sbias_ref)
        s = softmax.select_sum(side_rows.onehot, slab, into=softmax.dot(q, k, trans_b=True))
        p = softmax.probs(s, None, lse_ref[b, h, rows])
        queries, keys = tiles.query_ids(geo, n), tiles.side_key_ids(geo, j)
        scale = drop_scale(geo.rate, drop_refs, b, h, queries, keys)
        dv += softmax.dot((p if scale is None else p * scale).astype(do.dtype).T, do)
        ds = dropped_grad(p, softmax.dot(do, v, trans_b=True), delta_ref[b, h, rows], scale)
        dk += softmax.dot(ds.astype(q.dtype).T, q)
        r_ref[b, h, n, :, pl.ds(j * geo.c, geo.c)] = softmax.select_sum_t(ds, side_rows.onehot).T
        return dk, dv

    zeros = jnp.zeros((geo.c, geo.head_dim), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, geo.n, block, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(geo: Geometry, res, do):
    q, k, v, seg, bias, side, gq, o, lse, drop = res
    delta = jnp.einsum("blhk,blhk->bhl", do.astype(jnp.float32), o.astype(jnp.float32))
    dq_geo = geo.splits(geo.kernel("dq"))
    specs, arrays = tiles.local_inputs(dq_geo, q, k, v, seg, bias)
    query = tiles.tile(dq_geo, rows=dq_geo.qw)
    specs += [query] + [tiles.stat(dq_geo, rows=dq_geo.qw)] * 2
    arrays += [do, lse, delta]
    if geo.g:
        side_specs, side_arrays = tiles.side_inputs(dq_geo, side, gq)
        specs, arrays = specs + side_specs, arrays + side_arrays
    specs, arrays = tiles.with_drop(geo, specs, arrays, drop)
    dq = call.call(
        functools.partial(_dq_kernel, dq_geo),
        geo.kernel("dq"),
        flops=dq_geo.flops(3, 3),
        grid=(geo.batch, geo.heads, geo.n * dq_geo.split),
        in_specs=specs,
        out_specs=query,
        out_shape=placement.out(q.shape, q.dtype, q),
    )(*arrays)

    # Each kernel in its own geometry (`Geometry.splits`: the keys a tile takes, as launched).
    local = (q, k, v, seg, bias, lse, delta, do, drop)
    dk, dv = _dkv(geo.splits(geo.kernel("dkv")), *local)
    dbias = _dbias(geo.splits(geo.kernel("dbias")), *local)
    d_side = (None,) * 3
    if geo.g:
        d_side = _side_backward(geo.splits(geo.kernel("dside")), q, do, lse, delta, gq, side, drop)
    return dq, dk, dv, dbias, d_side


def _dkv(geo: Geometry, q, k, v, seg, bias, lse, delta, do, drop):
    """Local dk, dv: one program per part of a key block."""
    per = geo.parts
    per_query = [
        [tiles.tile(geo, 1 - c, per=per)] * 2
        + [tiles.stat(geo, 1 - c, per=per)] * 2
        + [tiles.row(geo, 1 - c, per=per)]
        for c in range(3)
    ]
    part = tiles.key_part(geo)
    specs = [part, part, tiles.key_part(geo, rows=True), tiles.bias_spec(geo)]
    specs, arrays = tiles.with_drop(
        geo, specs + sum(per_query, []), [k, v, seg, bias, *[q, do, lse, delta, seg] * 3], drop
    )
    dk, dv = call.call(
        functools.partial(_dkv_kernel, geo),
        geo.kernel("dkv"),
        flops=geo.flops(4, 0),
        grid=(geo.batch, geo.heads, geo.n * per),
        in_specs=specs,
        out_specs=[part, part],
        out_shape=[placement.out(k.shape, k.dtype, q), placement.out(v.shape, v.dtype, q)],
    )(*arrays)
    return dk, dv


def _dbias(geo: Geometry, q, k, v, seg, bias, lse, delta, do, drop):
    """The local bias gradient, [H, W, 3W]."""
    specs = [call.whole()] * 7 + [pl.BlockSpec((None, geo.w, 3 * geo.w), lambda h, n: (h, 0, 0))]
    specs, arrays = tiles.with_drop(geo, specs, [q, k, v, do, lse, delta, seg, bias], drop)
    return call.call(
        functools.partial(_dbias_kernel, geo),
        geo.kernel("dbias"),
        flops=geo.flops(2, 0),
        grid=(geo.heads, geo.n // geo.rb),
        in_specs=specs,
        out_specs=pl.BlockSpec((None, None, geo.w, 3 * geo.w), lambda h, i: (h, i, 0, 0)),
        out_shape=placement.out((geo.heads, geo.n // geo.rb, geo.w, 3 * geo.w), jnp.float32, q),
    )(*arrays).sum(1)


def _side_backward(geo: Geometry, q, do, lse, delta, gq, side: Side, drop):
    """Side dk, dv and the side bias gradient by distance."""
    gq_BNW = gq.reshape(geo.batch, geo.n, geo.w)
    present = gq_BNW >= 0
    gmin_BN = jnp.where(present.any(-1), jnp.min(jnp.where(present, gq_BNW, geo.g), -1), 0)
    chunk = pl.BlockSpec((None, geo.c, None, geo.head_dim), lambda b, h, j: (b, j, h, 0))
    specs = [call.whole()] * 5 + [chunk, chunk, call.whole(), call.whole()]
    arrays = [q, do, lse, delta, gq, side.k_BGHK, side.v_BGHK]
    specs, arrays = tiles.with_drop(
        geo, specs, arrays + [side.global_segment_ids, side.bias_HD], drop
    )
    dk, dv, r = call.call(
        functools.partial(_side_kernel, geo),
        geo.kernel("dside"),
        flops=geo.flops(0, 4) + 2 * geo.batch * geo.heads * geo.n * geo.u * geo.w * geo.gp,
        grid=(geo.batch, geo.heads, geo.gp // geo.c),
        in_specs=specs,
        out_specs=[chunk, chunk, call.whole()],
        out_shape=[
            placement.out(side.k_BGHK.shape, side.k_BGHK.dtype, q),
            placement.out(side.v_BGHK.shape, side.v_BGHK.dtype, q),
            placement.out((geo.batch, geo.heads, geo.n, geo.u, geo.gp), jnp.float32, q),
        ],
    )(*arrays)
    # Row u of block n holds the tokens of global block gmin + u - 1 (row 0: of none), whose
    # bias to side key g is bias_HD[g - block - 1 + G]: `shifted_rows` with shift = block + 1.
    shift_BNU = jnp.where(jnp.arange(geo.u) == 0, 0, gmin_BN[..., None] + jnp.arange(geo.u))
    shift_BNU = jnp.clip(shift_BNU, 0, geo.g)
    d_bias_BHD = sum_by_distance(r[..., : geo.g], shift_BNU, geo.g)
    return dk, dv, d_bias_BHD.sum(0)
