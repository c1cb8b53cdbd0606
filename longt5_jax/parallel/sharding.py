"""Shardings for the model's trees from their logical axis names and the rule table."""

from __future__ import annotations

import contextlib
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from longt5_jax.parallel.mesh import MeshConfig
from longt5_jax.parallel.rules import Use, rules


def activation_context(mesh: Mesh, plan: MeshConfig) -> contextlib.ExitStack:
    """The mesh and the activation rules; logical constraints are read while tracing, so every
    trace of a sharded function happens inside this."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(
        nn.logical_axis_rules(
            rules(
                "activations",
                plan.zero_stage,
                plan.sequence_sharding,
                pipelined=plan.pipeline > 1,
            )
        )
    )
    return stack


def tree_shardings(boxed: Any, mesh: Mesh, use: Use, zero_stage: int) -> Any:
    """NamedShardings for a tree of logically boxed leaves (e.g. abstract initialised params)."""
    specs = nn.get_partition_spec(boxed)
    pipelined = mesh.shape.get("pipeline", 1) > 1
    return nn.logical_to_mesh_sharding(specs, mesh, rules(use, zero_stage, pipelined=pipelined))


def _reduced_spec(
    shape: tuple[int, ...], param_shape: tuple[int, ...], spec: PartitionSpec
) -> PartitionSpec:
    """The spec of a moment whose dims are a subsequence of its parameter's (factored moments:
    Adafactor keeps [layers, rows] and [layers, cols] for a [layers, rows, cols] kernel)."""
    entries = tuple(spec) + (None,) * (len(param_shape) - len(spec))
    kept, i = [], 0
    for dim, entry in zip(param_shape, entries, strict=True):
        if i < len(shape) and shape[i] == dim:
            kept.append(entry)
            i += 1
    if i != len(shape) or (shape == (1,) and param_shape != (1,)):
        return PartitionSpec()  # a scalar or a placeholder: replicate
    return PartitionSpec(*kept)


def optimizer_shardings(opt_state: Any, params: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for optimizer state: every params-shaped subtree follows `param_shardings`."""
    param_def = jax.tree.structure(params)

    def one(node):
        if jax.tree.structure(node) != param_def:
            return NamedSharding(mesh, PartitionSpec())
        return jax.tree.map(
            lambda x, p, s: NamedSharding(mesh, _reduced_spec(x.shape, p.shape, s.spec)),
            node,
            params,
            param_shardings,
        )

    return jax.tree.map(one, opt_state, is_leaf=lambda n: jax.tree.structure(n) == param_def)
