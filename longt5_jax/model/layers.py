"""T5.1.1 building blocks: RMS layer norm, bias-free projections, gated-GELU MLP, embedding.

Parameters are float32 and carry logical axis names; computation runs in `config.compute_dtype`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple, cast, overload

import flax.linen as nn
import jax
import jax.numpy as jnp

from longt5_jax.model.config import LongT5Config

Initializer = jax.nn.initializers.Initializer


def normal(stddev: float) -> Initializer:
    return jax.nn.initializers.normal(stddev)


def truncated_normal_fan_in() -> Initializer:
    """T5X's init for 2-D MLP and logits kernels: truncated normal, variance 1 / fan_in."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def uniform_fan_avg() -> Initializer:
    return jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform")


def clamp_float16(x: jax.Array) -> jax.Array:
    """The residual stream clipped into float16's range, less a margin (transformers' T5 does
    the same): T5's feed-forward output can outgrow float16's 65504, and one inf there would make
    every later layer NaN. Other dtypes pass through untouched."""
    return _clamp(x) if x.dtype == jnp.float16 else x


@jax.custom_jvp
def _clamp(x: jax.Array) -> jax.Array:
    limit = float(jnp.finfo(jnp.float16).max) - 1000.0
    return jnp.clip(x, -limit, limit)


# The gradient passes straight through: clip's own would need the forward value in the backward
# pass, which under remat recomputes the feed-forward output and its tensor all-reduce.
_clamp.defjvp(lambda primals, tangents: (_clamp(*primals), tangents[0]))


def logical_param(
    module: nn.Module,
    name: str,
    init: Initializer,
    axes: tuple[str, ...],
    shape: tuple[int, ...],
) -> jax.Array:
    """A float32 parameter of `module` whose axes carry logical names."""
    boxed = module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)
    # `param` unboxes the LogicallyPartitioned its initialiser returns, but flax types the
    # result as the initialiser's return type.
    return cast(jax.Array, boxed)


