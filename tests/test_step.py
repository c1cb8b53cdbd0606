"""The sharded train step against a single-device run: meshes, ZeRO stages, accumulation.

Parameters are compared after SGD steps: adaptive optimizers divide by sqrt(v) + eps, which turns
float-rounding differences in near-zero gradients into visible parameter differences that say
nothing about the parallelism (losses are compared with the adaptive optimizer too).
"""

import dataclasses

import flax.traverse_util
import jax
import numpy as np
import optax
import pytest
from helpers import ADAFACTOR, assert_same_training, tiny_batches, while_bodies

from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.parallel.mesh import ParallelConfig, make_mesh
from longt5_jax.training.optim import make_optimizer
from longt5_jax.training.step import Evaluator, ShardedStep, StepConfig

CONFIG = LongT5Config.preset("tiny")
MESHES = {"dp8": (8, 1), "dp4_tp2": (4, 2), "dp2_tp4": (2, 4)}


def _run(mesh_cfg, optimizer, microbatches=1, devices=None, batches=None, **step_cfg):
    step = ShardedStep(
        LongT5(CONFIG),
        StepConfig(microbatches=microbatches, **step_cfg),
        optimizer,
        make_mesh(mesh_cfg, devices),
        mesh_cfg,
    )
    state = step.init(jax.random.key(0))
    losses = []
    for batch in batches or tiny_batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def reference():
    one = jax.devices()[:1]
    return {"sgd": _run(ParallelConfig(data=1, zero_stage=0), optax.sgd(0.5), devices=one)}


# Every mesh and every ZeRO stage runs by default (half the grid); the whole grid in the slow run.
_GRID = [
    pytest.param(mesh, stage, marks=() if (i + stage) % 2 == 0 else pytest.mark.slow)
    for i, mesh in enumerate(MESHES)
    for stage in (0, 1, 2, 3)
]


@pytest.mark.parametrize("mesh, zero_stage", _GRID)
def test_sharded_steps_equal_one_device(reference, mesh, zero_stage):
    data, tensor = MESHES[mesh]
    cfg = ParallelConfig(data=data, tensor=tensor, zero_stage=zero_stage)
    assert_same_training(_run(cfg, optax.sgd(0.5)), reference["sgd"])


@pytest.mark.slow
def test_adaptive_optimizer_losses_equal_one_device():
    # Measured: 2.4e-7 relative for both (2 float32 ulps).
    # The one-device AdamW run is this test's alone (not the module's reference): the default
    # pass, which skips this test, does not compile it.
    alone, one_device = ParallelConfig(data=1, zero_stage=0), jax.devices()[:1]
    losses, _ = _run(ParallelConfig(data=4, tensor=2, zero_stage=3), optax.adamw(1e-2))
    want = _run(alone, optax.adamw(1e-2), devices=one_device)[0]
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    one = _run(alone, make_optimizer(ADAFACTOR), devices=one_device)[0]
    sharded = _run(ParallelConfig(data=4, tensor=2, zero_stage=3), make_optimizer(ADAFACTOR))[0]
    np.testing.assert_allclose(sharded, one, rtol=1e-6)


def test_adafactor_factored_moments_follow_their_parameters():
    parallel = ParallelConfig(data=4, tensor=2, zero_stage=1)
    step = ShardedStep(
        LongT5(CONFIG), StepConfig(), make_optimizer(ADAFACTOR), make_mesh(parallel), parallel
    )
    state = step.init(jax.random.key(0))
    shapes = {}
    for leaf in jax.tree.leaves(state.opt_state):
        shapes.setdefault(leaf.shape, set()).add(tuple(leaf.sharding.spec))
    # MLP kernels [2, 32, 64] / [2, 64, 32]: the moment over d_ff keeps the tensor split and the
    # moment over d_model the ZeRO split over data.
    assert shapes[(2, 64)] == {(None, "tensor")}
    assert shapes[(2, 32)] == {(None, "data")}
    assert (2, 32, 64) not in shapes  # factored: no full-size second moment


def test_factored_moments_of_a_square_kernel_keep_their_own_axis_split():
    """d_ff == d_model: the sizes of wi's [layers, d_model, d_ff] cannot tell its row moment
    from its column moment; the axes Adafactor keeps do (d_model: ZeRO's data, d_ff: tensor)."""
    config = LongT5Config.preset("tiny", d_ff=32)
    parallel = ParallelConfig(data=4, tensor=2, zero_stage=1)
    step = ShardedStep(
        LongT5(config), StepConfig(), make_optimizer(ADAFACTOR), make_mesh(parallel), parallel
    )
    opt = step.state_shardings.opt_state

    def spec(field, kernel):
        tree = optax.tree_utils.tree_get(opt, field)
        return tuple(tree["encoder"]["layers"]["mlp"][kernel]["kernel"].spec)

    assert spec("v_row", "wi_0") == (None, "data") and spec("v_col", "wi_0") == (None, "tensor")
    assert spec("v_row", "wo") == (None, "tensor") and spec("v_col", "wo") == (None, "data")


