"""The fused encoder attention (Pallas, interpreted on CPU) against the XLA path it replaces."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_step

from longt5_jax.bench import kernels
from longt5_jax.model import LongT5Config
from longt5_jax.model.transformer import LongT5
from longt5_jax.parallel.mesh import MeshConfig, make_mesh
from longt5_jax.plan import compile_ahead, hlo, targets
from longt5_jax.training.step import ShardedStep, StepConfig

# name: (attention, local radius, global block, batch, length, heads, packed). Lengths are not
# multiples of the block W = radius + 1 except where said; short_g0 is shorter than one global
# block (no side keys).
CASES = {
    "tglobal": ("transient-global", 3, 4, 2, 29, 4, False),
    "tglobal_packed": ("transient-global", 3, 2, 2, 32, 2, True),  # a multiple of W
    "tglobal_w8_packed": ("transient-global", 7, 3, 3, 45, 3, True),
    "local": ("local", 3, 4, 2, 21, 3, False),
    "local_packed": ("local", 7, 4, 1, 40, 4, True),
    "short_g0": ("transient-global", 3, 16, 2, 11, 2, False),
}
# Largest error of the output and of every gradient over the largest value of the XLA path's,
# float32: measured worst 5.3e-7 over these cases (the side table's gradient, tglobal_w8_packed).
TOLERANCE = 2e-6


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_attention_matches_the_xla_path(case):
    attention, radius, k, batch, length, heads, packed = CASES[case]
    xla = LongT5Config.preset(
        "tiny", attention, local_radius=radius, global_block_size=k, num_heads=heads
    )
    params, inputs, cotangent = kernels.layer_problem(xla, batch, length, packed)
    want = kernels.run_layer(xla, params, inputs, cotangent)
    fused = dataclasses.replace(xla, attention_kernel="pallas")
    got = kernels.run_layer(fused, params, inputs, cotangent)
    errors = kernels.relative_errors(got, want, inputs["seg"][..., None] > 0)
    # Every gradient is there: both bias tables, the input, the projections (and side norm).
    assert len(errors) == (9 if attention == "transient-global" else 7)
    assert max(errors.values()) <= TOLERANCE, errors


def test_the_model_trains_the_same_with_the_kernels():
    """Loss and every parameter's gradient of a whole (tiny, TGlobal, padded) model."""
    xla = LongT5Config.preset("tiny")
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(2, xla.vocab_size, (2, 27)), jnp.int32)
    mask = jnp.asarray(np.arange(27)[None] < np.array([[27], [19]]), jnp.int32)
    targets = jnp.asarray(rng.integers(2, xla.vocab_size, (2, 6)), jnp.int32)
    params = LongT5(xla).init(jax.random.key(0), ids, mask, targets)["params"]

    def loss(params, config):
        logits = LongT5(config).apply({"params": params}, ids, mask, targets)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    want_loss, want = grad(params, xla)
    got_loss, got = grad(params, dataclasses.replace(xla, attention_kernel="pallas"))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert float(jnp.max(jnp.abs(g - w))) <= TOLERANCE * float(jnp.max(jnp.abs(w)))


GPU_CONFIG = LongT5Config.preset(
    "tiny", "tglobal", d_model=64, d_ff=256, d_kv=16, local_radius=15, attention_kernel="pallas"
)
KERNELS = {"fwd", "dq", "dkv", "dbias", "dside"}


def _triton_kernels(compiled) -> set[str]:
    text = compiled.executable.as_text()
    return {k for k in KERNELS if f'name = "encoder_attention_{k}.flops_' in text}


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
@pytest.mark.parametrize("target", ["h100-80gb", "a100-80gb"])
def test_the_kernels_compile_for_gpus_inside_the_train_step(target):
    """Triton lowering and XLA's GPU compile of the single-device step, deviceless."""
    devices = targets.devices(targets.load(target), 1, 1)
    compiled = compile_ahead.compile_for(
        GPU_CONFIG, MeshConfig(1, 1, 1, 0), devices, 1, (2, 128, 16)
    )
    assert _triton_kernels(compiled) == KERNELS


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_the_kernels_compile_in_pipeline_stages_and_move_no_more_bytes():
    """Two pipeline stages (a shard_map manual over the stages): the kernels run on each
    stage's rows and the step's collectives are those of the XLA path."""
    devices = targets.devices(targets.load("h100-80gb"), 1, 2)
    deep = dict(num_encoder_layers=4, num_decoder_layers=4, remat="full")
    plan = MeshConfig(1, 1, 2, 0, pipeline_microbatches=4)
    steps = {
        kernel: compile_ahead.compile_for(
            dataclasses.replace(GPU_CONFIG, attention_kernel=kernel, **deep),
            plan,
            devices,
            2,
            (8, 128, 16),
        )  # fmt: skip
        for kernel in ("xla", "pallas")
    }
    assert _triton_kernels(steps["pallas"]) == KERNELS
    moved = {k: hlo.bytes_by_kind(s.collectives) for k, s in steps.items()}
    assert moved["pallas"] == moved["xla"]


@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_the_kernels_run_on_each_devices_rows_and_heads_and_move_no_more_bytes():
    """Data 2 x tensor 2: each device's kernels see its own rows and heads (a shard_map), so the
    step's collectives are the XLA path's, byte for byte (GSPMD alone would gather every
    operand of a custom call)."""
    devices = targets.devices(targets.load("a100-80gb"), 1, 4)
    steps = {
        kernel: compile_ahead.compile_for(
            dataclasses.replace(GPU_CONFIG, attention_kernel=kernel),
            MeshConfig(2, 2, 1, 1),
            devices,
            4,
            (8, 128, 16),
        )  # fmt: skip
        for kernel in ("xla", "pallas")
    }
    assert _triton_kernels(steps["pallas"]) == KERNELS
    moved = {k: hlo.bytes_by(s.collectives, s.placement)["axes"] for k, s in steps.items()}
    assert moved["pallas"] == moved["xla"]


@pytest.mark.parametrize("mesh", [(2, 2), (4, 1)])
def test_sharded_steps_with_the_kernels_equal_one_device(mesh):
    """SGD steps of the tiny model, kernels interpreted on each device's shard, against the XLA
    path on one device (test_step's batches and tolerance)."""
    tiny = LongT5Config.preset("tiny")

    def run(config, plan, devices):
        step = ShardedStep(
            LongT5(config), StepConfig(), optax.sgd(0.5), make_mesh(plan, devices), plan
        )
        state, losses = step.init(jax.random.key(0)), []
        for batch in test_step._batches(n=2):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return np.array(losses), jax.tree.map(np.asarray, state.params)

    want = run(tiny, MeshConfig(data=1), jax.devices()[:1])
    pallas = dataclasses.replace(tiny, attention_kernel="pallas")
    test_step._assert_same(run(pallas, MeshConfig(*mesh), jax.devices()[:4]), want)
