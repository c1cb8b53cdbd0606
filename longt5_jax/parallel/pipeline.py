"""Pipeline parallelism (GPipe, and circular with repeats) over a stage function, as SPMD code
manual over the stage axis.

A stack of L layers (parameters stacked on a leading axis) is cut into `repeats x stages` chunks
of k = L / (repeats * stages) consecutive layers; chunk c = j * stages + s runs on stage s in
its j-th repeat, so a microbatch visits stages 0..p-1 and then, if repeats > 1, comes round
again. Each device along the stage axis is a stage holding its own chunks. The rows are split
over the stages too: m microbatches of contiguous rows, m/p on each stage, kept in a buffer
that turns by one slot every iteration (a ring shift of one microbatch). Stage 0 reads the slot
in front; the last stage writes each finished microbatch back into that microbatch's own slot,
from where a circular schedule reads it again on its next round. Every iteration all stages run
at once; their outputs move one stage on (a collective-permute). Scans run the r m + p - 1
iterations, so the idle fraction is (p - 1) / (r m + p - 1), one scan per stretch of
iterations in which every stage's chunk is fixed (`_segments`). What a stage keeps for its
backward pass is what its layers' remat policy keeps, as in a stack without a pipeline (a
checkpoint around whole iterations as well would run the layers' forward, and its
tensor-parallel all-reduces, a third time). So per iteration a device sends one microbatch to
the next stage and one to the buffer's ring, and nothing else moves: no weights, no gathers.
Per-microbatch inputs every stage reads (the encoder output, for the decoder) are gathered over
the stages once per call.

Inside a region already manual over the stage axis (the train step's, `parallel/region.py`)
`run` is that code, on the stage's own rows and chunks; called under automatic sharding it opens
the region itself, and with no mesh axis of that name (one device) it runs the same code as a
vmap over stages with that axis name, so the collectives still mean what they say. The layers
stay stored in layer order (checkpoints do not depend on the pipeline); with repeats > 1 a
stage's chunks are not contiguous in that order, and they are put stage-major on the way in
(`stage_major`, an all-to-all over the stage axis per step).
Nothing here names a mesh: the stage axis is the plan's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

# stage_fn(chunk_params [k, ...], x [mb, ...], per_microbatch slice, shared, chunk index); the
# slice keeps per_microbatch's structure (the model's named inputs), its leaves cut to [mb, ...].
StageFn = Callable[[Any, jax.Array, Any, Any, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    stages: int
    microbatches: int
    repeats: int = 1
    axis: str = "pipeline"  # the mesh axis whose devices are the stages

    def __post_init__(self):
        for name in ("stages", "microbatches", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"pipeline {name}={getattr(self, name)}: expected >= 1")
        if self.microbatches % self.stages:
            raise ValueError(
                f"pipeline microbatches={self.microbatches} is not a multiple of stages="
                f"{self.stages}: each stage keeps an equal share of the microbatches"
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

    def chunk_length(self, held_layers: int, what: str) -> int:
        """Layers per chunk, given the stacked layers the caller holds: all of them under
        automatic sharding, one stage's inside a region manual over the stage axis."""
        if _manual(self.axis):
            return held_layers // self.repeats
        return self.check(held_layers, what)

    def run(self, stage_fn: StageFn, layer_params, x, per_microbatch, shared) -> jax.Array:
        """The model's stack runner (`model.stack.StackRunner`): module-level `run`."""
        return run(self, stage_fn, layer_params, x, per_microbatch, shared)

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The schedule's idle fraction: (p - 1) / (r * m + p - 1)."""
        return (self.stages - 1) / self.iterations


def _manual(axis: str) -> bool:
    return axis in jax.sharding.get_abstract_mesh().manual_axes


# place(x): x [a, b, k, ...] split over the stage axis on b. Given, it moves the split from a
# to b before the swap, so the swap and the reshapes around it are local and the move is the
# partitioner's plain resharding of one array (an all-to-all). Left to move the split through
# the swap, jax 0.12's partitioner replicates the array over the stages and slices it.
Place = Callable[[jax.Array], jax.Array]


