"""Shardings for the model's trees from their logical axis names and the rule table."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jax.tree_util import PyTreeDef

from longt5_jax.errors import ConfigError
from longt5_jax.kernels import interface as kernels
from longt5_jax.kernels import placement
from longt5_jax.parallel.devices import capability
from longt5_jax.parallel.mesh import ParallelConfig
from longt5_jax.parallel.rules import Use, rules


def activation_context(mesh: Mesh, parallel: ParallelConfig) -> contextlib.ExitStack:
    """The mesh and the activation rules; logical constraints are read while tracing, so every
    trace of a sharded function happens inside this."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    interpreted = kernels_interpreted(mesh)
    stack.enter_context(placement.placement(functools.partial(kernel_placement, interpreted)))
    stack.enter_context(
        nn.logical_axis_rules(
            rules(
                "activations",
                parallel.zero_stage,
                parallel.sequence_sharding,
                pipelined=parallel.pipeline > 1,
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
    param_def: PyTreeDef = jax.tree.structure(params)
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


def kernels_interpreted(mesh: Mesh | AbstractMesh) -> bool:
    """Whether Pallas kernels run interpreted on `mesh`: on CPU devices (the tests'); an abstract
    mesh (shardings only) runs nothing."""
    return not isinstance(mesh, AbstractMesh) and mesh.devices.flat[0].platform == "cpu"


def for_devices(model: nn.Module, mesh: Mesh | AbstractMesh) -> nn.Module:
    """`model` with its config made concrete for `mesh`'s devices (`attention_kernel="auto"`:
    the fused kernels on GPUs that run them, a deviceless target's included). An abstract mesh
    (shardings only) runs nothing: the model as it is."""
    if isinstance(mesh, AbstractMesh):
        return model
    device = mesh.devices.flat[0]
    found = capability(device)
    runs = kernels.runs_on(found)
    if model.config.attention_kernel == "pallas" and device.platform == "gpu" and not runs:
        raise ConfigError(
            f"LongT5Config.attention_kernel='pallas': {device.device_kind} (compute capability "
            f"{found}) cannot run the fused kernels (Triton compiles for 8.0 and newer); use "
            "'auto' or 'xla'"
        )
    config = kernels.resolve(model.config, found)
    return model if config is model.config else model.clone(config=config)


def kernel_placement(interpreted: bool, fn, arrays: list, axes: list, out_axes) -> Any:
    """fn(*arrays) on each device's own rows and heads: a shard_map over the mesh axes that the
    logical `batch` and `heads` map to under the rules in force, as the model's own constraints
    are placed (the model's kernels call this through `kernels.placement.on_own_rows_and_heads`). An
    output whose logical axes lack `batch` (a shared table's gradient) is summed over the rows'
    devices. `out_axes`: one output's logical axes, or a tuple of them."""
    mesh = jax.sharding.get_abstract_mesh()
    split = _kernel_split(mesh, arrays[0].shape) if not mesh.empty else {}
    if not split:
        return fn(*arrays)

    def spec(logical):
        return None if logical is None else PartitionSpec(*[split.get(n) for n in logical])

    several = isinstance(out_axes[0], tuple)
    outs = out_axes if several else (out_axes,)
    rows = split.get("batch")
    rows = () if rows is None else ((rows,) if isinstance(rows, str) else tuple(rows))

    def on_shard(*shards):
        got = fn(*shards)
        got = got if several else (got,)
        summed = [
            g if "batch" in a or not rows else jax.lax.psum(g, rows)
            for g, a in zip(got, outs, strict=True)
        ]
        return tuple(summed) if several else summed[0]

    # Manual over every axis the call may take, split or not: an axis left free inside would
    # share a dimension's sharding with manual ones (which Shardy refuses for remat residuals).
    auto = {name for name in mesh.axis_names if name not in mesh.manual_axes}
    # Inside the step's region (accumulation, pipeline stages), already manual over `data`, a
    # typed call would type its remat residuals by every axis they vary over, the region's
    # included, and Shardy refuses a nested region's operands split over its parent's axes
    # (jax 0.10's residual specs); so there the call is untyped, and its outputs are typed by
    # hand as what they are: per-shard values of the region.
    nested = tuple(mesh.manual_axes)
    out = jax.shard_map(
        on_shard,
        mesh=mesh,
        in_specs=tuple(spec(a) for a in axes),
        out_specs=tuple(spec(a) for a in outs) if several else spec(out_axes),
        axis_names=auto,
        # Interpreted (CPU) kernels cannot be typed by manual axes: jax's Pallas interpreter
        # loops over them with carries it makes untyped; compiled ones are.
        check_vma=not interpreted and not nested,
    )(*arrays)
    if not nested:
        return out
    return jax.tree.map(lambda o: jax.lax.pcast(o, nested, to="varying"), out)


def _kernel_split(mesh, rows_shape: tuple[int, ...]) -> dict[str, Any]:
    """The mesh axes each of `batch` and `heads` of a [B, L, H, K] array split over: free axes
    of the mesh that divide it (the initialiser's one row is not split at all)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    free = {name for name, size in sizes.items() if size > 1 and name not in mesh.manual_axes}
    split = {}
    for logical, length in (("batch", rows_shape[0]), ("heads", rows_shape[2])):
        (entry,) = nn.logical_to_mesh_axes((logical,)) or (None,)
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if names and set(names) <= free and length % math.prod(sizes[n] for n in names) == 0:
            split[logical] = entry
    return split
