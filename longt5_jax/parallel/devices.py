"""This process's devices: fake CPU devices for a machine without an accelerator, and what a
device can compute in."""

from __future__ import annotations

import contextlib
import re

import jax

from longt5_jax.errors import ConfigError

# bfloat16 arithmetic (tensor cores, cuBLAS) came with Ampere, CUDA compute capability 8.0. Volta
# (7.0) and Turing (7.5) have float16 only: XLA still compiles bfloat16 for them, but converts
# every bfloat16 dot to float32, so a run asking for half precision would quietly get neither
# its speed nor float16's.
BFLOAT16_SINCE = 8


def cpu_devices(count: int) -> None:
    """`count` fake CPU devices for a machine without an accelerator (0: leave it). Possible
    only before jax's backend starts; a process that already has its devices (a test, a
    process started with XLA's host device count) keeps them."""
    # jax's Config sets its options as attributes at run time; its type declares none.
    platforms = jax.config.jax_platforms  # type: ignore[attr-defined]
    if count and platforms in (None, "", "cpu"):
        with contextlib.suppress(RuntimeError):  # the backend has started: keep its devices
            jax.config.update("jax_num_cpu_devices", count)


def has_bfloat16(compute_capability: str) -> bool:
    """Whether a GPU of this compute capability ("7.0"; "" for none, e.g. a CPU) computes in
    bfloat16. Only a CUDA capability ("major.minor") can say no (ROCm names its architectures
    "gfx...")."""
    m = re.fullmatch(r"(\d+)\.\d+", compute_capability)
    return m is None or int(m.group(1)) >= BFLOAT16_SINCE


def capability(device) -> str:
    """A CUDA device's compute capability ("7.0", also of a compile-only device); "" for others."""
    return str(getattr(device, "compute_capability", "")) if device.platform == "gpu" else ""


def half_precision(compute_capability: str) -> str:
    """The half precision a GPU of this compute capability trains in: bfloat16, float16 where
    it has no bfloat16."""
    return "bfloat16" if has_bfloat16(compute_capability) else "float16"


def half_dtype(device) -> str:
    """The half precision a device trains in (`half_precision` of its capability)."""
    return half_precision(capability(device))


def check_dtype(dtype: str, device) -> None:
    """Refuse a compute dtype the device cannot compute in (bfloat16 before compute capability
    8.0), in one line naming the setting, the device and its capability."""
    found = capability(device)
    if dtype == "bfloat16" and not has_bfloat16(found):
        raise ConfigError(
            f"LongT5Config.dtype='bfloat16': {device.device_kind} (compute capability {found}) "
            "has no bfloat16; use 'float16' (or 'float32')"
        )
