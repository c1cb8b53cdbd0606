"""Each encoder kernel's operands and outputs by name (arrays, or their block specs: a
`pallas_call`'s in_specs are a pytree matching its operands), in the order of its call; the
local and side parts are `encoder_tiles.Local` and `SideOperands`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from longt5_jax.kernels.dropout import Drop
from longt5_jax.kernels.encoder_tiles import Local, SideOperands


class Forward(NamedTuple):
    """The forward's operands (arrays, or their block specs), in the order of its call."""

    local: Local
    side: SideOperands | None  # None: Local, or no side keys
    drop: Drop | None  # None: no dropout


class Output(NamedTuple):
    o: Any
    lse: Any


class QueryGrad(NamedTuple):
    """dq's operands (arrays, or their block specs), in the order of its call."""

    local: Local
    do: Any
    lse: Any
    delta: Any
    side: SideOperands | None
    drop: Drop | None


class QueryBlock(NamedTuple):
    """What dk and dv read of one of a key block's three query blocks."""

    q: Any
    do: Any
    lse: Any
    delta: Any
    seg: Any


class KeyGrad(NamedTuple):
    """dk's and dv's operands: a part of a key block, and its three query blocks."""

    k: Any
    v: Any
    seg: Any
    bias: Any
    queries: tuple  # of QueryBlock, query blocks m + 1, m, m - 1
    drop: Drop | None


class BiasGrad(NamedTuple):
    """The local bias gradient's operands (whole arrays)."""

    q: Any
    k: Any
    v: Any
    do: Any
    lse: Any
    delta: Any
    seg: Any
    bias: Any
    drop: Drop | None


class SideGrad(NamedTuple):
    """The side keys' gradient's operands (`side_slab` reads `segments` and `bias`)."""

    q: Any
    do: Any
    lse: Any
    delta: Any
    blocks: Any
    k: Any
    v: Any
    segments: Any
    bias: Any
    drop: Drop | None


class KeyGrads(NamedTuple):
    dk: Any
    dv: Any


class SideGrads(NamedTuple):
    dk: Any
    dv: Any
    by_block: Any  # [B, H, N, U, G] the side bias gradient of each block's rows


class RowTerms(NamedTuple):
    """Per query row, what every backward kernel reads: the output's cotangent, the forward's
    log-sum-exp and delta (the row sum of do * o)."""

    do: jax.Array
    lse: jax.Array
    delta: jax.Array


class Saved(NamedTuple):
    """What the backward takes beside the inputs: the forward's output and log-sum-exp, and
    the output's cotangent."""

    o: jax.Array
    lse: jax.Array
    do: jax.Array
