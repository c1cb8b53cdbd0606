"""Per-platform compiler options: CPU keeps reductions out of YNNPACK; GPU options live here and
nowhere else (the launch script sets no XLA flags of its own)."""

from pathlib import Path

import jax
import jax.numpy as jnp

from longt5_jax.parallel.xla_options import GPU_OPTIONS, compiler_options

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_reductions_stay_out_of_ynnpack_fusions():
    options = compiler_options("cpu")
    assert options is not None  # this jaxlib knows them; a newer one may not
    assert compiler_options("tpu") is None

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


def test_gpu_options_are_set_in_one_place():
    assert compiler_options("gpu") == GPU_OPTIONS
    assert all(name.startswith("xla_gpu_") for name in GPU_OPTIONS)
    for script in (ROOT / "launch").rglob("*"):
        if script.is_file() and script.suffix != ".md":
            assert "--xla_" not in script.read_text(), script