def test_bfloat16_gradient_reduction_stays_close(reference):
    losses, params = _run(
        ParallelConfig(data=8, zero_stage=2), optax.sgd(0.5), grad_dtype="bfloat16"
    )
    # Measured: losses within 8.2e-5 relative, parameters within 5.2e-3 of each leaf's largest
    # (bfloat16 keeps ~3 digits).
    np.testing.assert_allclose(losses, reference["sgd"][0], rtol=3e-4)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference["sgd"][1]), strict=True):
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()


def test_sequence_sharding_changes_layout_not_results(reference):
    cfg = ParallelConfig(data=4, tensor=2, zero_stage=1, sequence_sharding=True)
    assert_same_training(_run(cfg, optax.sgd(0.5)), reference["sgd"])


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_microbatches_equal_one_big_batch(reference, zero_stage):
    cfg = ParallelConfig(data=2, tensor=4, zero_stage=zero_stage)
    assert_same_training(_run(cfg, optax.sgd(0.5), microbatches=4), reference["sgd"])


DROPOUT = LongT5Config.preset("tiny", dropout_rate=0.1)
# (data, tensor, pipeline, ZeRO stage, accumulated microbatches): every way the rows of a step
# are split (devices, accumulation, pipeline microbatches and stages) draws the same masks.
DROPOUT_LAYOUTS = {
    "dp4_tp2_zero3_accumulate2": (4, 2, 1, 3, 2),
    "dp2_tp2_pp2": (2, 2, 2, 1, 1),
    # ZeRO-2 splits the gradients of the weights outside the stages over data: they are
    # reduce-scattered over data and pipeline, then gathered over pipeline.
    "dp2_tp2_pp2_zero2": (2, 2, 2, 2, 1),
}


def _dropout_run(parallel, microbatches=1, devices=None):
    step = ShardedStep(
        LongT5(DROPOUT, runner=parallel.pipeline_schedule()),
        StepConfig(microbatches=microbatches),
        optax.sgd(0.5),
        make_mesh(parallel, devices),
        parallel,
    )
    state, losses = step.init(jax.random.key(0)), []
    for i, batch in enumerate(tiny_batches()):
        state, metrics = step(state, batch, jax.random.fold_in(jax.random.key(7), i))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def dropout_reference():
    return _dropout_run(ParallelConfig(data=1, zero_stage=0), devices=jax.devices()[:1])


@pytest.mark.parametrize("layout", DROPOUT_LAYOUTS)
def test_dropout_masks_follow_the_rows_not_the_layout(reference, dropout_reference, layout):
    """With dropout, sharded, accumulated and pipelined steps equal one device: a row's masks
    come from the step and its index in the global batch, so a run resumed on another layout
    draws what the uninterrupted run drew."""
    data, tensor, stages, zero, micro = DROPOUT_LAYOUTS[layout]
    parallel = ParallelConfig(
        data=data, tensor=tensor, pipeline=stages, zero_stage=zero, pipeline_microbatches=4
    )
    # Dropout is on: the losses are not the deterministic run's (they differ by 0.035 or more).
    assert np.abs(dropout_reference[0] - reference["sgd"][0]).min() > 1e-2
    assert_same_training(_dropout_run(parallel, micro), dropout_reference)


def _specs(mesh, zero_stage, optimizer=None):
    data, tensor = MESHES[mesh]
    parallel = ParallelConfig(data=data, tensor=tensor, zero_stage=zero_stage)
    optimizer = optimizer or optax.adamw(1e-3)
    step = ShardedStep(LongT5(CONFIG), StepConfig(), optimizer, make_mesh(parallel), parallel)
    flat = flax.traverse_util.flatten_dict(step.param_shardings, sep="/")
    return step, {k: tuple(v.spec) for k, v in flat.items()}


# The golden table: how the tiny model's parameters are laid out (trailing Nones dropped).
GOLDEN = {
    ("dp4_tp2", 0): {
        "token_embedder/embedding": ("tensor",),
        "encoder/layers/attention/query/kernel": (None, None, "tensor"),
        "encoder/layers/attention/out/kernel": (None, "tensor"),
        "encoder/layers/mlp/wi_0/kernel": (None, None, "tensor"),
        "encoder/layers/mlp/wo/kernel": (None, "tensor"),
        "encoder/relpos_bias/rel_embedding": ("tensor",),
        "encoder/layers/pre_mlp_layer_norm/scale": (),
        "decoder/logits_dense/kernel": (None, "tensor"),
    },
    ("dp4_tp2", 3): {
        "token_embedder/embedding": ("tensor", "data"),
        "encoder/layers/attention/query/kernel": (None, "data", "tensor"),
        "encoder/layers/attention/out/kernel": (None, "tensor", None, "data"),
        "encoder/layers/mlp/wi_0/kernel": (None, "data", "tensor"),
        "encoder/layers/mlp/wo/kernel": (None, "tensor", "data"),
        "encoder/relpos_bias/rel_embedding": ("tensor",),
        "encoder/layers/pre_mlp_layer_norm/scale": (None, "data"),
        "decoder/logits_dense/kernel": ("data", "tensor"),
    },
    ("dp8", 3): {  # the tensor axis has size 1 here: naming it costs nothing
        "token_embedder/embedding": ("tensor", "data"),
        "encoder/layers/attention/query/kernel": (None, "data", "tensor"),
        "encoder/layers/mlp/wo/kernel": (None, "tensor", "data"),
        "decoder/logits_dense/kernel": ("data", "tensor"),
    },
}


