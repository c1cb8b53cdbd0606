"""Building blocks of the fused encoder attention kernels (`encoder`, `encoder_grad`): block
specs over [B, L, H, K] arrays and the masked scores of a query block against its local and
side keys, shared by the forward and backward kernels (the geometry is `encoder_geometry`'s).
Letter key as `model.long_attention`."""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from longt5_jax.kernels import call, softmax
from longt5_jax.kernels.dropout import SIDE_KEYS, Drop
from longt5_jax.kernels.encoder_geometry import Geometry, Side


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
        return pl.BlockSpec((None, geo.kb), lambda b, h, n: (b, n))
    return pl.BlockSpec((None, geo.kb, None, geo.head_dim), lambda b, h, n: (b, n, h, 0))


def bias_spec(geo: Geometry, rows: int = 0) -> pl.BlockSpec:
    """The [W, 3W] local bias of head h (`rows`: its [rows, 3W] of program n's part of a query
    block, grid axes (b, h, n) over the parts)."""
    size, _ = _rows(geo, rows)
    parts = geo.w // size
    return pl.BlockSpec((None, size, 3 * geo.w), lambda b, h, n: (h, n % parts, 0))


def local_masked(geo: Geometry, s, n, c, part, seg_q, seg_k):
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


def side_rows(geo: Geometry, gq, gseg_ref, b) -> SideRows:
    present = gq >= 0
    first = jnp.min(jnp.where(present, gq, geo.g))
    u = jnp.where(present, gq - first + 1, 0)
    onehot = (u[:, None] == jnp.arange(geo.u)[None, :]).astype(jnp.bfloat16)
    blocks = first - 1 + jnp.arange(geo.u)
    real = (jnp.arange(geo.u) > 0) & (blocks < geo.g)
    segments = jnp.where(real, gseg_ref[b, jnp.clip(blocks, 0, geo.g - 1)], -1)
    return SideRows(onehot, first, segments)


def side_slab(geo: Geometry, rows: SideRows, j, h, b, gseg_ref, sbias_ref):
    """[U, C] float32: the side bias of each row's global block to side keys chunk j, NEG where
    their segments differ. A query's bias and mask depend on its global block alone (its own
    segment is its block's; a query in none sees no side key), so a block's [W, C] terms are
    onehot @ slab, on the tensor cores (`select_sum`): gathering them per query cost 10
    instructions an element, a third of the side loop's (SASS, sm_90a)."""
    g = j * geo.c + jnp.arange(geo.c)
    blocks = rows.first - 1 + jnp.arange(geo.u)
    index = jnp.clip(g[None, :] - blocks[:, None] - 1 + geo.g, 0, 2 * geo.g - 1)
    same = rows.segments[:, None] == gseg_ref[b, pl.ds(j * geo.c, geo.c)][None, :]
    return jnp.where(same, sbias_ref[h, index], softmax.NEG)


def local_columns(geo: Geometry, c, part):
    """The columns of part `part` of key block c in a [W, 3W] local bias (or its gradient)."""
    return pl.ds(c * geo.w + part * geo.kb, geo.kb)


def local_bias(geo: Geometry, bias_ref, c, part):
    """[W, kb] of the local bias: its columns of part `part` of key block c."""
    return bias_ref[:, local_columns(geo, c, part)]


def side_chunk(geo: Geometry, q, j, b, h, rows: SideRows, side_refs):
    """(biased and masked scores, keys, values) of a query block against side keys chunk j."""
    sk_ref, sv_ref, _, gseg_ref, sbias_ref = side_refs
    keys = pl.ds(j * geo.c, geo.c)
    slab = side_slab(geo, rows, j, h, b, gseg_ref, sbias_ref)
    k = sk_ref[b, keys, h, :]
    s = softmax.select_sum(rows.onehot, slab, into=softmax.dot(q, k, trans_b=True))
    return s, k, sv_ref[b, keys, h, :]


def split_refs(geo: Geometry, inputs, fixed: int):
    """A kernel's input refs as (its own first `fixed`, the side's if any, the dropout's if
    any): side and dropout inputs come last, in that order."""
    drop = inputs[len(inputs) - 3 :] if geo.rate else ()
    return inputs[:fixed], inputs[fixed : len(inputs) - len(drop)], drop


def with_drop(geo: Geometry, specs: list, arrays: list, drop: Drop | None):
    """The dropout's arrays (whole) appended to a kernel's inputs when it drops out."""
    if not geo.rate:
        return specs, arrays
    return specs + [call.whole()] * 3, arrays + list(drop)


