"""Tests run on 8 fake CPU devices (set before jax starts) in float32."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# With the gpu extra installed, its CUDA plugin would look for a driver at start-up (and print a
# traceback when none is there); the deviceless GPU compile needs none.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
