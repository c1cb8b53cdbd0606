"""LongT5 encoder attention (Local and TGlobal) fused into Pallas kernels (Triton backend).

The spec is `long_attention.LongSelfAttention`'s XLA path; this computes the same attention
without ever writing a score or probability tensor to HBM. Letter key as there, plus C side
keys per chunk and U rows of the one-hot that sums a query block's side-bias gradient by global
block. Layout: q, k, v and the output stay [B, L, H, K] (no heads-major transposes): a block
load [W, K] at (b, n, h) is a strided read.

Per program of the forward (grid B x H x N; B x H x 2N with query blocks split in two by the launch
settings, `Geometry.splits`), on chip: the query block [W, K], one key and value block [W, K] at a
time (blocks n-1, n, n+1; the window is |i - j| < W), the [W, W] slice of the local bias, then the
side keys and values C at a time with their [W, C] bias and mask as a one-hot matmul
(`encoder_tiles.side_slab`: a query's side terms depend on its global block alone); one online
softmax over all of them, invalid keys an additive NEG or -inf. HBM per program: q, the three k and
v blocks, G side k and v rows (from L2 after the first head), the output and a [W] log-sum-exp. The
backward recomputes the probabilities from that log-sum-exp (FlashAttention-2): dq by query block;
local dk, dv by key block (its three query blocks); side dk, dv by chunk of side keys over all
query blocks; the local bias gradient as [H, N / R, W, 3W] partial sums over the batch and R query
blocks (XLA sums the rest); the side bias gradient summed in-kernel over the tokens of each global
block (a [U, W] one-hot matmul, U << W), then by distance in XLA. Rows that see no key (padding)
output 0. Attention dropout is drawn per tile from `dropout.attention_keep`, the XLA path's masks.

Each kernel declares its tensor-core FLOPs in its name (`NAME.flops_N`): XLA has no cost for a
custom call, and `estimate.roofline` reads them from there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from longt5_jax.kernels import call, placement, softmax
from longt5_jax.kernels import encoder_grad as grad
from longt5_jax.kernels import encoder_tiles as tiles
from longt5_jax.kernels.dropout import DROP_AXES, Drop, drop_scale, whole_drop
from longt5_jax.kernels.encoder_geometry import Geometry, Inputs, Side, geometry
from longt5_jax.kernels.encoder_operands import Forward, Output, Saved

__all__ = ["Side", "encoder_attention"]


# -- forward ------------------------------------------------------------------------------------


def _fwd_kernel(geo: Geometry, ops: Forward, out: Output):
    b, h = pl.program_id(0), pl.program_id(1)
    n, half, rows = tiles.query_part(geo, pl.program_id(2))
    q, seg_q = ops.local.q[...], ops.local.seg_q[...]
    state = (
        jnp.full((geo.query_rows,), -jnp.inf, jnp.float32),
        jnp.zeros((geo.query_rows,), jnp.float32),
        jnp.zeros((geo.query_rows, geo.head_dim), jnp.float32),
    )

    def local(state, s, _, v, *, keys):
        scale = drop_scale(geo.rate, ops.drop, b, h, queries=rows, keys=keys)
        return softmax.online(state, s, None, v, scale=scale)

    where = {"n": n, "b": b, "h": h, "half": half}
    state = tiles.every_key(geo, ops, local, state, **where, q=q, seg_q=seg_q)
    m, l, acc = state
    seen = softmax.seen(m)
    out.o[...] = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0).astype(
        out.o.dtype
    )
    out.lse[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)


def _forward(geo: Geometry, x: Inputs, extras: Extras):
    name = geo.kernel("fwd")
    geo = geo.splits(name)
    local, local_specs = tiles.local_operands(geo, x)
    side_ops = side_specs = None
    if geo.g:
        assert extras.side is not None  # geo.g counts the side keys
        side_ops, side_specs = tiles.side_operands(geo, extras.side, extras.gq)
    assert x.seg is not None  # only a gradient lacks the segment ids
    b, length = x.seg.shape
    (out,) = call.call(
        functools.partial(_fwd_kernel, geo),
        name,
        flops=geo.flops(2, 2),
        grid=(geo.batch, geo.heads, geo.n * geo.split),
        in_specs=(Forward(local_specs, side_specs, whole_drop(extras.drop)),),
        out_specs=(
            Output(tiles.tile(geo, rows=geo.query_rows), tiles.stat(geo, rows=geo.query_rows)),
        ),
        out_shape=(
            Output(
                placement.out(x.q.shape, x.q.dtype, x.q),
                placement.out((b, geo.heads, length), jnp.float32, x.q),
            ),
        ),
    )(Forward(local, side_ops, extras.drop))
    return tuple(out)


# -- the differentiable function ----------------------------------------------------------------


# The kernels run on each device's own rows and heads (`placement.on_own_rows_and_heads`): the
# forward and the backward are placed, each a call of its own, so that the residuals between
# them are ordinary arrays. Logical axes of every array a call takes or gives:
_SIDE = [placement.ROWS, placement.ROWS, ("heads", None), None, ("batch", None)]  # Side's fields
_STAT = ("batch", "heads", None)  # the log-sum-exp [B, H, L]


def _flat(side: Side | None) -> list:
    return [] if side is None else [x for x in side if x is not None]


def _side_axes(side: Side | None) -> list:
    return [] if side is None else [a for a, x in zip(_SIDE, side, strict=True) if x is not None]


class Extras(NamedTuple):
    """The optional inputs: TGlobal's side keys and each token's global block (None for
    Local), the dropout's arrays (None without)."""

    side: Side | None
    gq: jax.Array | None
    drop: Drop | None


