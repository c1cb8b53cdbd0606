"""This process's devices: fake CPU devices for a machine without an accelerator."""

from __future__ import annotations

import contextlib

import jax


def cpu_devices(count: int) -> None:
    """`count` fake CPU devices for a machine without an accelerator (0: leave it). Possible
    only before jax's backend starts; a process that already has its devices (a test, a
    process started with XLA's host device count) keeps them."""
    if count and jax.config.jax_platforms in (None, "", "cpu"):
        with contextlib.suppress(RuntimeError):  # the backend has started: keep its devices
            jax.config.update("jax_num_cpu_devices", count)
