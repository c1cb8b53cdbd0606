"""THE table from logical axis names (what the model annotates) to mesh axes.

The model names axes `batch, length, embed, heads, kv, mlp, vocab, relpos_buckets, layers`,
and the pipeline `stage`.
One table maps them for every use; ZeRO only decides, per use, whether `embed` (the d_model dim
every weight matrix has) is split over `data`:

    use          ZeRO stage that splits embed over data
    activations  never
    opt_state    >= 1  (each data rank keeps moments for 1/data of every weight)
    grads        >= 2  (gradients are reduce-scattered straight to that layout)
    params       >= 3  (weights too; gathered layer by layer inside the scan)
"""

from __future__ import annotations

from typing import Literal

Use = Literal["activations", "params", "opt_state", "grads"]
_ZERO_FROM = {"activations": 4, "opt_state": 1, "grads": 2, "params": 3}


def rules(
    use: Use, zero_stage: int, sequence_sharding: bool = False, pipelined: bool = False
) -> tuple[tuple[str, str | None], ...]:
    """Flax logical-axis rules for one use of the tree under a ZeRO stage.

    Flax gives each mesh axis to the first rule that claims it within an array, so rows are in
    priority order: with sequence sharding, `length` takes `tensor` only where no heads, MLP or
    vocabulary axis did, i.e. the [batch, length, embed] activations between sublayers
    (Megatron's sequence parallelism).
    """
    zero = zero_stage >= _ZERO_FROM[use]
    sequence = sequence_sharding and use == "activations"
    return (
        ("batch", "data"),  # data parallelism: each data rank holds rows of the batch
        ("heads", "tensor"),  # Megatron: attention heads split over tensor ranks
        ("mlp", "tensor"),  # Megatron: the MLP hidden dim split over tensor ranks
        ("vocab", "tensor"),  # embedding rows and logits columns split over tensor ranks
        ("embed", "data" if zero else None),  # ZeRO: weights/moments split over data ranks
        ("length", "tensor" if sequence else None),  # sequence sharding between sublayers
        # Pipeline: stage s holds layers s*L/p ... (s+1)*L/p - 1 and runs the `stage` slice of
        # the pipelined activations; otherwise stacked layers stay whole.
        ("layers", "pipeline" if pipelined else None),
        ("stage", "pipeline" if pipelined else None),
        ("kv", None),
        ("relpos_buckets", None),
    )
