"""Layer stacks: copies of a layer as one `nn.scan`, run by a runner a chunk of layers at a time.

The runner is the whole stack by default (`WholeStack`); the pipeline injects another
(`parallel.pipeline.Pipeline`), so the model never imports or branches on it. A chunk runs as a
scan, or unrolled (`LongT5Config.scan_layers=False`); its parameters keep their [layers, ...]
layout either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from longt5_jax.kernels.call import SAVED
from longt5_jax.model.config import LongT5Config


class StackRunner(Protocol):
    """Runs a layer stack a chunk of layers at a time: stage_fn(chunk_params, x, rows, shared,
    chunk index) applies one chunk. `WholeStack` runs every layer as one chunk; the pipeline
    (`parallel.pipeline.Pipeline`) is injected instead, so the model never knows how the stack
    is split.

    `per_microbatch` and `shared` are the layer's other inputs as named pytrees (NamedTuples,
    e.g. `transformer.EncoderRowInputs` and `EncoderSharedInputs`): a runner only maps over
    their leaves, slicing every `per_microbatch` leaf along its leading batch axis to the rows
    it hands `stage_fn` (same structure, same names) and passing `shared` whole.
    """

    def chunk_length(self, held_layers: int, what: str) -> int: ...

    def run(
        self, stage_fn: Callable, layer_params: Any, x: jax.Array, per_microbatch: Any, shared: Any
    ) -> jax.Array: ...


class WholeStack:
    """The default runner: the whole stack as one scan."""

    def chunk_length(self, held_layers: int, what: str) -> int:
        return held_layers

    def run(self, stage_fn, layer_params, x, per_microbatch, shared):
        return stage_fn(layer_params, x, per_microbatch, shared, 0)


# save_attention and save_dots keep what the fused attention kernels' backward reads from their
# forward (`kernels.call.SAVED`), so no kernel's forward runs twice; with XLA's attention nothing
# carries that name, and save_attention is full remat.
_KERNEL_OUTPUTS = jax.checkpoint_policies.save_only_these_names(SAVED)
_REMAT = {
    "full": None,
    "save_attention": _KERNEL_OUTPUTS,
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _KERNEL_OUTPUTS
    ),
}


def scanned(
    layer: type[nn.Module],
    config: LongT5Config,
    num_layers: int,
    in_axes: tuple,
    deterministic: bool,
    name: str | None,
    unrolled: bool | None = None,
    **kwargs,
) -> nn.Module:
    """`num_layers` copies of `layer` as one scan; parameters gain a leading 'layers' axis.
    The scan is unrolled where `unrolled` says so, by default where the config does.

    Every layer reads the same dropout key; its masks differ by the layer's index, its first
    scanned argument, which a chunk of a pipeline knows too (a split key would not be the same
    for a chunk of the stack as for the whole).
    """
    unrolled = not config.scan_layers if unrolled is None else unrolled
    # Unrolled, only prevent_cse keeps XLA from merging a remat's recomputation with the forward.
    if config.remat != "none":
        layer = nn.remat(layer, policy=_REMAT[config.remat], prevent_cse=unrolled)
    scanned = nn.scan(
        layer,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": False},
        in_axes=in_axes,
        length=num_layers,
        unroll=num_layers if unrolled else 1,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    return scanned(config, deterministic, name=name, **kwargs)


def run(
    parent: nn.Module,
    stack: nn.Module,
    layer: type[nn.Module],
    in_axes: tuple,
    runner: StackRunner,
    deterministic: bool,
    call: Any,
    x: jax.Array,
    per_microbatch: Any,
    shared: Any,
) -> jax.Array:
    """`stack` (already holding its [layers, ...] parameters) run by `runner`, a chunk of
    layers at a time.

    `call(apply, h, rows, shared)` applies a chunk of layers to `h` with the layer's arguments
    (after the layer index) read by name from this microbatch's `rows` (`per_microbatch`'s
    structure, its leaves sliced to the microbatch) and the `shared` inputs.
    """
    c, held = parent.config, jax.tree.leaves(stack.variables["params"])[0].shape[0]
    k = runner.chunk_length(held, f"{type(parent).__name__} layers")
    rngs = {} if deterministic else {"dropout": parent.make_rng("dropout")}
    # A layer uses its parameters in the compute dtype only, so with cast_params="once" a chunk
    # casts them once: not again in the forward, the recomputation and the backward, and the
    # backward stacks the layers' gradients in that dtype. A kernel used twice in a layer sums
    # its gradients in float32 itself (`layers.Projection` given several inputs). The cast is
    # inside stage_fn, not before the runner: a pipeline runs a chunk once per microbatch, and
    # its gradients are summed over the microbatches in the parameters' float32 (the cast's
    # transpose), not in bf16. With "at_use" each layer casts where it reads a parameter
    # (`layers.Projection`), so no cast copy of the stack outlives the forward.
    chunk = scanned(layer, c, k, in_axes, deterministic, None, parent=None)
    cast_once = c.cast_params == "once"

    def stage_fn(params, h, rows, shared, index):
        layers = index * k + jnp.arange(k)
        if cast_once:
            params = jax.tree.map(lambda p: p.astype(c.compute_dtype), params)

        def apply(h, *args):
            return chunk.apply({"params": params}, h, layers, *args, rngs=rngs)[0]

        return call(apply, h, rows, shared)

    return runner.run(stage_fn, stack.variables["params"], x, per_microbatch, shared)
