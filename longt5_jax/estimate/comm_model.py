"""The analytic communication of a train step: bytes per device per step, by kind and mesh axis.

Every term is a ring collective over a buffer the step must move (`hlo.ring_bytes`); the
compiled GPU program is checked against it (`tests/test_gpu_compile.py`, `bench cluster`).

data (size d), once per step:
    gradients: all-reduce, or reduce-scatter where ZeRO-2/3 split them, over d; float32, or
        bfloat16 with `StepConfig.grad_dtype` (a plain step's layer kernels reduce in the
        compute dtype: XLA moves the cast to float32 after the reduction)
    parameters (ZeRO >= 1): the updated float32 weights all-gathered; ZeRO-3 instead gathers
        them before use: once per step with microbatches or a pipeline (the step's region),
        layer by layer for forward and backward otherwise (the embedding for each of its two
        lookups), kernels in the compute dtype
tensor (size t), per microbatch (Megatron): an all-reduce of the [rows, length, embed]
    activations after each sublayer's row-parallel projection, forward and backward, and those
    the recomputed forward repeats (all under full remat, one under save_dots): 2 + 2 (+2 | +1)
    per encoder layer (TGlobal's block sums, which its side keys come from, reduced with them),
    3 + 3 (+3 | +1) per decoder layer; the encoder output's gradient from the cross-attention
    keys and values (once, or per layer without remat); one per embedding lookup
    (vocabulary-parallel) and the LM head's input gradient (float32);
    sequence sharding turns each into a reduce-scatter and an all-gather of the same bytes,
    and with TGlobal regroups the block sums (all-reduce) and the side bias (all-to-all)
pipeline (size p), per microbatch, for each of the two stacks: every iteration the stage
    outputs shift one stage and the rows' ring turns one microbatch, forward and backward; the
    encoder output every decoder stage reads is all-gathered (its gradient reduce-scattered);
    gradients of the weights outside the stages are all-reduced over d and p together (under
    ZeRO-2/3 reduce-scattered over both, then gathered over p); a circular schedule moves each
    device's shard of the stage weights stage-major (all-to-all) and of their gradients back.
    The bubble's (p - 1) extra iterations run, and communicate, like the others.
"""

from __future__ import annotations

import collections
import dataclasses

from longt5_jax.estimate.hlo import KINDS, ring_bytes
from longt5_jax.estimate.shapes import ModelShapes
from longt5_jax.parallel.mesh import ParallelConfig
from longt5_jax.parallel.pipeline import Pipeline
from longt5_jax.parallel.rules import Use
from longt5_jax.training.step import StepConfig

Volumes = dict[str, dict[str, float]]  # kind -> mesh axis -> bytes per device per step


@dataclasses.dataclass(frozen=True)
class Layout:
    """A train step's layout, as the model reads it."""

    data: int
    tensor: int
    pipeline: int
    zero_stage: int
    pipeline_microbatches: int
    repeats: int
    microbatches: int  # gradient accumulation
    grad_dtype: str
    sequence_sharding: bool
    batch: int
    length: int
    target: int

    @classmethod
    def of(
        cls,
        parallel: ParallelConfig,
        devices: int,
        step: StepConfig,
        shape: tuple[int, int, int],
    ) -> Layout:
        data, tensor, pipeline = parallel.shape(devices)
        pipe = parallel.pipeline_schedule()
        return cls(
            data,
            tensor,
            pipeline,
            parallel.zero_stage,
            pipe.microbatches if pipe else 0,
            pipe.repeats if pipe else 1,
            step.microbatches,
            step.grad_dtype,
            parallel.sequence_sharding,
            *shape,
        )

    @property
    def region(self) -> bool:
        """Whether the step reduces once from its manual region (`parallel/region.py`)."""
        return self.microbatches > 1 or self.pipeline > 1

    @property
    def sizes(self) -> dict[str, int]:
        return {"data": self.data, "tensor": self.tensor, "pipeline": self.pipeline}


