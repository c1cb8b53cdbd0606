"""ZeRO-Offload: state kept in host memory between steps changes where bytes live, not results.

The runs compare programs that are the same up to where arrays live, so they are held to exact
equality (every case in both modes measured bitwise equal on the CPU devices; the slow cases
keep one mode each); the deviceless GPU compile shows the device bytes leave.
"""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from helpers import ADAFACTOR, TINY_RUN, tiny_batches

from longt5_jax import train
from longt5_jax.estimate import compile_ahead, targets
from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.parallel import offload
from longt5_jax.parallel.mesh import ParallelConfig, make_mesh
from longt5_jax.training.optim import make_optimizer
from longt5_jax.training.step import ShardedStep, StepConfig

# Four layers per stack, so that two pipeline stages divide them.
CONFIG = LongT5Config.preset("tiny", num_encoder_layers=4, num_decoder_layers=4)
PLANS = {
    "dp4_tp2": dict(data=4, tensor=2, zero_stage=1),
    "dp2_tp2_pp2": dict(data=2, tensor=2, pipeline=2, pipeline_microbatches=2, zero_stage=3),
}
OPTIMIZERS = {"adamw": lambda: optax.adamw(1e-2), "adafactor": lambda: make_optimizer(ADAFACTOR)}


def _run(parallel, optimizer, mode, microbatches=1, grad_dtype="float32", dtype="float32", steps=3):
    cfg = ParallelConfig(**PLANS[parallel], offload=mode)
    step = ShardedStep(
        LongT5(dataclasses.replace(CONFIG, dtype=dtype), runner=cfg.pipeline_schedule()),
        StepConfig(microbatches=microbatches, grad_dtype=grad_dtype),
        OPTIMIZERS[optimizer](),
        make_mesh(cfg),
        cfg,
    )
    state = step.init(jax.random.key(0))
    losses, kinds = [], []
    for batch in tiny_batches(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        kinds.append(
            {
                part: {x.sharding.memory_kind for x in jax.tree.leaves(getattr(state, part))}
                for part in ("params", "opt_state")
            }
        )
    evaluated = step.evaluate(state.params, tiny_batches(1, seed=1)[0])
    assert int(metrics.get("skipped_steps", 0)) == 0  # float16: every step updated
    return np.array(losses), jax.tree.map(np.asarray, state.params), kinds, evaluated


BOTH = "optimizer,optimizer_and_params"
# The default run checks both modes; the slow cases one each, the pipelined layout both between
# its two cases.
CASES = [
    pytest.param("dp4_tp2", "adamw", 1, "float32", BOTH, "float32"),
    pytest.param(
        "dp2_tp2_pp2",
        "adafactor",
        2,
        "float32",
        "optimizer_and_params",
        "float32",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "dp4_tp2", "adafactor", 2, "float32", "optimizer", "float32", marks=pytest.mark.slow
    ),
    # bf16 gradient reduction: both sides reduce in bf16, so they are still equal.
    pytest.param(
        "dp2_tp2_pp2", "adamw", 2, "bfloat16", "optimizer", "float32", marks=pytest.mark.slow
    ),
    # float16 with its loss scale (kept on the device) through a pipeline, accumulation, ZeRO-3
    # and a bf16 gradient reduction.
    pytest.param(
        "dp2_tp2_pp2",
        "adamw",
        2,
        "bfloat16",
        "optimizer_and_params",
        "float16",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("parallel, optimizer, microbatches, grad_dtype, modes, dtype", CASES)
def test_offloaded_runs_equal_runs_on_the_device(
    parallel, optimizer, microbatches, grad_dtype, modes, dtype
):
    want = _run(parallel, optimizer, "none", microbatches, grad_dtype, dtype)
    assert all(k == {"params": {"device"}, "opt_state": {"device"}} for k in want[2])
    for mode in modes.split(","):
        params_kind = "pinned_host" if mode == "optimizer_and_params" else "device"
        losses, params, kinds, evaluated = _run(
            parallel, optimizer, mode, microbatches, grad_dtype, dtype
        )
        np.testing.assert_array_equal(losses, want[0])
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want[1]), strict=True):
            np.testing.assert_array_equal(a, b)
        # Between steps the offloaded arrays report the host memory kind.
        assert all(k == {"params": {params_kind}, "opt_state": {"pinned_host"}} for k in kinds)
        np.testing.assert_array_equal(evaluated["loss_sum"], want[3]["loss_sum"])


def _losses(model_dir):
    rows = map(json.loads, (model_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def test_checkpoints_move_between_offloaded_and_device_runs(tmp_path):
    """Saved offloaded, resumed on the device, saved, resumed offloaded again: the losses of
    the uninterrupted run on the device."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = [*TINY_RUN, "--gin.CheckpointConfig.save_every=1"]

    def run(steps, model_dir, mode):
        args = [f"--gin.RunConfig.train_steps={steps}", f"--gin.MODEL_DIR='{model_dir}'"]
        assert train.main([*common, *args, f"--gin.ParallelConfig.offload='{mode}'"]) == 0

    run(4, whole, "none")
    run(2, split, "optimizer_and_params")
    run(3, split, "none")
    run(4, split, "optimizer")
    assert _losses(split) == _losses(whole) and len(_losses(whole)) == 4


def test_a_platform_without_host_memory_is_a_one_line_error(monkeypatch):
    class Device:  # a backend that reports only its own memory
        platform = "tpu"

        def addressable_memories(self):
            return [type("Memory", (), {"kind": "device"})()]

    monkeypatch.setattr(offload, "compile_only", lambda device: False)  # a device of this process
    with pytest.raises(offload.NoHostMemory, match=r"ParallelConfig.offload: the tpu devices have"):
        offload.check_host_memory(Device())
    offload.check_host_memory(jax.devices()[0])  # the CPU has pinned_host
    with pytest.raises(ValueError, match="ParallelConfig.offload='disk'"):
        ParallelConfig(offload="disk")


def _per_device_bytes(tree) -> int:
    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for x in jax.tree.leaves(tree)
    )


@pytest.mark.slow
@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_the_compiled_gpu_step_keeps_offloaded_bytes_in_host_memory():
    """Deviceless for 8 x 4 A100 (DP32, ZeRO-0): the optimizer state leaves the device's
    arguments for the host fields of XLA's buffer assignment, and crosses PCIe once each way."""
    config = LongT5Config.preset("tiny", "local", d_model=64, d_ff=256, d_kv=16)
    devices = targets.devices(targets.load("a100-80gb"), 8, 4)
    got = {}
    for mode in offload.OFFLOADS:
        step = compile_ahead.compile_for(
            config, ParallelConfig(zero_stage=0, offload=mode), devices, 4, (128, 64, 16)
        )
        state = step.step.abstract_state
        got[mode] = step.memory(), step.host_transfers
    opt, params = _per_device_bytes(state.opt_state), _per_device_bytes(state.params)
    (none, _), (optim, moved), (both, moved_both) = got.values()
    assert none.host == 0 and optim.host == opt and both.host == opt + params
    assert none.arguments - optim.arguments == opt
    # The update still needs the moments on the device, briefly: all but 1.2% of them leave
    # (measured; at xl size the whole optimizer state does, docs/benchmarks.md).
    assert 0.98 * opt <= none.total - optim.total <= opt
    assert moved.to_device == moved.to_host == opt
    assert moved_both.to_device == moved_both.to_host == opt + params
