"""What every fused attention kernel shares (the encoder's, `long_attention_kernel`, and the
decoder's, `attention_kernel`): the call (Triton on a GPU, interpreted elsewhere) and its launch
settings, the online softmax and its masks' conventions, attention dropout's inputs, and how a
call is placed on devices."""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import inspect
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from longt5_jax.model.layers import dropout_scale


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


# Triton, which the kernels are written for, compiles for CUDA GPUs of compute capability 8.0
# (Ampere) and newer: a V100 (7.0) runs XLA's attention.
KERNELS_SINCE = 8


# float32 kernels only from 9.0 (Hopper) on. For 8.x, ptxas (CUDA 12.9 and 13.5, -O3) gives
# the backward kernels of every family 32 registers and spills the rest: base TGlobal's dq
# moves 9.5 KB of local memory a thread for each chunk of side keys, its side gradient 24 KB a
# query block, where bfloat16's and an H100's float32 loops keep theirs in registers (`bench
# sass`'s local column, docs/benchmarks.md).
WIDE_SINCE = 9


def _major(compute_capability: str) -> int:
    """The major version of a CUDA compute capability ("9.0"), 0 for "" (a CPU, or a GPU that
    is not CUDA's)."""
    m = re.fullmatch(r"(\d+)\.\d+", compute_capability)
    return int(m.group(1)) if m else 0


def runs_on(compute_capability: str) -> bool:
    """Whether the kernels compile for a GPU of this CUDA compute capability."""
    return _major(compute_capability) >= KERNELS_SINCE


def suits(compute_capability: str, dtype) -> bool:
    """Whether `attention_kernel="auto"` takes the kernels for activations of `dtype` on a GPU
    of this compute capability: where they compile, float32 ones from `WIDE_SINCE` on."""
    wide = jnp.dtype(dtype).itemsize >= 4
    return _major(compute_capability) >= (WIDE_SINCE if wide else KERNELS_SINCE)


def resolve(config, compute_capability: str):
    """`config` with `attention_kernel="auto"` made concrete for a GPU of this compute
    capability ("" for none): the kernels where they `suits` its dtype."""
    return config.resolved(suits(compute_capability, config.dtype))


def fused(config) -> bool:
    """Whether attention runs the kernels: `attention_kernel="auto"` that nothing made concrete
    for the devices compiled for (the train step and the generator do, for their mesh) is
    made so for the default device."""
    found = str(getattr(jax.devices()[0], "compute_capability", ""))
    return resolve(config, found).attention_kernel == "pallas"


def pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def call(kernel, name: str, flops: int, grid, in_specs, out_specs, out_shape):
    """The kernel as Triton on a GPU and interpreted elsewhere (tests on CPU): both are traced,
    and lowering keeps the one for the platform compiled for (a deviceless GPU compile on a
    CPU host gets Triton)."""
    if name not in KERNELS:  # a launch pattern could not know it
        raise ValueError(f"kernel {name!r} is not one of kernel_base.KERNELS")

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
            with _bound(_TRITON, not interpret):
                return kernel_call(*arrays)

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
# 1.81 with 8:3). An optional fourth number splits the work of a program of the forward and dq
# into that many (1 if not given): the encoder's query blocks (`long_attention_tiles.Geometry.
# splits`, in two), the decoder's cross-attention keys (`attention_kernel.Tiles.split`). The
# encoder's query blocks in two programs of 4 warps: three of Local's fit an SM where one of 8
# did (registers), and its forward and dq ran 0.134 -> 0.096 and 0.142 -> 0.095 ms (xl Local
# 4k, the layer 1.95 -> 1.78 ms); TGlobal's fit two, the same 8 warps, and ran 1.178 -> 1.257
# and 1.176 -> 1.279 ms (base 16k). The decoder's dkv in 4 warps, one warpgroup issuing each 64 x
# 64 product where 8 warps split it in two: on an H200 0.256-0.262 -> 0.116 ms (base decoder 4k
# x 2, self- and cross-attention; the layer's kernels 0.893 -> 0.753 ms), the same bytes. An
# optional fifth number caps an encoder kernel's keys a tile and loops the forward's and dq's
# local keys (`Geometry.splits`): in 2 stages TGlobal's forward (64 keys), dq, dkv and local
# bias gradient (32) fit two programs of 8 warps an SM where one did (ptxas); not yet timed.
LAUNCH: tuple[tuple, ...] = (
    ("encoder_local_attention_fwd", 4, 3, 2),
    ("encoder_local_attention_dq", 4, 3, 2),
    ("encoder_*", 8, 3),
    ("*_fwd", 4, 2),
    ("decoder_attention_dkv", 4, 2),
    ("*", 8, 2),
)