def volumes(shapes: ModelShapes, layout: Layout) -> Volumes:
    """Per-device bytes per step of every collective the layout needs, by kind and axis."""
    out: Volumes = {kind: collections.defaultdict(float) for kind in KINDS}
    _data_parallel(out, shapes, layout)
    _tensor_parallel(out, shapes, layout)
    if layout.pipeline > 1:
        _pipeline(out, shapes, layout)
    return {kind: dict(axes) for kind, axes in out.items()}


def by_kind(v: Volumes) -> dict[str, float]:
    return {kind: sum(axes.values()) for kind, axes in v.items()}


def _add(out: Volumes, kind: str, axis: str, payload: float, size: int) -> None:
    if size > 1 and payload:
        out[kind][axis] += ring_bytes(kind, payload, size)


def _grad_itemsize(s: Layout) -> int:
    return 2 if s.grad_dtype == "bfloat16" else 4


def _data_parallel(out: Volumes, shapes: ModelShapes, s: Layout) -> None:
    compute = shapes.config.compute_dtype.itemsize
    pipelined = s.pipeline > 1
    tp = {"data": 1, "tensor": s.tensor, "pipeline": s.pipeline}
    for leaf in shapes.leaves:
        n = leaf.size / shapes.split(leaf, tp, "params", 0, pipelined)
        itemsize = _grad_itemsize(s)
        if not s.region and s.grad_dtype == "float32" and leaf.matmul_kernel:
            itemsize = compute
        split = s.zero_stage >= 2 and "embed" in leaf.axes
        if pipelined and not leaf.stacked:
            both = s.data * s.pipeline
            # Every stage's rows contributed to it: summed over data and pipeline, whole over
            # pipeline; split over data, it is reduce-scattered over both and each data shard
            # gathered over pipeline (`ShardRegion._reduce`).
            if split and leaf.shape[leaf.axes.index("embed")] % both == 0:
                _add(out, "reduce-scatter", "data+pipeline", n * itemsize, both)
                _add(out, "all-gather", "pipeline", n * itemsize / s.data, s.pipeline)
            else:
                _add(out, "all-reduce", "data+pipeline", n * itemsize, both)
        else:
            kind = "reduce-scatter" if split else "all-reduce"
            _add(out, kind, "data", n * itemsize, s.data)
        if "embed" not in leaf.axes or s.zero_stage == 0:
            continue
        gathers, itemsize = 1, 4
        if s.zero_stage == 3 and not s.region:
            # Gathered where used, in the dtype used (XLA casts before it gathers): each
            # layer's weights for its forward and again for its backward.
            gathers = 2 if leaf.stacked else 1 + (leaf.path == "token_embedder/embedding")
            itemsize = compute if leaf.matmul_kernel else 4
        _add(out, "all-gather", "data", gathers * n * itemsize, s.data)


