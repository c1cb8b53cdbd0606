"""The online softmax every fused attention kernel runs (FlashAttention's running max, sum and
unnormalised output), its masks' conventions (an invalid key is NEG or -inf) and the float32
arithmetic on tensor cores and the GPU's exp unit it is made of."""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp

from longt5_jax.kernels.backend import plgpu


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
    gradient's loop takes fewer instructions so than with onehot.T @ x (SASS, sm_90a, base
    TGlobal 16k; docs/journal.md, "Fewer instructions, same time")."""
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
    if not TRITON.get():
        return jnp.exp2(x)
    assert plgpu is not None  # TRITON is set only where the backend is (`call.call`)
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
    them; Triton's PTX here did not: SASS, sm_90a; the kernels' times on an H100 stayed as they
    were, as they wait on latency, not on issue). Exact where the two roundings could differ most:
    x = row = NEG (a row that has seen only invalid keys) gives 2^0, as NEG log2 e is a float32
    (NEG is a power of 2); x = -inf gives 0."""
    if not TRITON.get():
        return exp(x - row[:, None])
    assert plgpu is not None  # TRITON is set only where the backend is (`call.call`)
    shift = jnp.broadcast_to((row * -LOG2E)[:, None], x.shape)
    return plgpu.elementwise_inline_asm(
        "{ .reg .f32 t; fma.rn.ftz.f32 t, $1, 0f3FB8AA3B, $2; ex2.approx.ftz.f32 $0, t; }",
        args=[x, shift],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )[0]


# Whether kernel bodies are being traced for Triton (else for the interpreter): `call.call` sets
# it.
TRITON: contextvars.ContextVar = contextvars.ContextVar("triton", default=False)


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