def _optional(extras: Extras) -> tuple[list, list]:
    """The optional inputs in their order (the side's fields and block ids, the dropout's) and
    their logical axes."""
    arrays, axes = [], []
    if extras.side is not None:
        arrays += [*_flat(extras.side), extras.gq]
        axes += [*_side_axes(extras.side), ("batch", None)]
    if extras.drop is not None:
        arrays += list(extras.drop)
        axes += DROP_AXES
    return arrays, axes


def _unpack(geo, rest) -> Extras:
    """The optional inputs back from `_optional`'s arrays on a device."""
    side: Side | None = None
    gq: jax.Array | None = None
    drop: Drop | None = None
    if geo.g:
        side = Side(
            k_BGHK=rest[0], v_BGHK=rest[1], bias_HD=rest[2], block_ids=None,
            global_segment_ids=rest[3],
        )  # fmt: skip
        gq, rest = rest[4], rest[5:]
    if geo.rate:
        drop = Drop._make(rest[:3])
    return Extras(side, gq, drop)


def _local(geo, q):
    return dataclasses.replace(geo, batch=q.shape[0], heads=q.shape[2])


def _placed_forward(geo: Geometry, x: Inputs, extras: Extras):
    def forward(q, k, v, seg, bias, *rest):
        x = Inputs(q=q, k=k, v=v, seg=seg, bias=bias)
        return _forward(_local(geo, q), x, _unpack(geo, rest))

    extra, extra_axes = _optional(extras)
    axes = [placement.ROWS] * 3 + [("batch", None), ("heads", None, None), *extra_axes]
    return placement.on_own_rows_and_heads(forward, [*x, *extra], axes, (placement.ROWS, _STAT))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(geo: Geometry, x: Inputs, extras: Extras):
    return _placed_forward(geo, x, extras)[0]


def _attention_fwd(geo: Geometry, x: Inputs, extras: Extras):
    o, lse = call.saveable(*_placed_forward(geo, x, extras))
    return o, (x, extras, o, lse)


