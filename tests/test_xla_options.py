"""Per-platform compiler options: CPU keeps reductions out of YNNPACK, other platforms get none."""

import jax
import jax.numpy as jnp

from longt5_jax.xla_options import compiler_options


def test_cpu_reductions_stay_out_of_ynnpack_fusions():
    options = compiler_options("cpu")
    assert options is not None  # this jaxlib knows them; a newer one may not
    assert compiler_options("gpu") is None and compiler_options("tpu") is None

    def layer_norm_scale_grad(x, dy):  # the reduction that ran 5x slower inside YNNPACK
        return jnp.sum(x * dy, axis=0), x @ dy.T

    args = (jnp.ones((256, 64)), jnp.ones((256, 64)))
    lowered = jax.jit(layer_norm_scale_grad).lower(*args)
    hlo = lowered.compile(compiler_options=options).as_text()
    fused = [line for line in hlo.splitlines() if "__ynn_fusion" in line]
    assert fused, "the matmul should still be a YNNPACK fusion"
    for line in fused:
        callee = line.split("calls=%")[1].split(",")[0]
        body = hlo.split(f"%{callee} ")[1].split("\n}")[0]
        assert " reduce(" not in body, body