def _tensor_parallel(out: Volumes, shapes: ModelShapes, s: Layout) -> None:
    c, t = shapes.config, s.tensor
    if t == 1:
        return
    b, d = c.compute_dtype.itemsize, c.d_model
    rows = s.batch / s.data  # per step, over all microbatches
    # All-reduces a layer's recomputed forward repeats: all of its own under full remat (and
    # save_attention, which keeps only what precedes the reduced projections), one under
    # save_dots (the projections' outputs are kept, reduced, for the others).
    remat = "full" if c.remat == "save_attention" else c.remat
    again = {"none": (0, 0), "save_dots": (1, 1), "full": (2, 3)}[remat]
    # Pipelined, a stage runs its layers on every row, bubble iterations included.
    stage = 1.0
    if s.pipeline > 1:
        pipe = Pipeline(s.pipeline, s.pipeline_microbatches, s.repeats)
        stage = pipe.iterations / (pipe.microbatches * pipe.repeats) / s.pipeline
    # TGlobal's side keys and values add none: the gradient of the block sums they are
    # projected from is reduced with the tokens' (`layers.Projection` takes both inputs).
    enc = c.num_encoder_layers * stage * (4 + again[0]) * s.length
    dec = c.num_decoder_layers * stage * (6 + again[1]) * s.target
    # The encoder output's gradient from every decoder layer's cross keys and values: summed
    # over the layers and reduced once, except without remat, where XLA reduces each layer's
    # keys' and values' parts as they come.
    encoded = (2 * c.num_decoder_layers * stage if remat == "none" else 1) * s.length
    layers = rows * d * b * (enc + dec + encoded)
    head = rows / s.pipeline * d * 4 * (s.length + 2 * s.target)  # embeddings, LM head
    if not s.sequence_sharding:
        _add(out, "all-reduce", "tensor", layers + head, t)
        return
    for kind in ("reduce-scatter", "all-gather"):
        _add(out, kind, "tensor", layers + head, t)
    if remat != "full":  # the backward gathers each sublayer's input again (kept split)
        regathered = c.num_encoder_layers * 2 * s.length + c.num_decoder_layers * 3 * s.target
        _add(out, "all-gather", "tensor", rows * d * b * stage * regathered, t)
    # Tokens split over tensor: TGlobal's block sums, and the side bias per token, regroup.
    if c.attention == "transient-global":
        g = s.length // c.global_block_size
        layers, rerun = c.num_encoder_layers * stage, remat != "none"
        _add(out, "all-reduce", "tensor", layers * (2 + rerun) * rows * g * d * 4, t)
        # The side bias comes from one table for the stack: computed once going forward, then
        # again in each layer's recomputation and for each layer's gradient.
        _add(out, "all-to-all", "tensor", (1 + layers * (1 + rerun)) * rows * g * s.length * 4, t)


def _pipeline(out: Volumes, shapes: ModelShapes, s: Layout) -> None:
    c, p = shapes.config, s.pipeline
    pipe = Pipeline(p, s.pipeline_microbatches, s.repeats)
    b, d, m = c.compute_dtype.itemsize, c.d_model, pipe.microbatches
    rows = s.batch / s.data  # per step, over all accumulation microbatches
    owner = (m - p + 1) % m // (m // p)
    moves = pipe.iterations * (2 + (owner != p - 1)) + (p - 1)  # shift, ring, to the ring
    for length in (s.length, s.target):
        microbatch = rows / (m * s.microbatches) * length * d * b
        out["collective-permute"]["pipeline"] += 2 * s.microbatches * moves * microbatch
    # The encoder output, and its gradient, for every decoder stage; the ids and masks each
    # stage reads (segment and block ids of the encoder, the decoder's boolean masks).
    encoded = rows * s.length * d * b
    _add(out, "all-gather", "pipeline", encoded, p)
    _add(out, "reduce-scatter", "pipeline", encoded, p)
    g = s.length // c.global_block_size if c.attention == "transient-global" else 0
    ids = rows * ((1 + bool(g)) * s.length + g) * 4
    _add(out, "all-gather", "pipeline", ids + rows * s.target * (s.target + s.length), p)
    if s.repeats > 1:
        sizes = {"data": s.data, "tensor": s.tensor, "pipeline": p}

        def stage(use: Use) -> float:  # a stage's weights as stored for `use` (ZeRO splits)
            return sum(
                leaf.size / shapes.split(leaf, sizes, use, s.zero_stage, True)
                for leaf in shapes.leaves
                if leaf.stacked
            )

        # The float32 weights go stage-major, their gradients (as reduced) back.
        moved = 4 * stage("params") + _grad_itemsize(s) * stage("grads")
        _add(out, "all-to-all", "pipeline", moved, p)


def compare(
    measured: dict[str, float], model: dict[str, float], floor: float = 0.05
) -> dict[str, tuple[float, float, float | None]]:
    """kind -> (measured, model, measured / model) for the kinds that carry at least `floor`
    of either side's bytes (XLA adds a few small collectives of its own choosing)."""
    total = max(sum(measured.values()), sum(model.values()))
    out = {}
    for kind in KINDS:
        got, want = measured.get(kind, 0.0), model.get(kind, 0.0)
        if max(got, want) >= floor * total:
            out[kind] = (got, want, got / want if want else None)
    return out
