"""Which attention runs where: the GPUs the kernels compile for (CUDA compute capability), and
the backend seam (see the package map, `longt5_jax.kernels`)."""

from __future__ import annotations

import re
from types import ModuleType

import jax.numpy as jnp

plgpu: ModuleType | None
try:  # Pallas' Triton backend, which the kernels are written for (deprecated in jax 0.11)
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a jax without it: `interface.resolve` takes XLA's attention
    plgpu = None

# Triton, which the kernels are written for, compiles for CUDA GPUs of compute capability 8.0
# (Ampere) and newer: a V100 (7.0) runs XLA's attention.
KERNELS_SINCE = 8


# float32 kernels only from 9.0 (Hopper) on. For 8.x, ptxas (CUDA 12.9 and 13.5, -O3) gives
# the backward kernels of every family 32 registers and spills the rest into local memory in
# every loop, where bfloat16's and an H100's float32 loops keep theirs in registers (`bench
# sass`'s local column; docs/journal.md, "float32 on an A100").
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
