"""The kernels' backend seam (`kernels.interface`): `attention_kernel="auto"` takes XLA's
attention, with one warning line, where this jax cannot build the kernels for a GPU."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from longt5_jax.estimate import targets
from longt5_jax.kernels import backend, interface
from longt5_jax.model import LongT5Config

AUTO = LongT5Config.preset("tiny", attention_kernel="auto", dtype="bfloat16")

# A jax without Pallas' Triton backend (jax 0.11 deprecated it): its import fails.
WITHOUT_TRITON = """
import sys
sys.modules["jax.experimental.pallas.triton"] = None
import jax.numpy as jnp
from longt5_jax.kernels import interface
from longt5_jax.model import LongT5Config
auto = LongT5Config.preset("tiny", attention_kernel="auto", dtype="bfloat16")
print(*(interface.resolve(auto, cc).attention_kernel for cc in ("9.0", "8.0")))
pallas = LongT5Config.preset("tiny", attention_kernel="pallas")
print(interface.resolve(pallas, "9.0").attention_kernel)
q, mask = jnp.ones((1, 16, 1, 16)), jnp.ones((1, 16, 16), bool)
print(float(interface.decoder_attention(q, q, q, mask).sum()))
"""


def test_auto_takes_xla_with_one_warning_where_the_triton_backend_is_missing():
    """A GPU that suits the kernels gets XLA's attention, said once; "pallas" asked for stays
    so (interpreted, the kernels still run on a CPU)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["xla", "xla", "pallas", "256.0"], done.stdout
    warnings = [line for line in done.stderr.splitlines() if "attention_kernel" in line]
    assert warnings == [
        f"warning: attention_kernel auto: jax {jax.__version__} has no Pallas Triton backend; "
        "XLA's attention instead"
    ], done.stderr


def _twelve(x_ref, o_ref):
    o_ref[...] = jnp.cumsum(x_ref[...])


def not_a_power_of_two(q):
    """A kernel over 12 elements, which the Triton lowering refuses (powers of 2 only)."""
    x = jnp.arange(12, dtype=jnp.int32)
    params = backend.plgpu.CompilerParams(num_warps=1, num_stages=1)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(_twelve, out_shape=out, compiler_params=params)(x)


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_a_kernel_that_does_not_lower_is_said_once_and_the_kernels_here_lower(capsys):
    """`unusable` lowers a kernel call for a GPU: one that fails is the reason (one warning
    line, once); the decoder's kernels lower on this jax, so "auto" takes them on a GPU."""
    why = interface.unusable(not_a_power_of_two)
    assert "power of 2" in why
    assert interface.unusable(not_a_power_of_two) == why
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: attention_kernel auto: {why}; XLA's attention instead"]
    assert interface.unusable() == ""
    assert interface.resolve(AUTO, "9.0").attention_kernel == "pallas"
    assert interface.resolve(AUTO, "7.0").attention_kernel == "xla"
    assert capsys.readouterr().err == ""