def stage_major(w: jax.Array, cfg: Pipeline, place: Place | None = None) -> jax.Array:
    """[L, ...] in layer order -> stage s's chunks (repeat 0, 1, ...) contiguous at s r k."""
    return _swap_chunks(w, cfg.repeats, cfg.stages, place)


def layer_major(w: jax.Array, cfg: Pipeline, place: Place | None = None) -> jax.Array:
    """The inverse of `stage_major`."""
    return _swap_chunks(w, cfg.stages, cfg.repeats, place)


def _swap_chunks(w: jax.Array, a: int, b: int, place: Place | None) -> jax.Array:
    """[L, ...] seen as [a, b, k, ...] -> [b, a, k, ...], flattened back."""
    x = w.reshape(a, b, w.shape[0] // (a * b), *w.shape[1:])
    if place is not None:
        x = place(x)
    return x.swapaxes(0, 1).reshape(w.shape)


def _placed_stage_major(cfg: Pipeline) -> Callable[[jax.Array], jax.Array]:
    """`stage_major` under automatic sharding, its gradient `layer_major`, each moving the
    stage split to b before its swap (`Place`). A constraint is its own transpose, so the
    gradient's reorder, which needs the split on the other side of its swap, gets its own."""

    def place(x):
        free = PartitionSpec.UNCONSTRAINED
        spec = PartitionSpec(free, cfg.axis, *(free,) * (x.ndim - 2))
        return jax.lax.with_sharding_constraint(x, spec)

    @jax.custom_vjp
    def order(w):
        return stage_major(w, cfg, place)

    order.defvjp(lambda w: (order(w), None), lambda _, g: (layer_major(g, cfg, place),))
    return order


def _shift(x: jax.Array, axis: str, p: int, by: int) -> jax.Array:
    """Stage q's `x` to stage q + by (cyclic: a full permutation, as a named vmap needs)."""
    return jax.lax.ppermute(x, axis, [(q, (q + by) % p) for q in range(p)])


def _ring(buf: jax.Array, axis: str, p: int, step: int) -> jax.Array:
    """The buffer split over the stages turned by one slot: step -1 brings the next slot to
    the front (each stage passes its first to the previous), +1 the other way."""
    if step < 0:
        return jnp.concatenate([buf[1:], _shift(buf[0], axis, p, -1)[None]])
    return jnp.concatenate([_shift(buf[-1], axis, p, 1)[None], buf[:-1]])


def _segments(cfg: Pipeline) -> list[tuple[int, int, int | None]]:
    """The iterations [start, stop) in runs with the chunk every stage uses: stage s is in
    repeat clip((t - s) // m, 0, r - 1) at iteration t, so all stages are in repeat j from
    j m + p - 1 to (j + 1) m (to the end for the last), and in j - 1 or j for the p - 1
    iterations before (chunk None: each stage selects its own)."""
    p, m, r = cfg.stages, cfg.microbatches, cfg.repeats
    out: list[tuple[int, int, int | None]] = []
    start = 0
    for j in range(r):
        if j:
            out.append((start, j * m + p - 1, None))
            start = j * m + p - 1
        stop = (j + 1) * m if j < r - 1 else cfg.iterations
        out.append((start, stop, j))
        start = stop
    return [seg for seg in out if seg[0] < seg[1]]


def _stages(cfg: Pipeline, stage_fn: StageFn, chunks, x, micro, shared) -> jax.Array:
    """One stage's part, manual over the stage axis: its chunks [r, k, ...], its rows' slots
    x [m/p, mb, ...]; every microbatch's per-microbatch rows [m, mb, ...]. Returns its slots."""
    p, m, r, axis = cfg.stages, cfg.microbatches, cfg.repeats, cfg.axis
    s = jax.lax.axis_index(axis)
    write = (m - p + 1) % m  # where the microbatch the last stage finishes sits in the ring
    owner, slot = write // (m // p), write % (m // p)

    def iteration(chunk, carry, t):
        h, buf = carry
        step = t - s
        j = jnp.clip(step // m, 0, r - 1)
        mb = step % m
        # A chunk fixed for the whole run of iterations is a constant of its loop, which the
        # backward pass reads in place; one selected per iteration would be kept, a copy of
        # the stage's weights each, so only the p - 1 iterations around a repeat's start do.
        params = jax.tree.map(
            lambda w: w[chunk] if chunk is not None else jax.lax.select_n(j, *w), chunks
        )
        rows = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, mb, 0, False), micro)
        out = stage_fn(params, jnp.where(s == 0, buf[0], h), rows, shared, j * p + s)
        last = out if owner == p - 1 else _shift(out, axis, p, owner - (p - 1))
        finished = (s == owner) & (t >= p - 1)
        buf = buf.at[slot].set(jnp.where(finished, last, buf[slot]))
        h = _shift(out, axis, p, 1)  # stage 0 takes its input from the ring instead
        return (h, _ring(buf, axis, p, -1)), None

    carry = (x[0] * 0, x)
    for start, stop, chunk in _segments(cfg):
        carry, _ = jax.lax.scan(functools.partial(iteration, chunk), carry, jnp.arange(start, stop))
    buf = carry[1]
    for _ in range((p - 1) % m):  # after r m + p - 1 turns, slot i sits p - 1 places back
        buf = _ring(buf, axis, p, +1)
    return buf