def query_ids(geo: Geometry, n, rows: int = 0):
    """Token positions of query block n (`rows`: of part n of rows each)."""
    size, _ = _rows(geo, rows)
    return n * size + jnp.arange(size)


def local_key_ids(geo: Geometry, n, c, part):
    """Token positions of part `part` of key block n - 1 + c (the XLA path's n W + x - W)."""
    return (n - 1 + c) * geo.w + part * geo.kb + jnp.arange(geo.kb)


def side_key_ids(geo: Geometry, j):
    return SIDE_KEYS + j * geo.c + jnp.arange(geo.c)


def local_inputs(geo: Geometry, q, k, v, seg, bias):
    """In-specs and arrays of the local part, for grid (b, h, n) over the parts of query blocks
    (`Geometry.split` a block); looped, the keys' whole arrays (the first of each three read)."""
    qw, per = geo.qw, geo.split
    keys = [tile(geo, s - 1, per=per) for s in range(3)]
    rows = [row(geo, s - 1, per=per) for s in range(3)]
    if geo.looped:
        keys = rows = [call.whole()] * 3
    specs = [tile(geo, rows=qw), *keys, *keys, row(geo, rows=qw), *rows, bias_spec(geo, rows=qw)]
    return specs, [q, k, k, k, v, v, v, seg, seg, seg, seg, bias]


def query_part(geo: Geometry, n):
    """(query block, part of it, token positions) of program n of the forward or dq."""
    return n // geo.split, n % geo.split, query_ids(geo, n, geo.qw)


def local_pass(geo: Geometry, c: int, part: int, half, fn, state):
    """fn(state) for local chunk (c, part), or state where this part of the query block is
    beyond its keys (`Geometry.beyond`)."""
    skip = geo.beyond(c, part)
    if not skip:
        return fn(state)
    skipped = functools.reduce(operator.or_, [half == s for s in skip])
    return jax.lax.cond(skipped, lambda s: s, fn, state)


def local_keys(geo: Geometry, n, b, h, half, refs, q, seg_q, fn, state):
    """fn(state, scores, keys, values, key ids) over each local chunk of query block n (of
    `refs`: the key, value and key segment refs of `local_inputs`, then the bias'), the scores
    biased and masked. Unrolled, each chunk reads its key block's tile and a split program
    skips the chunks beyond it; looped (`Geometry.looped`), one chunk an iteration from the
    whole arrays, none skipped: the unrolled chunks' loads, issued early, held the forward's
    registers at 156 where its side loop needs 122 (ptxas, sm_90a, base TGlobal); looped in 2
    stages, 125: two programs an SM."""
    k_refs, v_refs, sk_refs, bias_ref = refs

    def chunk(state, c, part, load):  # load(refs): the chunk's keys of one of the three
        k = load(k_refs)
        s = softmax.dot(q, k, trans_b=True) + local_bias(geo, bias_ref, c, part)
        s = local_masked(geo, s, n, c, part, seg_q, load(sk_refs))
        return fn(state, s, k, load(v_refs), local_key_ids(geo, n, c, part))

    if not geo.looped:
        for c, part in geo.local_chunks:

            def one(state, c=c, part=part):  # loaded inside: a skipped chunk loads nothing
                keys = pl.ds(part * geo.kb, geo.kb)
                return chunk(state, c, part, lambda refs: refs[c][keys])

            state = local_pass(geo, c, part, half, one, state)
        return state

    def step(i, state):  # lax's div and rem: jnp's floor division does not lower to Triton
        c, part = jax.lax.div(i, geo.parts), jax.lax.rem(i, geo.parts)
        keys = pl.ds(jnp.clip(n - 1 + c, 0, geo.n - 1) * geo.w + part * geo.kb, geo.kb)

        def load(refs):  # from the whole arrays: [B, L, H, K] keys and values, [B, L] segments
            return refs[0][b, keys] if refs is sk_refs else refs[0][b, keys, h]

        return chunk(state, c, part, load)

    return jax.lax.fori_loop(0, 3 * geo.parts, step, state)


def side_inputs(geo: Geometry, side: Side, gq):
    """In-specs and arrays of the side keys, for the grid of `local_inputs`."""
    specs = [call.whole(), call.whole(), row(geo, rows=geo.qw), call.whole(), call.whole()]
    return specs, [side.k_BGHK, side.v_BGHK, gq, side.global_segment_ids, side.bias_HD]