class RMSNorm(nn.Module):
    """T5 layer norm: x * rsqrt(mean(x^2) + eps) * scale; no centring, no bias; stats in float32."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = logical_param(self, "scale", nn.initializers.ones, ("embed",), (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * scale.astype(self.dtype)


class Rows(NamedTuple):
    """What a dropout mask is drawn from besides the step's key: the global index of each row of
    the batch ([B]) and the layer."""

    ids: jax.Array
    layer: jax.Array | int = 0


class Dropout(nn.Module):
    """Dropout whose mask for a row comes from fold_in(site key, layer, row id): a row gets the
    same mask whichever device, microbatch or pipeline stage computes it, so a run resumed on
    another layout draws the masks the uninterrupted run drew. (Flax's Dropout draws one mask
    for the array it is given, which depends on how the batch was split.)"""

    rate: float
    deterministic: bool

    @nn.compact
    def __call__(self, x: jax.Array, rows: Rows | None) -> jax.Array:
        if self.deterministic or self.rate == 0.0:
            return x
        assert rows is not None, "dropout draws its masks from the rows' ids"
        key = jax.random.fold_in(self.make_rng("dropout"), rows.layer)
        keep_prob = 1.0 - self.rate

        def mask(row):
            return jax.random.bernoulli(jax.random.fold_in(key, row), keep_prob, x.shape[1:])

        keep = jax.vmap(mask)(rows.ids)
        return jax.lax.select(keep, x / jnp.asarray(keep_prob, x.dtype), jnp.zeros_like(x))


class AttentionDropout(nn.Module):
    """The seed of a layer's attention dropout (`attention_keep`), from the step's dropout key
    and the layer; None when deterministic or rate 0."""

    rate: float
    deterministic: bool

    @nn.compact
    def __call__(self, rows: Rows | None) -> jax.Array | None:
        if self.deterministic or self.rate == 0.0:
            return None
        assert rows is not None, "attention dropout draws its seed from the layer"
        key = jax.random.fold_in(self.make_rng("dropout"), rows.layer)
        return jax.lax.bitcast_convert_type(jax.random.bits(key, (), jnp.uint32), jnp.int32)


class Projection(nn.Module):
    """A bias-free linear map contracting the last `len(in_axes)` input axes into `shape`."""

    shape: Sequence[int]
    in_axes: Sequence[str]
    out_axes: Sequence[str]
    kernel_init: Initializer
    dtype: jnp.dtype

    @overload
    def __call__(self, x: jax.Array, /) -> jax.Array: ...

    @overload
    def __call__(
        self, x: jax.Array, y: jax.Array, /, *more: jax.Array
    ) -> tuple[jax.Array, ...]: ...

    @nn.compact
    def __call__(self, x: jax.Array, /, *more: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
        """`x` projected; given `more` inputs, all of them, by one kernel whose gradient sums
        its uses in float32 and is rounded to the compute dtype once (`_shared_projection`)."""
        n_in = len(self.in_axes)
        kernel_shape = (*x.shape[x.ndim - n_in :], *self.shape)
        axes = (*self.in_axes, *self.out_axes)
        kernel = logical_param(self, "kernel", self.kernel_init, axes, kernel_shape)
        kernel, xs = kernel.astype(self.dtype), tuple(a.astype(self.dtype) for a in (x, *more))
        if not more:
            return _project(n_in, xs[0], kernel)
        return _shared_projection(n_in, kernel, *xs)


def _project(n_in: int, x: jax.Array, kernel: jax.Array) -> jax.Array:
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    return jax.lax.dot_general(x, kernel, (contract, ((), ())))


# One kernel applied to several inputs. Its plain gradient would be each use's gradient rounded
# to the compute dtype, then summed in that dtype wherever the kernel reaches the layer already
# cast (a layer stack casts its parameters once a step): here the uses' gradients come out of
# their matmuls in float32, are summed there and rounded once.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _shared_projection(n_in: int, kernel: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(_project(n_in, x, kernel) for x in xs)


def _shared_projection_fwd(n_in, kernel, *xs):
    return _shared_projection(n_in, kernel, *xs), (kernel, xs)


def _shared_projection_bwd(n_in, saved, dys):
    kernel, xs = saved
    # The inputs' gradients are a plain projection's; the kernel's come out in float32.
    dxs = [
        jax.vjp(lambda x: _project(n_in, x, kernel), x)[1](dy)[0]
        for x, dy in zip(xs, dys, strict=True)
    ]
    dkernel = sum(
        jax.lax.dot_general(x, dy, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
        for x, dy in zip(xs, dys, strict=True)
        for lead in [tuple(range(x.ndim - n_in))]
    )
    return (dkernel.astype(kernel.dtype), *dxs)


_shared_projection.defvjp(_shared_projection_fwd, _shared_projection_bwd)


# A decoding step's MLP input kernels side by side (`blocks.joined_for_decoding`), [D, 2 * F].
JOINED_WI = "wi_joined"


def joined_product(module: nn.Module, name: str, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x times the kernels `module` holds side by side as `name` (`blocks.joined_for_decoding`),
    as `Projection` multiplies: both in `dtype`, x's last axis against the kernel's first."""
    kernel: jax.Array = module.get_variable("params", name)
    return _project(1, x.astype(dtype), kernel.astype(dtype))


class MLP(nn.Module):
    """Gated GELU: wo(gelu_tanh(x wi_0) * (x wi_1)), as T5.1.1 (HF 'gated-gelu')."""

    config: LongT5Config
    deterministic: bool

    @nn.compact
    def __call__(self, x: jax.Array, rows: Rows | None = None) -> jax.Array:
        c = self.config
        wi = functools.partial(
            Projection,
            shape=(c.d_ff,),
            in_axes=("embed",),
            out_axes=("mlp",),
            kernel_init=truncated_normal_fan_in(),
            dtype=c.compute_dtype,
        )
        if self.has_variable("params", JOINED_WI):
            both = joined_product(self, JOINED_WI, x, c.compute_dtype)
            h0, h1 = jnp.split(both, 2, axis=-1)
            h = nn.gelu(h0, approximate=True) * h1
        else:
            gate = nn.gelu(wi(name="wi_0")(x), approximate=True)
            h = gate * wi(name="wi_1")(x)
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        h = Dropout(c.dropout_rate, self.deterministic)(h, rows)
        return Projection(
            (c.d_model,),
            ("mlp",),
            ("embed",),
            truncated_normal_fan_in(),
            c.compute_dtype,
            name="wo",
        )(h)


class Embed(nn.Module):
    """The token embedding shared by encoder and decoder inputs (not the output projection)."""

    config: LongT5Config

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        c = self.config
        table = logical_param(
            self, "embedding", normal(1.0), ("vocab", "embed"), (c.vocab_size, c.d_model)
        )
        x = jnp.take(table, ids, axis=0).astype(c.compute_dtype)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))