def _local(cfg, stage_fn, layer_params, x, per_microbatch, shared):
    """The stage's rows [B/p, ...] through the pipeline, on its own chunks."""
    p, m, r = cfg.stages, cfg.microbatches, cfg.repeats
    if x.shape[0] * p % m:
        raise ValueError(f"batch {x.shape[0] * p} is not divisible by pipeline microbatches={m}")
    mb = x.shape[0] * p // m
    chunks = jax.tree.map(lambda w: w.reshape(r, w.shape[0] // r, *w.shape[1:]), layer_params)
    slots = x.reshape(m // p, mb, *x.shape[1:])
    # Every stage reads every microbatch's rows: gathered once, in microbatch order.
    micro = jax.tree.map(
        lambda a: jax.lax.all_gather(a, cfg.axis, tiled=True).reshape(m, mb, *a.shape[1:]),
        per_microbatch,
    )
    out = _stages(cfg, stage_fn, chunks, slots, micro, shared)
    return out.reshape(x.shape)


def run(
    cfg: Pipeline,
    stage_fn: StageFn,
    layer_params: Any,
    x: jax.Array,
    per_microbatch: Any,
    shared: Any,
) -> jax.Array:
    """The stack's output for `x` [B, ...]; `per_microbatch` leaves have a leading B axis and
    follow their rows through the stages; `shared` goes to every stage. Inside a region manual
    over the stage axis, `x`, `per_microbatch` and `layer_params` are the stage's own."""
    local = functools.partial(_local, cfg, stage_fn)
    if _manual(cfg.axis):
        return local(layer_params, x, per_microbatch, shared)
    mesh = jax.sharding.get_abstract_mesh()
    if cfg.axis not in mesh.axis_names:  # no such devices (one device, tests): a named vmap
        params = jax.tree.map(lambda w: stage_major(w, cfg), layer_params)
        p = cfg.stages
        by_stage = functools.partial(
            jax.tree.map, lambda a: a.reshape(p, a.shape[0] // p, *a.shape[1:])
        )
        out = jax.vmap(local, in_axes=(0, 0, 0, None), axis_name=cfg.axis)(
            by_stage(params), by_stage(x), by_stage(per_microbatch), shared
        )
        return out.reshape(x.shape)
    params = layer_params
    if cfg.repeats > 1:  # a GPipe schedule's stage-major order is the layer order
        params = jax.tree.map(_placed_stage_major(cfg), layer_params)
    split = PartitionSpec(cfg.axis)
    region = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(split, split, split, PartitionSpec()),
        out_specs=split,
        axis_names={cfg.axis},
        check_vma=True,
    )
    return region(params, x, per_microbatch, shared)
