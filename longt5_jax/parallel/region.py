"""The step's per-shard region: loss and gradients computed on each shard's own rows, reduced once.

Under GSPMD's automatic partitioning, a loop over microbatches (gradient accumulation, pipeline
iterations) that differentiates data-replicated weights reduces their gradients over `data`
inside every iteration, and reshuffles rows between devices. Here the step instead runs its
loss and gradients in a `shard_map` that is manual over `data` (and `pipeline`, when
pipelining): each device differentiates its own copy of the parameters on its own rows, so no
reduction is inserted, accumulates them unreduced, and reduces once at the end, straight into
the ZeRO layout (all-reduce, or reduce-scatter where gradients are split over `data`); the
statistics are summed likewise. Tensor parallelism stays automatic inside.

Parameters enter whole over `data` (ZeRO-3's shards are gathered once, at entry, for the whole
step) and, when pipelining, split over `pipeline` as the pipeline holds them: each stage its own
layers, in stage-major order (`pipeline.stage_major`). Batch rows are split over `data` and,
when pipelining, over `pipeline` too, so the embeddings, the LM head and the loss run on 1/p of
the rows on each stage instead of all of them on every stage.

Inside, the logical rules map nothing to a manual axis (a constraint naming one would be an
error). Every shard reads the step's dropout key as it is: a row's masks come from the row's
global index, which the batch carries (`row_ids`), so they do not depend on the shard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from longt5_jax.parallel import pipeline as pp

DATA, PIPELINE = "data", "pipeline"
Rule = tuple[str, str | tuple[str, ...] | None]  # a logical axis and the mesh axes it takes


def _only(spec: PartitionSpec, axes: tuple[str, ...]) -> PartitionSpec:
    """`spec` with every mesh axis but `axes` dropped."""

    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n in axes)
        return kept[0] if len(kept) == 1 else (kept or None)

    return PartitionSpec(*(keep(e) for e in spec))


def _axis_of(spec: PartitionSpec, axis: str) -> int | None:
    """The dimension `spec` splits over `axis`, if any."""
    for dim, entry in enumerate(spec):
        if entry == axis or (isinstance(entry, tuple) and axis in entry):
            return dim
    return None


@dataclasses.dataclass(frozen=True)
class ShardRegion:
    """Runs per-shard loss/gradient functions on a mesh and reduces their results once."""

    mesh: Mesh
    param_shardings: Any
    grad_shardings: Any
    pipeline: pp.Pipeline | None
    reduce_dtype: jnp.dtype = jnp.float32  # bfloat16 halves the bytes of the reduction
    # Whether values inside are typed by the manual axes they vary over (check_vma). Not where
    # the model's Pallas kernels run interpreted (CPU tests): jax's interpreter loops over such
    # values with carries it makes untyped, and fails. Untyped, the region's autodiff is the
    # same device-local one (tested: equal to one device).
    typed: bool = True

    @property
    def manual(self) -> tuple[str, ...]:
        return (DATA, PIPELINE) if self.pipeline else (DATA,)

    def _batch_spec(self) -> PartitionSpec:
        return PartitionSpec(self.manual if self.pipeline else DATA)

    def _param_specs(self) -> Any:
        return jax.tree.map(lambda s: _only(s.spec, (PIPELINE,)), self.param_shardings)

    def _reorder(self, tree: Any, shardings: Any, order: Callable) -> Any:
        """Stacked pipeline layers (those split over the stage axis on their first dimension)
        put in `order` (`pp.stage_major` on the way in, `pp.layer_major` out) for a circular
        schedule; a GPipe one keeps layer order."""
        if not self.pipeline or self.pipeline.repeats == 1:
            return tree

        def one(w, sharding):
            spec = sharding.spec
            if _axis_of(spec, PIPELINE) != 0:
                return w
            chunks = NamedSharding(self.mesh, PartitionSpec(None, spec[0], None, *spec[1:]))
            place = functools.partial(jax.lax.with_sharding_constraint, shardings=chunks)
            return jax.lax.with_sharding_constraint(order(w, self.pipeline, place), sharding)

        return jax.tree.map(one, tree, shardings)

    def _enter(self, params: Any) -> Any:
        return self._reorder(params, self.param_shardings, pp.stage_major)

    def _exit(self, grads: Any) -> Any:
        return self._reorder(grads, self.grad_shardings, pp.layer_major)

    def _inner_rules(self, rules: Sequence[Rule]) -> tuple[Rule, ...]:
        def drop(target: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
            names = target if isinstance(target, tuple) else (target,)
            kept = tuple(n for n in names if n is not None and n not in self.manual)
            return kept[0] if len(kept) == 1 else (kept or None)

        return tuple((name, drop(target)) for name, target in rules)

    def _vary(self, tree: Any, specs: Any) -> Any:
        """Mark each leaf varying over the manual axes it is not split over."""

        def one(x, spec):
            axes = tuple(a for a in self.manual if _axis_of(spec, a) is None)
            return jax.lax.pcast(x, axes, to="varying") if axes else x

        return jax.tree.map(one, tree, specs)

    def _stack_spec(self, spec: PartitionSpec) -> PartitionSpec:
        """The spec of a gradient's per-shard partial sums, stacked on a new leading axis over
        the shards that must add them: `data`, and `pipeline` unless the stages split it."""
        over = self.manual if _axis_of(spec, PIPELINE) is None else (DATA,)
        return PartitionSpec(over if len(over) > 1 else over[0], *spec)

    def grads(
        self,
        fn: Callable[[Any, Any, jax.Array | None, jax.Array | None], tuple[dict, Any]],
        params: Any,
        batch: Any,
        rng: jax.Array | None,
        loss_scale: jax.Array | None = None,
    ) -> tuple[dict, Any]:
        """fn(params, local rows, rng, loss_scale) -> (summed statistics, summed gradients) of
        one shard; returns their sums over the mesh, gradients in the grad layout.

        The gradients leave the region unreduced, each shard's partial sum stacked on a new
        leading axis, and are summed over it outside, where XLA sees every axis: it reduces
        them straight into the grad layout (all-reduce, or reduce-scatter over `data`) without
        regathering their tensor split, as a reduction inside a region manual over `data` only
        would have to.
        """
        param_specs = self._param_specs()
        stack_specs = jax.tree.map(self._stack_spec, param_specs)

        def local(params, batch, rng, loss_scale):
            stats, grads = fn(self._vary(params, param_specs), batch, rng, loss_scale)
            stats = jax.tree.map(lambda s: jax.lax.psum(s, self.manual), stats)
            return stats, jax.tree.map(lambda g: g.astype(self.reduce_dtype)[None], grads)

        region = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(param_specs, self._batch_spec(), PartitionSpec(), PartitionSpec()),
            out_specs=(PartitionSpec(), stack_specs),
            axis_names=set(self.manual),
            check_vma=self.typed,
        )
        with nn.logical_axis_rules(self._inner_rules(nn.get_logical_axis_rules())):
            stats, partial = region(self._enter(params), batch, rng, loss_scale)
        grads = jax.tree.map(self._reduce, partial, self.grad_shardings)
        return stats, self._exit(grads)

    def _reduce(self, partial: jax.Array, want: NamedSharding) -> jax.Array:
        """The stacked partial sums of one gradient, summed into its layout `want`.

        A weight outside the stages that ZeRO splits over `data` is summed over data and
        pipeline but kept whole over pipeline: left to XLA, that is one all-reduce over both
        and a slice, 2 (dp - 1) / dp of its bytes; reduce-scattered over both, then gathered
        over pipeline, it is (dp - 1) / dp + (p - 1) / dp."""
        total = jax.lax.reduce(partial, jnp.zeros((), partial.dtype), jax.lax.add, (0,))
        dim = _axis_of(want.spec, DATA)
        over = partial.shape[0]  # the shards that add it: data, and pipeline unless it splits
        if dim is not None and over > self.mesh.shape[DATA]:
            entry = want.spec[dim]
            names = entry if isinstance(entry, tuple) else (entry,)
            at = names.index(DATA) + 1  # each data shard gathered from its pipeline parts
            names = (*names[:at], PIPELINE, *names[at:])
            if total.shape[dim] % math.prod(self.mesh.shape[n] for n in names) == 0:
                spec = list(want.spec)
                spec[dim] = names
                scattered = NamedSharding(self.mesh, PartitionSpec(*spec))
                total = jax.lax.with_sharding_constraint(total, scattered)
        return jax.lax.with_sharding_constraint(total.astype(jnp.float32), want)

    def stats(self, fn: Callable[[Any, Any], dict], params: Any, batch: Any) -> dict:
        """fn(params, local rows) -> summed statistics of one shard; their sums over the mesh."""
        param_specs = self._param_specs()

        def local(params, batch):
            stats = fn(self._vary(params, param_specs), batch)
            return jax.tree.map(lambda s: jax.lax.psum(s, self.manual), stats)

        region = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(param_specs, self._batch_spec()),
            out_specs=PartitionSpec(),
            axis_names=set(self.manual),
            check_vma=self.typed,
        )
        with nn.logical_axis_rules(self._inner_rules(nn.get_logical_axis_rules())):
            return region(self._enter(params), batch)
