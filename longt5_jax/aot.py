"""Compile the sharded train step ahead of time from shapes alone: no parameter is ever made.

The state is `jax.eval_shape` of the model's and optimizer's initialisers, and state and batch
are `jax.ShapeDtypeStruct`s carrying the step's shardings, so lowering sees exactly the arrays a
run would pass (per-device shards, donation) while nothing is allocated: a 3B-parameter step
compiles on a laptop. The devices must exist (fake CPU devices will do).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from longt5_jax.data.batching import FEATURES
from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.parallel.mesh import MeshConfig, make_mesh
from longt5_jax.step import Batch, ShardedStep, StepConfig, TrainState


def abstract_state(step: ShardedStep) -> TrainState:
    """The train state as sharded ShapeDtypeStructs."""
    params = nn.unbox(jax.eval_shape(step._init_params, jax.random.key(0)))
    shapes = TrainState(
        jax.ShapeDtypeStruct((), jnp.int32), params, jax.eval_shape(step.optimizer.init, params)
    )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        shapes,
        step.state_shardings,
    )


def abstract_batch(
    step: ShardedStep, batch_size: int, input_length: int, target_length: int
) -> Batch:
    """A batch of the eight T5X features as sharded ShapeDtypeStructs."""

    def one(name: str) -> jax.ShapeDtypeStruct:
        length = input_length if name.startswith("encoder") else target_length
        dtype = jnp.float32 if name == "decoder_loss_weights" else jnp.int32
        return jax.ShapeDtypeStruct((batch_size, length), dtype, sharding=step.batch_sharding)

    return {name: one(name) for name in FEATURES}


def sharded_step(
    config: LongT5Config,
    plan: MeshConfig,
    step_cfg: StepConfig | None = None,
    optimizer: optax.GradientTransformation | None = None,
    devices: list | None = None,
) -> ShardedStep:
    """The train step of `config` laid out per `plan` (AdamW unless told otherwise)."""
    model = LongT5(config, pipeline=plan.pipeline_plan())
    return ShardedStep(
        model,
        step_cfg or StepConfig(),
        optimizer or optax.adamw(1e-3),
        make_mesh(plan, devices),
        plan,
    )


def compile_step(step: ShardedStep, batch_size: int, input_length: int, target_length: int) -> Any:
    """The compiled (`jax.stages.Compiled`) train step for batches of this shape."""
    state = abstract_state(step)
    batch = abstract_batch(step, batch_size, input_length, target_length)
    return step.lower(state, batch).compile()