# Every kernel's name (`call` refuses others): what the launch patterns match, so that `bench
# kernels` can tell which kernels a setting sets. TGlobal's and Local's encoder families
# (`long_attention_tiles.Geometry.kernel`; only TGlobal has side keys) and the decoder's.
KERNELS: tuple[str, ...] = (
    *(f"encoder_attention_{part}" for part in ("fwd", "dq", "dkv", "dside", "dbias")),
    *(f"encoder_local_attention_{part}" for part in ("fwd", "dq", "dkv", "dbias")),
    *(f"decoder_attention_{part}" for part in ("fwd", "dq", "dkv", "dbias")),
)

_LAUNCH: contextvars.ContextVar = contextvars.ContextVar("kernel_launch", default=LAUNCH)


def launch(settings: tuple[tuple, ...]):
    """Kernels traced inside this launch with `settings` ((pattern, warps, stages[, split[,
    keys]]), first match wins; names no pattern matches keep `LAUNCH`'s): how `bench kernels`
    tries others."""
    return _bound(_LAUNCH, tuple(settings) + LAUNCH)


@contextlib.contextmanager
def _bound(var: contextvars.ContextVar, value):
    """`var` set to `value` inside this."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def _launch_of(name: str, wide: bool = False) -> dict:
    """Triton's launch settings of kernel `name`; `wide`: its tiles are float32, which take
    twice the shared memory per stage (at 3 stages the side gradient's kernel asked 264 KiB,
    where an H100 has 227), so at most 2 stages."""
    warps, stages = _setting(name)[1:3]
    return {"num_warps": warps, "num_stages": min(stages, 2) if wide else stages}


def kernels_set_by(settings: tuple[tuple, ...]) -> set[str]:
    """The kernels of `KERNELS` that launch `settings` set (a pattern of theirs matches)."""
    return {k for k in KERNELS if any(fnmatch.fnmatchcase(k, s[0]) for s in settings)}


def split_of(name: str) -> int:
    """Into how many programs kernel `name` splits a program's work (its launch setting's
    fourth number; 1 if none)."""
    setting = _setting(name)
    return setting[3] if len(setting) > 3 else 1


def keys_of(name: str) -> int:
    """At most how many keys encoder kernel `name` takes a tile (its launch setting's fifth
    number; 0 if none: the geometry's own, `long_attention_tiles.Geometry.splits`)."""
    setting = _setting(name)
    return setting[4] if len(setting) > 4 else 0


def _setting(name: str) -> tuple:
    return next(s for s in _LAUNCH.get() if fnmatch.fnmatchcase(name, s[0]))


# What a kernel's backward reads from its forward beside its inputs: the output and the
# log-sum-exp, named for the remat policies that keep them ("save_attention", "save_dots").
# Recomputed, they cost a forward kernel again (on an H100 at base 16k, 12 x 1.2 ms of a 178
# ms step); kept, a [B, L, H, K] bfloat16 and a [B, H, L] float32 array a layer.
SAVED = "attention_kernel_outputs"


def saveable(o, lse):
    return checkpoint_name(o, SAVED), checkpoint_name(lse, SAVED)


def whole() -> pl.BlockSpec:
    """The whole array, indexed in the kernel."""
    return pl.BlockSpec()


def dot(a, b, trans_b=False):
    """a @ b (or a @ b.T) with float32 accumulation."""
    return jnp.dot(a, b.T if trans_b else b, preferred_element_type=jnp.float32)


def _terms(x):
    """Float32 x as three bfloat16 terms of 8 mantissa bits each, hi + mid + lo == x."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    return hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)


def select_sum(onehot, x, into=None):
    """onehot @ x (plus `into`) for a 0/1 bfloat16 `onehot` and float32 `x`, to float32
    accuracy on the tensor cores: each term of x times the one-hot is exact, and the three are
    summed in float32 (Triton chains them into one accumulator in the forward's side chunk; in
    the side gradient's kernel it adds them, 3 FADDs an element). An IEEE float32 matmul would
    run on the CUDA cores' FMAs: in the side gradient's kernel that took more instructions than
    all its other matmuls."""
    hi, mid, lo = _terms(x)
    total = dot(onehot, hi) if into is None else into + dot(onehot, hi)
    return total + dot(onehot, mid) + dot(onehot, lo)


def select_sum_t(x, onehot):
    """x.T @ onehot, float32-exact as `select_sum`: a [W, C] tile's rows summed by the one-hot's
    [W, U] columns with C, not U << 64, as the matmul's rows (a warpgroup's 64). The side
    gradient's loop took 1,244 instructions a query block with onehot.T @ x, 1,056 so (SASS,
    sm_90a, base TGlobal 16k; with `exp_minus` 1,026, and 1.73 -> 1.66 ms a layer on an H100)."""
    hi, mid, lo = _terms(x)
    return dot(hi.T, onehot) + dot(mid.T, onehot) + dot(lo.T, onehot)


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


def exp_minus(x, row):
    """e^(x - row[:, None]) as 2^(x log2 e - row log2 e): on a GPU one FFMA and one MUFU.EX2 an
    element, where the difference and then its scaling were an FADD and an FMUL (nvcc contracts
    them; Triton's PTX here did not: SASS, sm_90a; the kernels' times on an H100 stayed within
    1%, as they wait on latency, not on issue). Exact where the two roundings could differ most:
    x = row = NEG (a row that has seen only invalid keys) gives 2^0, as NEG log2 e is a float32
    (NEG is a power of 2); x = -inf gives 0."""
    if not _TRITON.get():
        return exp(x - row[:, None])
    shift = jnp.broadcast_to((row * -LOG2E)[:, None], x.shape)
    return plgpu.elementwise_inline_asm(
        "{ .reg .f32 t; fma.rn.ftz.f32 t, $1, 0f3FB8AA3B, $2; ex2.approx.ftz.f32 $0, t; }",
        args=[x, shift],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )[0]


# Whether kernel bodies are being traced for Triton (else for the interpreter): `call` sets it.
_TRITON: contextvars.ContextVar = contextvars.ContextVar("triton", default=False)


def _masked(s, valid):
    """s, -inf where not `valid` (None: invalid keys are NEG already)."""
    return s if valid is None else jnp.where(valid, s, -jnp.inf)


def probs(s, valid, lse):
    """Probabilities from the saved log-sum-exp."""
    return exp_minus(_masked(s, valid), lse)


def online(state, s, valid, v, scale=None):
    """One chunk of keys into the running (max, sum, unnormalised output); `scale` is the
    dropout's (the sum is of the probabilities before it, as the XLA path's); `valid` None
    where invalid keys are NEG already."""
    m, l, acc = state
    s = _masked(s, valid)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = exp(m - m_safe)
    p = exp_minus(s, m_safe)  # 0 where s is -inf
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


def dropped_grad(p, dp, delta, scale):
    """dS of dropped-out attention: p * (scale * dP - delta)."""
    return p * ((dp if scale is None else dp * scale) - delta[:, None])


# [B, L, H, K] arrays: rows and heads are what a kernel call may be split along.
ROWS = ("batch", None, "heads", None)


# How a kernel call is placed on devices. A custom call cannot be split by the compiler (GSPMD
# would gather every operand to every device), so the parallel layer installs a placement that
# runs the kernels on each device's own rows and heads (`parallel.sharding.kernel_placement`,
# entered with the activation rules); by default the call is made as is (one device).
_PLACEMENT: contextvars.ContextVar = contextvars.ContextVar("kernel_placement", default=None)


def placement(place):
    """Place kernel calls with place(fn, arrays, logical axes of each, logical axes of the
    output) while tracing inside this."""
    return _bound(_PLACEMENT, place)


def on_own_rows_and_heads(fn, arrays: list, axes: list, out_axes) -> jax.Array:
    """fn(*arrays), placed by the placement in force; `axes` names each array's logical axes
    (arrays[0] is [B, L, H, K])."""
    place = _PLACEMENT.get()
    return fn(*arrays) if place is None else place(fn, arrays, axes, out_axes)
