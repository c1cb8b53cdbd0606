"""Building blocks of the fused encoder attention kernels (`encoder`, `encoder_grad`): block
specs over [B, L, H, K] arrays and the masked scores of a query block against its local and
side keys, shared by the forward and backward kernels (the geometry is `encoder_geometry`'s).
Letter key as `model.long_attention`."""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from longt5_jax.kernels import call, softmax
from longt5_jax.kernels.dropout import SIDE_KEYS
from longt5_jax.kernels.encoder_geometry import Geometry, Inputs, Side


def _rows(geo: Geometry, rows: int) -> tuple[int, int]:
    """(rows a block spec takes, its last block index): `rows` (W where 0) of an [L] axis."""
    size = rows or geo.w
    return size, geo.n * geo.w // size - 1


def tile(
    geo: Geometry, shift: int = 0, order=(0, 1, 2), per: int = 1, rows: int = 0
) -> pl.BlockSpec:
    """[W, K] of a [B, L, H, K] array at block n + shift (clamped), for grid axes (b, h, n)
    (n // per where the grid has `per` programs a block); `rows`: [rows, K] at n, unshifted."""
    size, last = _rows(geo, rows)

    def index(*ids):
        b, h, n = (ids[i] for i in order)
        return b, jnp.clip(n // per + shift, 0, last), h, 0

    return pl.BlockSpec((None, size, None, geo.head_dim), index)


def row(geo: Geometry, shift: int = 0, order=(0, 1, 2), per: int = 1, rows: int = 0):
    """[W] of a [B, L] array at block n + shift (clamped; n // per and `rows` as `tile`)."""
    size, last = _rows(geo, rows)

    def index(*ids):
        b, _, n = (ids[i] for i in order)
        return b, jnp.clip(n // per + shift, 0, last)

    return pl.BlockSpec((None, size), index)


def stat(geo: Geometry, shift: int = 0, per: int = 1, rows: int = 0) -> pl.BlockSpec:
    """[W] of a [B, H, L] float32 statistic at block n + shift (clamped; n // per and `rows`
    as `tile`)."""
    size, last = _rows(geo, rows)
    return pl.BlockSpec(
        (None, None, size), lambda b, h, n: (b, h, jnp.clip(n // per + shift, 0, last))
    )


def key_part(geo: Geometry, rows: bool = False) -> pl.BlockSpec:
    """[kb, K] of a [B, L, H, K] array (or [kb] of a [B, L] one with `rows`): part n of the
    keys, for grid axes (b, h, n) over the parts."""
    if rows:
        return pl.BlockSpec((None, geo.key_chunk), lambda b, h, n: (b, n))
    return pl.BlockSpec((None, geo.key_chunk, None, geo.head_dim), lambda b, h, n: (b, n, h, 0))


def bias_spec(geo: Geometry, rows: int = 0) -> pl.BlockSpec:
    """The [W, 3W] local bias of head h (`rows`: its [rows, 3W] of program n's part of a query
    block, grid axes (b, h, n) over the parts)."""
    size, _ = _rows(geo, rows)
    parts = geo.w // size
    return pl.BlockSpec((None, size, 3 * geo.w), lambda b, h, n: (h, n % parts, 0))


def local_masked(geo: Geometry, s, seg_q, seg_k, *, n, c, part):
    """Scores [W, kb] of query block n against part `part` of key block n - 1 + c, -inf where a
    key is out of range or of another segment, or the query is padding; a key beyond the
    radius is NEG already (`long_attention.local_bias`). Where the query block and the keys
    are all of one segment (a long input's every block but its last) nothing is masked: the
    comparisons and selects cost 4-6 instructions an element, as much as the exponential
    (SASS, sm_90a; a distance mask computed here kept its iotas in registers: 186 -> 248 in
    the forward)."""
    kblock = n - 1 + c
    inside = (kblock >= 0) & (kblock < geo.n) & (n >= 0) & (n < geo.n)
    lowest = jnp.minimum(jnp.min(seg_q), jnp.min(seg_k))
    whole = inside & (lowest > 0) & (lowest == jnp.maximum(jnp.max(seg_q), jnp.max(seg_k)))

    def masked(s):
        same = (seg_q[:, None] == seg_k[None, :]) & (seg_q[:, None] > 0)
        return jnp.where(same & inside, s, -jnp.inf)

    return jax.lax.cond(whole, lambda s: s, masked, s)


class SideRows(NamedTuple):
    """Which global block's row of a [U, C] side slab each query of a block reads: row 0 for
    queries in none, row u for global block `first` + u - 1 (the blocks a window meets are
    consecutive, `global_blocks` numbers them along the row)."""

    onehot: jax.Array  # [W, U] bfloat16: each query's row
    first: jax.Array  # scalar int32 (G where no query is in a global block)
    segments: jax.Array  # [U] int32, the segment of each row's global block (-1: none)


def side_rows(geo: Geometry, gq, segments_ref, b) -> SideRows:
    present = gq >= 0
    first = jnp.min(jnp.where(present, gq, geo.g))
    u = jnp.where(present, gq - first + 1, 0)
    onehot = (u[:, None] == jnp.arange(geo.u)[None, :]).astype(jnp.bfloat16)
    blocks = first - 1 + jnp.arange(geo.u)
    real = (jnp.arange(geo.u) > 0) & (blocks < geo.g)
    segments = jnp.where(real, segments_ref[b, jnp.clip(blocks, 0, geo.g - 1)], -1)
    return SideRows(onehot, first, segments)


def side_slab(geo: Geometry, rows: SideRows, side: SideOperands, *, j, h, b):
    """[U, C] float32: the side bias of each row's global block to side keys chunk j, NEG where
    their segments differ. A query's bias and mask depend on its global block alone (its own
    segment is its block's; a query in none sees no side key), so a block's [W, C] terms are
    onehot @ slab, on the tensor cores (`select_sum`): gathering them per query cost 10
    instructions an element, a third of the side loop's (SASS, sm_90a)."""
    g = j * geo.side_chunk + jnp.arange(geo.side_chunk)
    blocks = rows.first - 1 + jnp.arange(geo.u)
    index = jnp.clip(g[None, :] - blocks[:, None] - 1 + geo.g, 0, 2 * geo.g - 1)
    same = (
        rows.segments[:, None]
        == side.segments[b, pl.ds(j * geo.side_chunk, geo.side_chunk)][None, :]
    )
    return jnp.where(same, side.bias[h, index], softmax.NEG)


def local_columns(geo: Geometry, c, part):
    """The columns of part `part` of key block c in a [W, 3W] local bias (or its gradient)."""
    return pl.ds(c * geo.w + part * geo.key_chunk, geo.key_chunk)


def local_bias(geo: Geometry, bias_ref, c, part):
    """[W, kb] of the local bias: its columns of part `part` of key block c."""
    return bias_ref[:, local_columns(geo, c, part)]


def side_chunk(geo: Geometry, q, side: SideOperands, rows: SideRows, *, j, b, h):
    """(biased and masked scores, keys, values) of a query block against side keys chunk j."""
    keys = pl.ds(j * geo.side_chunk, geo.side_chunk)
    slab = side_slab(geo, rows, side, j=j, h=h, b=b)
    k = side.k[b, keys, h, :]
    s = softmax.select_sum(rows.onehot, slab, into=softmax.dot(q, k, trans_b=True))
    return s, k, side.v[b, keys, h, :]


def query_ids(geo: Geometry, n, rows: int = 0):
    """Token positions of query block n (`rows`: of part n of rows each)."""
    size, _ = _rows(geo, rows)
    return n * size + jnp.arange(size)


def local_key_ids(geo: Geometry, n, c, part):
    """Token positions of part `part` of key block n - 1 + c (the XLA path's n W + x - W)."""
    return (n - 1 + c) * geo.w + part * geo.key_chunk + jnp.arange(geo.key_chunk)


def side_key_ids(geo: Geometry, j):
    return SIDE_KEYS + j * geo.side_chunk + jnp.arange(geo.side_chunk)


class Local(NamedTuple):
    """A query block's local operands (arrays, or their block specs): its queries and their
    segments, key blocks n - 1, n, n + 1 (or, looped, the whole arrays thrice) with theirs, and
    the local bias."""

    q: Any
    keys: tuple
    values: tuple
    seg_q: Any
    seg_keys: tuple
    bias: Any


def local_operands(geo: Geometry, x: Inputs) -> tuple[Local, Local]:
    """(arrays, block specs) of the local part, for grid (b, h, n) over the parts of query
    blocks (`Geometry.split` a block); looped, the keys' whole arrays."""
    qw, per = geo.query_rows, geo.split
    keys = tuple(tile(geo, s - 1, per=per) for s in range(3))
    rows = tuple(row(geo, s - 1, per=per) for s in range(3))
    if geo.looped:
        keys = rows = (call.whole(),) * 3
    specs = Local(
        q=tile(geo, rows=qw), keys=keys, values=keys, seg_q=row(geo, rows=qw), seg_keys=rows,
        bias=bias_spec(geo, rows=qw),
    )  # fmt: skip
    arrays = Local(
        q=x.q, keys=(x.k,) * 3, values=(x.v,) * 3, seg_q=x.seg, seg_keys=(x.seg,) * 3, bias=x.bias
    )
    return arrays, specs


def query_part(geo: Geometry, n):
    """(query block, part of it, token positions) of program n of the forward or dq."""
    return n // geo.split, n % geo.split, query_ids(geo, n, geo.query_rows)


def local_pass(geo: Geometry, fn, state, *, c: int, part: int, half):
    """fn(state) for local chunk (c, part), or state where this part of the query block is
    beyond its keys (`Geometry.beyond`)."""
    skip = geo.beyond(c, part)
    if not skip:
        return fn(state)
    skipped = functools.reduce(operator.or_, [half == s for s in skip])
    return jax.lax.cond(skipped, lambda s: s, fn, state)


def local_keys(geo: Geometry, local: Local, fn, state, *, n, b, h, half, q, seg_q):
    """fn(state, scores, keys, values, keys=key ids) over each local chunk of query block n (of
    the `local` refs), the scores
    biased and masked. Unrolled, each chunk reads its key block's tile and a split program
    skips the chunks beyond it; looped (`Geometry.looped`), one chunk an iteration from the
    whole arrays, none skipped: the unrolled chunks' loads, issued early, held the forward's
    registers at 156 where its side loop needs 122 (ptxas, sm_90a, base TGlobal); looped in 2
    stages, 125: two programs an SM."""
    k_refs, v_refs, sk_refs, bias_ref = local.keys, local.values, local.seg_keys, local.bias

    def chunk(state, c, part, load):  # load(refs): the chunk's keys of one of the three
        k = load(k_refs)
        s = softmax.dot(q, k, trans_b=True) + local_bias(geo, bias_ref, c, part)
        s = local_masked(geo, s, seg_q, load(sk_refs), n=n, c=c, part=part)
        return fn(state, s, k, load(v_refs), keys=local_key_ids(geo, n, c, part))

    if not geo.looped:
        for c, part in geo.local_chunks:

            def one(state, c=c, part=part):  # loaded inside: a skipped chunk loads nothing
                keys = pl.ds(part * geo.key_chunk, geo.key_chunk)
                return chunk(state, c, part, lambda refs: refs[c][keys])

            state = local_pass(geo, one, state, c=c, part=part, half=half)
        return state

    def step(i, state):  # lax's div and rem: jnp's floor division does not lower to Triton
        c, part = jax.lax.div(i, geo.parts), jax.lax.rem(i, geo.parts)
        keys = pl.ds(
            jnp.clip(n - 1 + c, 0, geo.n - 1) * geo.w + part * geo.key_chunk, geo.key_chunk
        )

        def load(refs):  # from the whole arrays: [B, L, H, K] keys and values, [B, L] segments
            return refs[0][b, keys] if refs is sk_refs else refs[0][b, keys, h]

        return chunk(state, c, part, load)

    return jax.lax.fori_loop(0, 3 * geo.parts, step, state)


def every_key(geo: Geometry, ops, fn, state, *, n, b, h, half, q, seg_q):
    """fn(state, scores, keys, values, keys=key ids) over a query block's local chunks
    (`local_keys`), then, TGlobal's, its side keys a chunk at a time (`ops.local`, `ops.side`:
    the forward's or dq's refs)."""
    state = local_keys(geo, ops.local, fn, state, n=n, b=b, h=h, half=half, q=q, seg_q=seg_q)
    if not geo.g:
        return state
    rows = side_rows(geo, ops.side.blocks[...], ops.side.segments, b)

    def chunk(j, state):
        s, k, v = side_chunk(geo, q, ops.side, rows, j=j, b=b, h=h)
        return fn(state, s, k, v, keys=side_key_ids(geo, j))

    return jax.lax.fori_loop(0, geo.side_padded // geo.side_chunk, chunk, state)


class SideOperands(NamedTuple):
    """TGlobal's side keys as a kernel takes them (arrays, or their block specs): keys,
    values, each query's global block, each side key's segment, the side bias by distance."""

    k: Any
    v: Any
    blocks: Any
    segments: Any
    bias: Any


def side_operands(geo: Geometry, side: Side, gq) -> tuple[SideOperands, SideOperands]:
    """(arrays, block specs) of the side keys, for the grid of `local_operands`."""
    whole = call.whole()
    specs = call.filled(SideOperands, whole, blocks=row(geo, rows=geo.query_rows))
    arrays = SideOperands(
        k=side.k_BGHK, v=side.v_BGHK, blocks=gq, segments=side.global_segment_ids,
        bias=side.bias_HD,
    )  # fmt: skip
    return arrays, specs