def _attention_bwd(geo: Geometry, saved, do):
    x, extras, o, lse = saved

    def backward(q, k, v, seg, bias, o, lse, do, *rest):
        local = _unpack(geo, rest)
        saved = Saved(o=o, lse=lse, do=do)
        x = Inputs(q=q, k=k, v=v, seg=seg, bias=bias)
        dq, dk, dv, dbias, d_side = grad.backward(_local(geo, q), x, local, saved)
        return (dq, dk, dv, dbias) + (d_side if local.side is not None else ())

    extra, extra_axes = _optional(extras)
    axes = [placement.ROWS] * 3 + [("batch", None), ("heads", None, None), placement.ROWS, _STAT]
    axes += [placement.ROWS, *extra_axes]
    # The bias tables' gradients lack `batch`: the placement sums them over the rows' devices.
    outs: tuple[tuple[str | None, ...], ...]
    outs = (placement.ROWS, placement.ROWS, placement.ROWS, ("heads", None, None))
    if extras.side is not None:
        outs += (placement.ROWS, placement.ROWS, ("heads", None))
    grads = placement.on_own_rows_and_heads(backward, [*x, o, lse, do, *extra], axes, outs)
    d_side = None
    if extras.side is not None:
        d_side = Side(
            k_BGHK=grads[4], v_BGHK=grads[5], bias_HD=grads[6], block_ids=None,
            global_segment_ids=None,
        )  # fmt: skip
    d_inputs = Inputs(q=grads[0], k=grads[1], v=grads[2], seg=None, bias=grads[3])
    return d_inputs, Extras(d_side, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def encoder_attention(
    q_BLHK: jax.Array,
    k_BLHK: jax.Array,
    v_BLHK: jax.Array,
    segment_ids: jax.Array,
    *,
    local_bias_HWX: jax.Array,
    side: Side | None,
    global_block_size: int,
    dropout: tuple[jax.Array, jax.Array, float] | None = None,
) -> jax.Array:
    """[B, L, H, K] attention output, normalised, in q's dtype (0 for padding rows); under a
    mesh, on each device's own rows and heads (`placement.on_own_rows_and_heads`). The local bias
    is NEG beyond the radius (`long_attention.local_bias`). `dropout`:
    (the layer's int32 seed, the rows' global ids [B], rate), as `dropout.attention_keep`."""
    length, w = q_BLHK.shape[1], local_bias_HWX.shape[1]
    g = 0 if side is None else side.k_BGHK.shape[1]
    rate = dropout[2] if dropout else 0.0
    geo = geometry(q_BLHK, w=w, g=g, global_block=global_block_size, rate=rate)
    lp = geo.n * w
    q, k, v = (call.pad(x, {1: lp}) for x in (q_BLHK, k_BLHK, v_BLHK))
    seg = call.pad(segment_ids.astype(jnp.int32), {1: lp})
    gq = drop = None
    if geo.g:
        # geo.g counts the side keys, which come with each token's global block
        assert side is not None and side.block_ids is not None
        assert side.global_segment_ids is not None
        gq = call.pad(side.block_ids.astype(jnp.int32), {1: lp}, -1)
        side = Side(
            k_BGHK=call.pad(side.k_BGHK, {1: geo.side_padded}),
            v_BGHK=call.pad(side.v_BGHK, {1: geo.side_padded}),
            bias_HD=side.bias_HD.astype(jnp.float32),
            block_ids=None,
            global_segment_ids=call.pad(
                side.global_segment_ids.astype(jnp.int32), {1: geo.side_padded}
            ),
        )
    else:
        side = None
    if geo.rate:
        assert dropout is not None  # geo.rate is dropout's
        drop = Drop.of(dropout[0], dropout[1], geo.heads)
    bias = local_bias_HWX.astype(jnp.float32)
    x = Inputs(q=q, k=k, v=v, seg=seg, bias=bias)
    return _attention(geo, x, Extras(side=side, gq=gq, drop=drop))[:, :length]
