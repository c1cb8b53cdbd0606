"""Building blocks of the fused encoder attention kernels (`long_attention_kernel`): the
static geometry of a call, block specs over [B, L, H, K] arrays, and the masked online-softmax
math shared by the forward and backward kernels. Letter key as `long_attention`."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from longt5_jax.model.layers import SIDE_KEYS, dropout_scale


class Side(NamedTuple):
    """TGlobal's side keys and what masks and biases them."""

    k_BGHK: jax.Array
    v_BGHK: jax.Array
    bias_HD: jax.Array  # [H, 2G] float32 side bias by distance g - block_id + G - 1
    block_ids: jax.Array  # [B, L] int32, the global block of each token (-1: none)
    global_segment_ids: jax.Array  # [B, G] int32


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static shapes of one call."""

    batch: int
    heads: int
    head_dim: int
    w: int  # block length W
    n: int  # blocks N
    g: int  # side keys G (0: Local, or inputs shorter than a global block)
    c: int  # side keys per chunk
    u: int  # one-hot rows for the side bias gradient
    kb: int  # keys per chunk of a local key block (W / kb chunks a block)
    rate: float = 0.0  # attention dropout (0: none; else the kernels take `Drop`'s arrays last)

    @property
    def parts(self) -> int:
        """Parts of kb keys a local key block is taken in."""
        return self.w // self.kb

    @property
    def local_chunks(self) -> list[tuple[int, int]]:
        """(key block c of 0-2, part of it) of a query block's local keys, kb at a time."""
        return [(c, part) for c in range(3) for part in range(self.parts)]

    @property
    def gp(self) -> int:
        return -(-self.g // self.c) * self.c if self.g else 0

    def flops(self, local_matmuls: int, side_matmuls: int) -> int:
        """Tensor-core FLOPs of a kernel doing these [W, K] x [K, keys] matmuls per query block."""
        per_block = (
            2 * self.w * self.head_dim * (3 * self.w * local_matmuls + self.gp * side_matmuls)
        )
        return self.batch * self.heads * self.n * per_block


def out(shape, dtype, like: jax.Array | None = None) -> jax.ShapeDtypeStruct:
    """A kernel output's type; inside a shard_map (the pipeline's stages) it varies over the
    manual axes the inputs vary over, which a custom call cannot infer."""
    if like is None or _MANUAL is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(
        shape, dtype, **{_MANUAL: getattr(jax.typeof(like), _AVAL[_MANUAL])}
    )


# Named `manual_axis_type` (aval field `mat`) in jax 0.10, `vma` (`vma`) elsewhere.
_AVAL = {"manual_axis_type": "mat", "vma": "vma"}
_MANUAL = next(
    (k for k in _AVAL if k in inspect.signature(jax.ShapeDtypeStruct.__init__).parameters), None
)


def pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def geometry(q_BLHK: jax.Array, w: int, g: int, global_block: int, rate: float = 0.0) -> Geometry:
    b, length, h, k = q_BLHK.shape
    c = min(64, max(16, pow2(g))) if g else 16
    # The global blocks a window of W tokens meets: each has >= global_block tokens, so at most
    # ceil((W - 1) / global_block) + 1 of them, plus row 0 for tokens in none.
    u = max(16, pow2(2 + -(-(w - 1) // global_block)))
    # A local key block is taken half at a time where a half is a whole tile (16 keys or more):
    # the score tiles are [W, W / 2] as the side keys' are [W, C], which halves what each thread
    # holds (at W = 128 with [W, W] tiles every kernel used all 255 registers and spilled;
    # ptxas, sm_90a).
    kb = w // 2 if w % 2 == 0 and w >= 32 else w
    return Geometry(b, h, k, w, -(-length // w), g, c, u, kb, rate)


def call(kernel, name: str, flops: int, grid, in_specs, out_specs, out_shape):
    """The kernel as Triton on a GPU and interpreted elsewhere (tests on CPU): both are traced,
    and lowering keeps the one for the platform compiled for (a deviceless GPU compile on a
    CPU host gets Triton)."""

    def build(interpret: bool, wide: bool):
        kernel_call = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(**_launch_of(name, wide)),
            name=f"{name}.flops_{flops}",
        )

        def traced(*arrays):  # the kernel's body is traced here, for Triton or the interpreter
            token = _TRITON.set(not interpret)
            try:
                return kernel_call(*arrays)
            finally:
                _TRITON.reset(token)

        return traced

    def run(*arrays):
        wide = jnp.dtype(arrays[0].dtype).itemsize >= 4
        return jax.lax.platform_dependent(
            *arrays, cpu=build(True, wide), default=build(False, wide)
        )

    return run


# Triton's warps and software-pipelining stages by kernel name (fnmatch patterns, first match
# wins), as measured on an H100 (`bench kernels --launch`, docs/benchmarks.md): the encoder's
# programs hold [128, 128] float32 score tiles, which 4 warps cannot keep in registers, and
# three stages hide the loads of the next key block (the layer's forward and backward 12.5 ->
# 10.1 ms at base 16k); the decoder's 64 x 64 tiles ran fastest as they were (1.46 ms against
# 1.81 with 8:3).
LAUNCH: tuple[tuple[str, int, int], ...] = (("encoder_*", 8, 3), ("*_fwd", 4, 2), ("*", 8, 2))
_LAUNCH: contextvars.ContextVar = contextvars.ContextVar("kernel_launch", default=LAUNCH)


@contextlib.contextmanager
def launch(settings: tuple[tuple[str, int, int], ...]):
    """Kernels traced inside this launch with `settings` ((pattern, warps, stages), first match
    wins; names no pattern matches keep `LAUNCH`'s): how `bench kernels` tries others."""
    token = _LAUNCH.set(tuple(settings) + LAUNCH)
    try:
        yield
    finally:
        _LAUNCH.reset(token)


def _launch_of(name: str, wide: bool = False) -> dict:
    """Triton's launch settings of kernel `name`; `wide`: its tiles are float32, which take
    twice the shared memory per stage (at 3 stages the side gradient's kernel asked 264 KiB,
    where an H100 has 227), so at most 2 stages."""
    warps, stages = next((w, s) for p, w, s in _LAUNCH.get() if fnmatch.fnmatchcase(name, p))
    return {"num_warps": warps, "num_stages": min(stages, 2) if wide else stages}


# -- block specs ------------------------------------------------------------------------------


def tile(geo: Geometry, shift: int = 0, order=(0, 1, 2), per: int = 1) -> pl.BlockSpec:
    """[W, K] of a [B, L, H, K] array at block n + shift (clamped), for grid axes (b, h, n)
    (n // per where the grid has `per` programs a block)."""
    last = geo.n - 1

    def index(*ids):
        b, h, n = (ids[i] for i in order)
        return b, jnp.clip(n // per + shift, 0, last), h, 0

    return pl.BlockSpec((None, geo.w, None, geo.head_dim), index)


def row(geo: Geometry, shift: int = 0, order=(0, 1, 2), per: int = 1) -> pl.BlockSpec:
    """[W] of a [B, L] array at block n + shift (clamped; n // per as `tile`)."""
    last = geo.n - 1

    def index(*ids):
        b, _, n = (ids[i] for i in order)
        return b, jnp.clip(n // per + shift, 0, last)

    return pl.BlockSpec((None, geo.w), index)


def stat(geo: Geometry, shift: int = 0, per: int = 1) -> pl.BlockSpec:
    """[W] of a [B, H, L] float32 statistic at block n + shift (clamped; n // per as `tile`)."""
    last = geo.n - 1
    return pl.BlockSpec(
        (None, None, geo.w), lambda b, h, n: (b, h, jnp.clip(n // per + shift, 0, last))
    )


def key_part(geo: Geometry, rows: bool = False) -> pl.BlockSpec:
    """[kb, K] of a [B, L, H, K] array (or [kb] of a [B, L] one with `rows`): part n of the
    keys, for grid axes (b, h, n) over the parts."""
    if rows:
        return pl.BlockSpec((None, geo.kb), lambda b, h, n: (b, n))
    return pl.BlockSpec((None, geo.kb, None, geo.head_dim), lambda b, h, n: (b, n, h, 0))


def whole() -> pl.BlockSpec:
    """The whole array, indexed in the kernel."""
    return pl.BlockSpec()


def bias_spec(geo: Geometry) -> pl.BlockSpec:
    return pl.BlockSpec((None, geo.w, 3 * geo.w), lambda b, h, n: (h, 0, 0))


# -- shared math --------------------------------------------------------------------------------


def dot(a, b, trans_b=False):
    """a @ b (or a @ b.T) with float32 accumulation."""
    return jnp.dot(a, b.T if trans_b else b, preferred_element_type=jnp.float32)


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

    u: jax.Array  # [W] int32, each query's row
    onehot: jax.Array  # [W, U] bfloat16
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
    return SideRows(u, onehot, first, segments)


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
    return jnp.where(same, sbias_ref[h, index], NEG)


def local_columns(geo: Geometry, c, part):
    """The columns of part `part` of key block c in a [W, 3W] local bias (or its gradient)."""
    return pl.ds(c * geo.w + part * geo.kb, geo.kb)


def local_bias(geo: Geometry, bias_ref, c, part):
    """[W, kb] of the local bias: its columns of part `part` of key block c."""
    return bias_ref[:, local_columns(geo, c, part)]


def local_chunk(geo: Geometry, q, n, c, part, seg_q, k_ref, v_ref, sk_ref, bias_ref):
    """(biased and masked scores, keys, values) of query block n against part `part` of its key
    block n - 1 + c."""
    keys = pl.ds(part * geo.kb, geo.kb)
    k = k_ref[keys, :]
    s = dot(q, k, trans_b=True) + local_bias(geo, bias_ref, c, part)
    return local_masked(geo, s, n, c, part, seg_q, sk_ref[keys]), k, v_ref[keys, :]


def side_chunk(geo: Geometry, q, j, b, h, rows: SideRows, side_refs):
    """(biased and masked scores, keys, values) of a query block against side keys chunk j."""
    sk_ref, sv_ref, _, gseg_ref, sbias_ref = side_refs
    keys = pl.ds(j * geo.c, geo.c)
    slab = side_slab(geo, rows, j, h, b, gseg_ref, sbias_ref)
    k = sk_ref[b, keys, h, :]
    s = select_sum(rows.onehot, slab, into=dot(q, k, trans_b=True))
    return s, k, sv_ref[b, keys, h, :]


def select_sum(onehot, x, into=None):
    """onehot @ x (plus `into`) for a 0/1 bfloat16 `onehot` and float32 `x`, to float32
    accuracy on the tensor cores: x split into three bfloat16 terms (8 bits of mantissa each,
    24 together), each product exact, summed in float32; each product accumulates into the
    last (Triton chains them as one accumulator). An IEEE float32 matmul would run on the CUDA
    cores' FMAs: in the side gradient's kernel that took more instructions than all its other
    matmuls."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    total = dot(onehot, hi) if into is None else into + dot(onehot, hi)
    return total + dot(onehot, mid) + dot(onehot, lo)


# An invalid key's additive score: exact in bfloat16 (so `select_sum` carries it exactly), and
# any score plus NEG rounds to NEG itself (|score| < 2^76), so beside a valid key its
# probability is exactly 0. A row's running max stays at NEG (or -inf) only while it has seen
# no valid key: `seen`.
NEG = -(2.0**100)


def seen(m):
    """Rows whose running max `m` is a valid key's score."""
    return m > NEG / 2


def exp(x):
    """e^x as 2^(x log2 e), float32. On a GPU one MUFU.EX2 an element (PTX ex2.approx.ftz, 2
    ulp; results below 2^-126 flush to 0), where `jnp.exp` lowers to libdevice's expf, 8
    instructions an element, and `jnp.exp2` to 4 (both with their own range handling; SASS,
    sm_90a): in the encoder's inner loops the exponentials were a third of all instructions."""
    x = x * LOG2E
    if not _TRITON.get():
        return jnp.exp2(x)
    return plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;",
        args=[x],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )[0]


LOG2E = 1.4426950408889634
# Whether kernel bodies are being traced for Triton (else for the interpreter): `call` sets it.
_TRITON: contextvars.ContextVar = contextvars.ContextVar("triton", default=False)


def probs(s, valid, lse):
    """Probabilities from the saved log-sum-exp; `valid` None where invalid keys are NEG."""
    return exp((s if valid is None else jnp.where(valid, s, -jnp.inf)) - lse[:, None])


def online(state, s, valid, v, scale=None):
    """One chunk of keys into the running (max, sum, unnormalised output); `scale` is the
    dropout's (the sum is of the probabilities before it, as the XLA path's); `valid` None
    where invalid keys are NEG already."""
    m, l, acc = state
    if valid is not None:
        s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = exp(m - m_safe)
    p = exp(s - m_safe[:, None])  # 0 where s is -inf
    kept = p if scale is None else p * scale
    acc = acc * alpha[:, None] + dot(kept.astype(v.dtype), v)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc


class Drop(NamedTuple):
    """Attention dropout's inputs to a kernel (`layers.attention_keep`)."""

    seed: jax.Array  # [1] int32, the layer's
    rows: jax.Array  # [B] int32, global row ids
    heads: jax.Array  # [H] int32, global head ids (a device holds some heads)

    @classmethod
    def of(cls, seed: jax.Array, rows: jax.Array, heads: int) -> Drop:
        """A layer's int32 seed, the rows' global ids and the call's `heads` (all global)."""
        seed = jnp.reshape(seed, (1,)).astype(jnp.int32)
        return cls(seed, rows.astype(jnp.int32), jnp.arange(heads, dtype=jnp.int32))


DROP_AXES = [(None,), ("batch",), ("heads",)]


def pad(x: jax.Array, sizes: dict[int, int], value=0) -> jax.Array:
    """x zero- (or `value`-) padded at the end of each axis in `sizes` to that size."""
    widths = [(0, sizes.get(axis, n) - n) for axis, n in enumerate(x.shape)]
    return jnp.pad(x, widths, constant_values=value) if any(w for _, w in widths) else x


def drop_scale(rate: float, drop_refs, b, h, query_ids, key_ids):
    """[Q, C] dropout scale of queries x keys of row b, head h, or None without dropout."""
    if not rate:
        return None
    seed_ref, rows_ref, heads_ref = drop_refs
    row, head = rows_ref[b], heads_ref[h]
    return dropout_scale(seed_ref[0], row, head, query_ids[:, None], key_ids[None, :], rate)


def split_refs(geo: Geometry, inputs, fixed: int):
    """A kernel's input refs as (its own first `fixed`, the side's if any, the dropout's if
    any): side and dropout inputs come last, in that order."""
    drop = inputs[len(inputs) - 3 :] if geo.rate else ()
    return inputs[:fixed], inputs[fixed : len(inputs) - len(drop)], drop


def with_drop(geo: Geometry, specs: list, arrays: list, drop: Drop | None):
    """The dropout's arrays (whole) appended to a kernel's inputs when it drops out."""
    if not geo.rate:
        return specs, arrays
    return specs + [whole()] * 3, arrays + list(drop)


def query_ids(geo: Geometry, n):
    return n * geo.w + jnp.arange(geo.w)


def local_key_ids(geo: Geometry, n, c, part):
    """Token positions of part `part` of key block n - 1 + c (the XLA path's n W + x - W)."""
    return (n - 1 + c) * geo.w + part * geo.kb + jnp.arange(geo.kb)


def side_key_ids(geo: Geometry, j):
    return SIDE_KEYS + j * geo.c + jnp.arange(geo.c)


def dropped_grad(p, dp, delta, scale):
    """dS of dropped-out attention: p * (scale * dP - delta)."""
    return p * ((dp if scale is None else dp * scale) - delta[:, None])


def local_inputs(geo: Geometry, q, k, v, seg, bias):
    """In-specs and arrays of the local part, for grid (b, h, n) over query blocks."""
    specs = [tile(geo)] + [tile(geo, s - 1) for s in range(3)] * 2
    specs += [row(geo)] + [row(geo, s - 1) for s in range(3)] + [bias_spec(geo)]
    return specs, [q, k, k, k, v, v, v, seg, seg, seg, seg, bias]


def side_inputs(geo: Geometry, side: Side, gq):
    specs = [whole(), whole(), row(geo), whole(), whole()]
    return specs, [side.k_BGHK, side.v_BGHK, gq, side.global_segment_ids, side.bias_HD]


# -- placement ----------------------------------------------------------------------------------

# [B, L, H, K] arrays: rows and heads are what a kernel call may be split along.
ROWS = ("batch", None, "heads", None)
# How a kernel call is placed on devices. A custom call cannot be split by the compiler (GSPMD
# would gather every operand to every device), so the parallel layer installs a placement that
# runs the kernels on each device's own rows and heads (`parallel.sharding.kernel_placement`,
# entered with the activation rules); by default the call is made as is (one device).
_PLACEMENT: contextvars.ContextVar = contextvars.ContextVar("kernel_placement", default=None)


@contextlib.contextmanager
def placement(place):
    """Place kernel calls with place(fn, arrays, logical axes of each, logical axes of the
    output) while tracing inside this."""
    token = _PLACEMENT.set(place)
    try:
        yield
    finally:
        _PLACEMENT.reset(token)


def on_own_rows_and_heads(fn, arrays: list, axes: list, out_axes) -> jax.Array:
    """fn(*arrays), placed by the placement in force; `axes` names each array's logical axes
    (arrays[0] is [B, L, H, K])."""
    place = _PLACEMENT.get()
    return fn(*arrays) if place is None else place(fn, arrays, axes, out_axes)
