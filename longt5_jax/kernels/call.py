"""The call of a kernel: Triton on a GPU, interpreted elsewhere (tests on CPU), with its launch
settings; the helpers every call's operands use (whole arrays, padding) and the names its
residuals are saved by."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from longt5_jax.kernels.backend import plgpu
from longt5_jax.kernels.launch import KERNELS, bound, launch_of
from longt5_jax.kernels.softmax import TRITON


def pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def call(kernel, name: str, *, flops: int, grid, in_specs, out_specs, out_shape):
    """The kernel as Triton on a GPU and interpreted elsewhere (tests on CPU): both are traced,
    and lowering keeps the one for the platform compiled for (a deviceless GPU compile on a
    CPU host gets Triton)."""
    if name not in KERNELS:  # a launch pattern could not know it
        raise ValueError(f"kernel {name!r} is not one of launch.KERNELS")

    def build(interpret: bool, wide: bool):
        params = None if plgpu is None else plgpu.CompilerParams(**launch_of(name, wide))
        kernel_call = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            interpret=interpret,
            compiler_params=params,
            name=f"{name}.flops_{flops}",
        )

        def traced(*operands):  # the kernel's body is traced here, for Triton or the interpreter
            with bound(TRITON, not interpret):
                return kernel_call(*operands)

        return traced

    def run(*operands):
        """The call of `operands`: named records of arrays (each matching its `in_specs`)."""
        wide = jnp.dtype(jax.tree.leaves(operands)[0].dtype).itemsize >= 4
        if plgpu is None:  # no Triton backend: interpreted only (`interface.unusable`)
            return build(True, wide)(*operands)
        return jax.lax.platform_dependent(
            *operands, cpu=build(True, wide), default=build(False, wide)
        )

    return run


# What a kernel's backward reads from its forward beside its inputs: the output and the
# log-sum-exp, named for the remat policies that keep them ("save_attention", "save_dots").
# Recomputed, they cost a forward kernel again (docs/journal.md, "Keeping the kernels' outputs
# under remat"); kept, a [B, L, H, K] bfloat16 and a [B, H, L] float32 array a layer.
SAVED = "attention_kernel_outputs"


def saveable(o, lse):
    return checkpoint_name(o, SAVED), checkpoint_name(lse, SAVED)


def whole() -> pl.BlockSpec:
    """The whole array, indexed in the kernel."""
    return pl.BlockSpec()


def filled(record, spec, **named):
    """A `record` (a NamedTuple of a kernel's operands) of block specs: `spec` in every field
    but the `named` ones."""
    return record(**{**dict.fromkeys(record._fields, spec), **named})


def pad(x: jax.Array, sizes: dict[int, int], value=0) -> jax.Array:
    """x zero- (or `value`-) padded at the end of each axis in `sizes` to that size."""
    widths = [(0, sizes.get(axis, n) - n) for axis, n in enumerate(x.shape)]
    return jnp.pad(x, widths, constant_values=value) if any(w for _, w in widths) else x
