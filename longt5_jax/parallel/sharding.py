"""Shardings for the model's trees from their logical axis names and the rule table."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from longt5_jax.model import long_attention_tiles as tiles
from longt5_jax.parallel.mesh import MeshConfig
from longt5_jax.parallel.rules import Use, rules


def activation_context(mesh: Mesh, plan: MeshConfig) -> contextlib.ExitStack:
    """The mesh and the activation rules; logical constraints are read while tracing, so every
    trace of a sharded function happens inside this."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(tiles.placement(kernel_placement))
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


KeptAxes = Callable[[tuple, tuple, tuple[int, ...]], tuple[int, ...]]


def optimizer_shardings(
    opt_state: Any, params: Any, param_shardings: Any, mesh: Mesh, kept_axes: KeptAxes
) -> Any:
    """Shardings for optimizer state: every params-shaped subtree follows `param_shardings`.

    A leaf keeps the split of each parameter axis it keeps, as the optimizer says:
    `kept_axes(state path, param path, param shape)` (e.g. Adafactor's factored moments keep
    the rows or the columns); a leaf of another shape (a placeholder) is replicated.
    """
    param_def = jax.tree.structure(params)
    param_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def one(state_path, node):
        if jax.tree.structure(node) != param_def:
            return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), node)
        leaves = zip(
            param_paths,
            jax.tree.leaves(node),
            jax.tree.leaves(params),
            jax.tree.leaves(param_shardings),
            strict=True,
        )
        specs = []
        for path, x, p, s in leaves:
            axes = kept_axes(state_path, path, p.shape)
            entries = tuple(s.spec) + (None,) * (p.ndim - len(s.spec))
            if x.shape != tuple(p.shape[a] for a in axes):
                specs.append(PartitionSpec())
            else:
                specs.append(PartitionSpec(*(entries[a] for a in axes)))
        return jax.tree.unflatten(param_def, [NamedSharding(mesh, spec) for spec in specs])

    return jax.tree_util.tree_map_with_path(
        one, opt_state, is_leaf=lambda n: jax.tree.structure(n) == param_def
    )


def placed(shapes: Any, shardings: Any) -> Any:
    """`shapes` as ShapeDtypeStructs laid out per `shardings`: what a restore fills, or what
    a compile ahead of time takes for arrays."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def kernel_placement(fn, arrays: list, axes: list, out_axes) -> jax.Array:
    """fn(*arrays) on each device's own rows and heads: a shard_map over the mesh axes that the
    logical `batch` and `heads` map to under the rules in force, as the model's own constraints
    are placed (the model's kernels call this through `tiles.on_own_rows_and_heads`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(*arrays)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    free = {name for name, size in sizes.items() if size > 1 and name not in mesh.manual_axes}
    # A logical axis is split only over free mesh axes that divide it (the initialiser's one row
    # is not split at all).
    lengths = {"batch": arrays[0].shape[0], "heads": arrays[0].shape[2]}
    split = {}
    for logical, length in lengths.items():
        (entry,) = nn.logical_to_mesh_axes((logical,)) or (None,)
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if names and set(names) <= free and length % math.prod(sizes[n] for n in names) == 0:
            split[logical] = entry
    if not split:
        return fn(*arrays)

    def spec(logical):
        return PartitionSpec(*[split.get(name) for name in logical])

    used = {n for e in split.values() for n in ((e,) if isinstance(e, str) else e)}
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=tuple(spec(a) for a in axes),
        out_specs=spec(out_axes),
        axis_names=used,
        # Interpreted kernels (CPU) mix program ids, which vary over no axis, with the rows.
        check_vma=False,
    )(*arrays)
