"""The analytic per-device memory of a train step, calibrated on the compiled GPU program.

    memory = parameters + optimizer state + gradients          (exact, from the rule table)
           + a x stash + b x scores + logits                   (activations)

The stash is what the backward pass needs kept from the forward: every layer's activations
without remat, the layer inputs and the matmul outputs under `save_dots`, the layer inputs alone
under `full` remat. A pipeline stage keeps that for its layers over every row, bubble
iterations included, beside its slots of the rows' ring and the encoder output it reads.
Scores are the attention score elements of the largest layer (local and side keys per encoder
query, self and cross keys per decoder query), which the backward pass of that layer holds at
once in float32 (scores, probabilities and their gradients: `b` bytes each). The fused kernels
hold no scores: there that term is the largest layer's activations, which remat recomputes for
its backward, and the stash keeps each kernel's output and log-sum-exp where the policy names
them (`save_attention`, `save_dots`). Logits are float32, their gradient beside them.

The coefficients (a, b) per remat policy (a pipeline's rows apart: its stages keep their stash
in a loop over iterations, not in the layer scan) are the non-negative pair with the smallest
worst relative error of the whole memory against what XLA's GPU compiler assigns for the
8 x 4 A100-80GB cluster across base, large and xl at 4k-16k inputs, every ZeRO stage and
data / tensor / pipeline layouts: `python -m longt5_jax.bench memory --fit` compiles that grid
and prints them (`--attention_kernel pallas`: the kernels' grid, the "fused" rows). The
structure is the model's; only these two numbers per row come from the fit.
"""

from __future__ import annotations

import dataclasses

from longt5_jax.model import LongT5Config

# (stash scale a, bytes per score element b), from `bench memory --fit` (see the docstring).
CALIBRATION = {
    "none": (1.048, 0.0),
    "save_dots": (0.552, 10.54),
    "full": (1.401, 8.932),
    "pipelined full": (0.984, 7.621),
    "pipelined save_dots": (0.469, 54.19),
    # With the fused kernels, b is per byte of the layer's activations (`--attention_kernel
    # pallas`).
    "fused none": (1.319, 0.0),
    "fused full": (1.377, 0.178),
    "fused save_attention": (1.139, 0.213),
    "fused save_dots": (0.621, 0.0),
    "fused pipelined full": (1.002, 0.0),
    "fused pipelined save_attention": (1.01, 0.0),
    "fused pipelined save_dots": (0.67, 0.0),
}
# The worst |estimate / compiled - 1| of that fit over each grid (27 compiles with XLA's
# attention, 29 with the kernels) as the pinned jax compiles them: the error a planner's
# estimate carries. Another compiler makes other programs: jax 0.12.0.1's (Python 3.12) are
# mostly smaller, and the same coefficients are further from them (docs/parallelism.md).
WORST_ERROR = {"xla": 0.090, "pallas": 0.191}
CALIBRATED_ON = "0.10.2"  # the jax whose compiles the coefficients were fitted to


@dataclasses.dataclass(frozen=True)
class Activations:
    """Activation bytes per device of a layout, before calibration."""

    stash: float
    # What the backward of the largest layer holds at once beside the stash: with XLA's
    # attention its score elements (`b` bytes each), with the fused kernels (no scores) the
    # bytes of that layer's activations, which remat recomputes.
    transient: float
    logits: float
    policy: str  # the CALIBRATION row: "[fused ][pipelined ]<remat policy>"

    def bytes(self, calibration: dict[str, tuple[float, float]] = CALIBRATION) -> float:
        # A pipelined policy not in the grid takes the plain policy's row.
        a, b = calibration.get(self.policy) or calibration[self.policy.replace("pipelined ", "")]
        return a * self.stash + b * self.transient + self.logits