@pytest.mark.parametrize("mesh,zero_stage", list(GOLDEN))
def test_partition_specs_golden_table(mesh, zero_stage):
    _, specs = _specs(mesh, zero_stage)
    for path, want in GOLDEN[(mesh, zero_stage)].items():
        got = specs[path]
        while got and got[-1] is None:
            got = got[:-1]
        assert got == want, path


def _bytes_per_device(tree):
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def test_zero3_keeps_a_data_fraction_of_the_state_per_device():
    sizes = {}
    for stage in (0, 1, 3):
        step, _ = _specs("dp8", stage)
        state = step.init(jax.random.key(0))
        sizes[stage] = (_bytes_per_device(state.params), _bytes_per_device(state.opt_state))
    # Parameters are gathered layer by layer inside the scanned stacks' loops, whatever the
    # optimizer: SGD's step, the program test_sharded_steps_equal_one_device[dp8-3] compiled
    # (read back from the persistent cache where it ran before).
    assert any("all-gather" in body for body in while_bodies(_compiled_sgd_step("dp8", 3)))
    full = sum(sizes[0])
    # Both measure 0.1263: 1/8 plus the small replicated relpos tables.
    assert sizes[1][0] == sizes[0][0] and sizes[1][1] < 0.13 * sizes[0][1]  # moments sharded
    assert sum(sizes[3]) < 0.13 * full


def _compiled_sgd_step(mesh, zero_stage):
    """The text of the step test_sharded_steps_equal_one_device runs on this layout."""
    step, _ = _specs(mesh, zero_stage, optax.sgd(0.5))
    return step.lower(step.abstract_state, tiny_batches(1)[0]).compile().as_text()


def test_tensor_parallel_step_reduces_over_tensor():
    # The optimizer is no part of the model's reductions: SGD's step, test_sharded_steps_equal_
    # one_device[dp2_tp4-0]'s program (read back from the persistent cache where it ran before).
    assert "all-reduce" in _compiled_sgd_step("dp2_tp4", 0)


def test_mesh_errors_name_the_mismatch():
    with pytest.raises(ValueError, match="mesh data=3 x tensor=2 x pipeline=1 does not match 8"):
        make_mesh(ParallelConfig(data=3, tensor=2))
    with pytest.raises(ValueError, match="zero_stage=4"):
        ParallelConfig(zero_stage=4)
    assert make_mesh(ParallelConfig(tensor=2)).shape == {"data": 4, "tensor": 2, "pipeline": 1}


@pytest.mark.parametrize(
    "layout", [(8, 1, 1, 0, "none"), (2, 2, 2, 3, "none"), (4, 2, 1, 1, "optimizer_and_params")]
)
def test_the_one_eval_path_equals_one_device_on_every_layout(layout):
    """Training's evaluation (pipelined through the step's region, parameters read from host
    memory) and the evaluate command's (the decoding layout) give the one-device statistics."""
    data, tensor, stages, zero, offload = layout
    parallel = ParallelConfig(data, tensor, stages, zero, offload=offload)
    alone = ParallelConfig(1)
    one_mesh = make_mesh(alone, jax.devices()[:1])
    one = ShardedStep(LongT5(CONFIG), StepConfig(), optax.sgd(0.5), one_mesh, alone)
    params = jax.tree.map(np.asarray, one.init(jax.random.key(3)).params)
    batch = tiny_batches(1, seed=5)[0]
    want = jax.device_get(one.evaluate(params, batch))
    model = LongT5(CONFIG, runner=parallel.pipeline_schedule())
    step = ShardedStep(model, StepConfig(), optax.sgd(0.5), make_mesh(parallel), parallel)
    placed = jax.device_put(params, step.state_shardings.params)
    decoding = Evaluator(LongT5(CONFIG), step.mesh, dataclasses.replace(parallel, pipeline=1))
    for got in (step.evaluate(placed, batch), decoding(jax.device_put(params), batch)):
        got = jax.device_get(got)
        assert got["weight"] == want["weight"] and got["correct"] == want["correct"]
        # Measured: the summed loss within 6e-8 relative (1 float32 ulp) on each layout.
        np.testing.assert_allclose(got["loss_sum"], want["loss_sum"], rtol=2e-7)
