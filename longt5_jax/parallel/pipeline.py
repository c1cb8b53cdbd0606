"""Pipeline parallelism (GPipe, and circular with repeats) over a stage function, under SPMD jit.

A stack of L layers (parameters stacked on a leading axis) is cut into `repeats x stages` chunks
of k = L / (repeats * stages) consecutive layers; chunk c = j * stages + s runs on stage s in
its j-th repeat, so a microbatch visits stages 0..p-1 and then, if repeats > 1, comes round
again. Every iteration all p stages run at once (one `vmap` over the stage axis, sharded over
the mesh axis the logical name `stage` maps to); the activations then shift one stage on (a
roll of a stage-sharded array: a collective-permute). A scan runs the m * r + p - 1 iterations,
so the idle fraction is (p - 1) / (r * m + p - 1). Each iteration is rematerialised: only its
stage inputs are kept for the backward pass, so activation memory does not grow with m.

The layers stay stored in layer order (checkpoints do not depend on the pipeline); with
repeats > 1 a stage's chunks are not contiguous in that order, and XLA moves them into place
with an all-to-all over the stage axis each step (the weights of one stage, never all stages').
Nothing here names a mesh: the stage axis comes from the logical axis rules in force.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

# stage_fn(chunk_params [k, ...], x [mb, ...], per_microbatch slice, shared, chunk, microbatch)
StageFn = Callable[[Any, jax.Array, Any, Any, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    stages: int
    microbatches: int
    repeats: int = 1

    def __post_init__(self):
        for name in ("stages", "microbatches", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"pipeline {name}={getattr(self, name)}: expected >= 1")
        if self.microbatches < self.stages:
            raise ValueError(
                f"pipeline microbatches={self.microbatches} < stages={self.stages}: every stage "
                "needs a microbatch in flight (use microbatches >= stages)"
            )

    def check(self, num_layers: int, what: str) -> int:
        """Layers per chunk for a stack of `num_layers`, or a one-line error."""
        chunks = self.stages * self.repeats
        if num_layers % chunks:
            raise ValueError(
                f"{what}={num_layers} is not divisible by pipeline stages x repeats "
                f"({self.stages} x {self.repeats})"
            )
        return num_layers // chunks

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The schedule's idle fraction: (p - 1) / (r * m + p - 1)."""
        return (self.stages - 1) / self.iterations


def _microbatched(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [m, B/m, ...], microbatch i = rows i, i + m, ...: each keeps its share of
    every data shard, so the batch sharding moves to the microbatch-row axis without traffic."""
    if x.shape[0] % m:
        raise ValueError(f"batch {x.shape[0]} is not divisible by pipeline microbatches={m}")
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _unmicrobatched(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _stage_axis() -> str | tuple[str, ...] | None:
    """The mesh axis (or axes) the logical `stage` axis maps to under the rules in force."""
    spec = nn.logical_to_mesh_axes(("stage",))
    return spec[0] if spec else None


def run(
    cfg: Pipeline,
    stage_fn: StageFn,
    layer_params: Any,
    x: jax.Array,
    axes: tuple[str, ...],
    per_microbatch: Any,
    shared: Any,
) -> jax.Array:
    """The stack's output for `x` [B, ...] (logical `axes`); `per_microbatch` leaves have a
    leading B axis and follow their rows through the stages; `shared` goes to every stage."""
    p, m, r = cfg.stages, cfg.microbatches, cfg.repeats
    num_layers = jax.tree.leaves(layer_params)[0].shape[0]
    k = cfg.check(num_layers, "layers")
    # [L, ...] -> [r, p, k, ...]: chunk (j, s) holds layers (j * p + s) * k ... + k - 1.
    chunks = jax.tree.map(lambda w: w.reshape(r, p, k, *w.shape[1:]), layer_params)
    inputs = _microbatched(x, m)
    # Every stage reads any microbatch's rows: whole over the stage axis, rows over `batch`.
    micro = jax.tree.map(
        lambda a: nn.with_logical_constraint(
            _microbatched(a, m), (None, "batch") + (None,) * (a.ndim - 1)
        ),
        per_microbatch,
    )
    stage_ids = jnp.arange(p)
    axis = _stage_axis()

    def one_stage(stage_params, h, s, t):
        """Stage s at iteration t: its chunk of repeat j on microbatch (t - s) mod m."""
        step = t - s
        j = jnp.clip(step // m, 0, r - 1)
        mb = step % m
        # A select among the r chunks, not a dynamic index: under the stage vmap an index that
        # differs per stage is a gather, whose gradient scatter XLA's GPU compiler rejects
        # (jaxlib 0.10.2: "repeated dimensions in scatter_dims_to_operand_dims").
        params = jax.tree.map(lambda w: jax.lax.select_n(j, *w) if r > 1 else w[0], stage_params)
        rows = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, mb, 0, False), micro)
        return stage_fn(params, h, rows, shared, j * p + s, mb)

    stages = jax.vmap(one_stage, in_axes=(1, 0, 0, None), spmd_axis_name=axis)

    # Only the iteration's stage inputs are saved; the stage recomputes in the backward pass.
    @jax.checkpoint
    def compute(state, t):
        return stages(chunks, state, stage_ids, t)

    def iteration(carry, t):
        state, buffer = carry
        state = nn.with_logical_constraint(state, ("stage", *axes))
        # Stage 0 takes microbatch t mod m: fresh input, or a finished repeat coming round.
        state = state.at[0].set(jax.lax.dynamic_index_in_dim(buffer, t % m, 0, False))
        out = compute(state, t)
        done = t - (p - 1)  # the step the last stage just finished
        slot = jax.lax.dynamic_index_in_dim(buffer, done % m, 0, False)
        buffer = jax.lax.dynamic_update_index_in_dim(
            buffer, jnp.where(done >= 0, out[p - 1], slot), done % m, 0
        )
        buffer = nn.with_logical_constraint(buffer, (None, *axes))
        return (jnp.roll(out, 1, axis=0), buffer), None

    state = jnp.zeros((p, *inputs.shape[1:]), inputs.dtype)
    (_, buffer), _ = jax.lax.scan(iteration, (state, inputs), jnp.arange(cfg.iterations))
    return _unmicrobatched(buffer)
