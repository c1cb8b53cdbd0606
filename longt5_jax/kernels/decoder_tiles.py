"""The static tiles of one call of the decoder's fused attention (`decoder`), their block specs
over [B, T, H, K] arrays and each kernel's operands by name. Letter key as `decoder`."""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from longt5_jax.kernels import launch, placement
from longt5_jax.kernels.dropout import Drop

T = TypeVar("T")  # what a record holds: arrays, or their logical axes


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Static shapes of one call."""

    batch: int
    heads: int
    head_dim: int
    tq: int  # query tile Q
    tk: int  # key tile C
    t: int  # queries, padded to whole tiles
    s: int  # keys, padded to whole tiles
    mask_rows: int  # T, or 1 for a mask shared by every query
    bias: bool
    rate: float = 0.0  # attention dropout (the kernels then take `dropout.Drop`'s arrays last)
    parts: int = 1  # programs a query tile's keys are split among (`split`)

    def flops(self, matmuls: int) -> int:
        return 2 * matmuls * self.batch * self.heads * self.t * self.s * self.head_dim

    def split(self, name: str) -> Tiles:
        """This call for kernel `name`, each query tile's keys split into parts of whole key
        tiles as its launch settings say (`launch.split_of`), a program each. Why: at 512
        targets the forward and dq run B x H x 8 programs (192 at base 16k) where an H100's 132
        SMs hold 2-4 each (0.4-0.7 waves, `bench sass`), each looping over every key tile (256
        over 16k encoder tokens). The parts' outputs are combined outside (`combine`, a sum
        for dq), from [P, ...] float32 arrays: more bytes, so off until a GPU times it. Only
        where the keys outnumber the queries (cross-attention over a longer input): those
        bytes grow with the queries, the work a program saves with the keys, and a
        self-attention's grid grows with its keys (`bench roofline`: half the split's bytes)."""
        parts = launch.split_of(name)
        split = self.s > self.t and (self.s // self.tk) % parts == 0
        return dataclasses.replace(self, parts=parts if split else 1)

    def key_tiles(self, part) -> tuple[Any, Any]:
        """The first and the end key tile of `part` (a program id)."""
        per = self.s // self.tk // self.parts
        return part * per, (part + 1) * per

    def program(self, p) -> tuple:
        """(query tile, part) of the forward's and dq's program id p."""
        return p // self.parts, p % self.parts


def query_tile(tl: Tiles) -> pl.BlockSpec:
    return pl.BlockSpec(
        (None, tl.tq, None, tl.head_dim), lambda b, h, p: (b, tl.program(p)[0], h, 0)
    )


def out_tile(tl: Tiles) -> pl.BlockSpec:
    """Where a program of the forward or dq writes its [Q, K] tile: in the output, or, split,
    in its part of the [P, B, T, H, K] float32 parts (`_out`)."""
    if tl.parts == 1:
        return query_tile(tl)
    return pl.BlockSpec(
        (None, None, tl.tq, None, tl.head_dim),
        lambda b, h, p: (tl.program(p)[1], b, tl.program(p)[0], h, 0),
    )


def out_type(tl: Tiles, shape, dtype, like) -> jax.ShapeDtypeStruct:
    """An output of the forward or dq: `shape` in `dtype`, or, split, [P, *shape] float32."""
    if tl.parts == 1:
        return placement.out(shape, dtype, like)
    return placement.out((tl.parts, *shape), jnp.float32, like)


def combine(o_PBTHK, lse_PBHT, dtype):
    """The parts' outputs as one row's: each part's (normalised) output weighted by its share
    of the row's sum of exponentials, exp(lse_part - lse); rows no part saw output 0, lse 0."""
    m = jnp.max(lse_PBHT, axis=0)
    seen = m > -jnp.inf
    m = jnp.where(seen, m, 0.0)
    weights = jnp.exp(lse_PBHT - m)
    total = jnp.where(seen, weights.sum(0), 1.0)
    o = jnp.einsum("pbht,pbthk->bthk", weights / total, o_PBTHK)
    return o.astype(dtype), jnp.where(seen, m + jnp.log(total), 0.0)


def key_tile(tl: Tiles) -> pl.BlockSpec:
    return pl.BlockSpec((None, tl.tk, None, tl.head_dim), lambda b, h, j: (b, j, h, 0))


def stat(tl: Tiles) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, tl.tq), lambda b, h, p: (b, h, tl.program(p)[0]))


def out_stat(tl: Tiles) -> pl.BlockSpec:
    if tl.parts == 1:
        return stat(tl)
    return pl.BlockSpec(
        (None, None, None, tl.tq), lambda b, h, p: (tl.program(p)[1], b, h, tl.program(p)[0])
    )


class Inputs(NamedTuple, Generic[T]):
    """The attention's inputs, padded to whole tiles (or their logical axes)."""

    q: T
    k: T
    v: T
    mask: T | None  # None as a gradient: the mask has none
    bias: T


class Residuals(NamedTuple, Generic[T]):
    """What the backward takes beside the inputs (or their logical axes)."""

    o: T
    lse: T
    do: T


class Forward(NamedTuple):
    """The forward's operands (arrays, or their block specs), in the order of its call."""

    q: Any
    k: Any
    v: Any
    mask: Any
    bias: Any
    drop: Drop | None  # None without dropout


class QueryGrad(NamedTuple):
    """dq's and the bias gradient's operands."""

    q: Any
    do: Any
    lse: Any
    delta: Any
    k: Any
    v: Any
    mask: Any
    bias: Any
    drop: Drop | None


class KeyGrad(NamedTuple):
    """dk's and dv's operands."""

    k: Any
    v: Any
    q: Any
    do: Any
    lse: Any
    delta: Any
    mask: Any
    bias: Any
    drop: Drop | None


class Output(NamedTuple):
    o: Any
    lse: Any


class KeyGrads(NamedTuple):
    dk: Any
    dv: Any