def activations(
    config: LongT5Config,
    lengths: tuple[int, int],
    rows: float,
    tensor: int,
    pipeline: int = 1,
    microbatches: int = 0,
    repeats: int = 1,
    remat: str = "full",
) -> Activations:
    """The activation terms for `rows` examples per device (tensor / pipeline splits given)."""
    length, target = lengths
    b, t = config.compute_dtype.itemsize, tensor
    d, hk, f = config.d_model, config.num_heads * config.d_kv, config.d_ff
    heads = config.num_heads / t
    g = length // config.global_block_size if config.attention == "transient-global" else 0
    cross_kv = 2 * b * hk / t * length  # one decoder layer's cross keys and values, per row
    enc_keys, dec_keys = 3 * config.block_len + g, target + length  # per query
    enc_layers = config.num_encoder_layers / pipeline
    dec_layers = config.num_decoder_layers / pipeline
    logits = rows / pipeline * target * config.vocab_size / t * 12  # a pipeline splits the head
    inputs = b * d * (enc_layers * length + dec_layers * target)  # every layer's input, per row
    fused = config.attention_kernel == "pallas"
    if not fused and remat == "save_attention":
        remat = "full"  # nothing is named on XLA's path: the same program
    policy = ("fused " if fused else "") + ("pipelined " if pipeline > 1 else "") + remat
    if pipeline > 1:
        micro = rows / microbatches
        # The stage's slots of the rows' ring, and the encoder output every stage reads.
        buffers = b * d * (rows / pipeline * (length + target) + rows * length)
        # Every stage runs all rows through its layers, bubble iterations too.
        rows *= (microbatches * repeats + pipeline - 1) / (microbatches * repeats)
    else:
        micro, buffers = rows, 0.0
    # Per token of one layer: every activation; with XLA's attention its probabilities (float32
    # and the compute dtype) over every key, with the kernels their outputs and log-sum-exps
    # (the decoder's two attentions each).
    if fused:
        out = b * hk / t + 4 * heads
        enc_att, dec_att = out, 2 * out
    else:
        enc_att, dec_att = (8 + b) * heads * enc_keys, (8 + b) * heads * dec_keys
    enc = b * (10 * d + 4 * hk / t + 4 * f / t) + enc_att
    dec = b * (14 * d + 8 * hk / t + 4 * f / t) + dec_att
    if remat == "none":
        transient = 0.0
    elif fused:
        transient = micro * max(enc * length, dec * target + cross_kv)
    else:
        transient = micro * heads * max(enc_keys * length, dec_keys * target)
    if remat in ("full", "save_attention"):
        # Each layer's input; the kernels' outputs too where save_attention names them.
        kept = enc_layers * enc_att * length + dec_layers * dec_att * target
        stash = rows * (inputs + (kept if remat == "save_attention" else 0.0)) + buffers
        return Activations(stash, transient, logits, policy)
    if remat == "save_dots":  # the matmuls' outputs, the kernels' too
        enc = b * (4 * d + 3 * hk / t + 2 * f / t) + (enc_att if fused else 0.0)
        dec = b * (6 * d + 6 * hk / t + 2 * f / t) + (dec_att if fused else 0.0)
    stash = inputs + enc_layers * enc * length + dec_layers * (dec * target + cross_kv)
    return Activations(rows * stash + buffers, transient, logits, policy)


def fit(samples: list[tuple[Activations, float, float]]) -> dict[str, tuple[float, float]]:
    """Coefficients per policy from (activations, static bytes, compiled bytes) samples: those
    (a, b >= 0) whose worst relative error on the whole memory is smallest."""
    out = {}
    for policy in sorted({a.policy for a, _, _ in samples}):
        # error_i(a, b) = (a x_i + b y_i + c_i) / compiled_i - 1, affine in (a, b)
        rows = [
            (act.stash / total, act.transient / total, (static + act.logits) / total - 1)
            for act, static, total in samples
            if act.policy == policy
        ]
        out[policy] = _minimax(rows)
    return out


def _minimax(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """argmin over a, b >= 0 of max |a x + b y + c|: the worst error is convex in (a, b), and so
    is its minimum over b as a function of a, hence a nested ternary search."""

    def worst(a: float, b: float) -> float:
        return max(abs(a * x + b * y + c) for x, y, c in rows)

    def best_b(a: float) -> float:
        return _ternary(lambda b: worst(a, b), _upper(rows, lambda r: r[1]))

    a = _ternary(lambda a: worst(a, best_b(a)), _upper(rows, lambda r: r[0]))
    return a, best_b(a)


def _upper(rows, coordinate) -> float:
    """The search's upper end: beyond it some row's error exceeds 1, worse than a = b = 0 (whose
    worst is at most 1), since the other coefficient only adds."""
    return min(((1 - r[2]) / coordinate(r) for r in rows if coordinate(r) > 0), default=0.0)


def _ternary(f, hi: float, steps: int = 100) -> float:
    lo = 0.0
    for _ in range(steps):
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        lo, hi = (lo, m2) if f(m1) <= f(m2) else (m1, hi)
    return (lo + hi) / 2
