"""How a kernel call is placed on devices: each device's own rows and heads, under the placement
the parallel layer installs (the kernels never see the mesh), and its outputs' types inside a
shard_map."""

from __future__ import annotations

import contextvars
import inspect

import jax

from longt5_jax.kernels.launch import bound


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
    return bound(_PLACEMENT, place)


def on_own_rows_and_heads(fn, arrays: list, axes: list, out_axes) -> jax.Array:
    """fn(*arrays), placed by the placement in force; `axes` names each array's logical axes
    (arrays[0] is [B, L, H, K])."""
    place = _PLACEMENT.get()
    return fn(*arrays) if place is None else place(fn, arrays, axes, out_axes)


def on_own_records(fn, records: tuple, axes: tuple, out_axes):
    """fn(records) as `on_own_rows_and_heads` places it: `records` NamedTuples of arrays (or
    None, left out), `axes` a like record of each one's logical axes; fn gets each device's
    shards as the same records, in order."""
    arrays = [x for record in records if record is not None for x in record]
    flat = [a for record, of in zip(records, axes, strict=True) if record is not None for a in of]

    def on_shard(*shards):
        rebuilt, at = [], 0
        for record in records:
            size = 0 if record is None else len(record)
            rebuilt.append(None if record is None else record._make(shards[at : at + size]))
            at += size
        return fn(tuple(rebuilt))

    return on_own_rows_and_heads(on_shard, arrays, flat, out_axes)
