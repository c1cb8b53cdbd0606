"""The analytic per-device memory of a train step, calibrated on the compiled GPU program.

    memory = parameters + optimizer state + gradients          (exact, from the rule table)
           + a x stash + b x scores + logits                   (activations)

The stash is what the backward pass needs kept from the forward: every layer's activations
without remat, the layer inputs and the matmul outputs under `save_dots`, the layer inputs alone
under `full` remat. A pipeline stage keeps that for its layers over every row, bubble
iterations included, beside its slots of the rows' ring and the encoder output it reads.
Scores are the attention score elements of the largest layer (local and side keys per encoder
query, self and cross keys per decoder query), which the backward pass of that layer holds at
once in float32 (scores, probabilities and their gradients: `b` bytes each). Logits are float32,
their gradient beside them.

The coefficients (a, b) per remat policy (a pipeline's rows apart: its stages keep their stash
in a loop over iterations, not in the layer scan) are the non-negative pair with the smallest
worst relative error of the whole memory against what XLA's GPU compiler assigns for the
8 x 4 A100-80GB cluster across base, large and xl at 4k-16k inputs, every ZeRO stage and
data / tensor / pipeline layouts: `python -m longt5_jax.bench memory --fit` compiles that grid
and prints them. The structure is the model's; only these two numbers per row come from the fit.
"""

from __future__ import annotations

import dataclasses

from longt5_jax.model import LongT5Config

# (stash scale a, bytes per score element b), from `bench memory --fit` (see the docstring).
CALIBRATION = {
    "none": (1.05, 0.0),
    "save_dots": (0.555, 16.4),
    "full": (1.11, 10.9),
    "pipelined full": (0.89, 6.3),
    "pipelined save_dots": (0.505, 70.8),
}


@dataclasses.dataclass(frozen=True)
class Activations:
    """Activation bytes per device of a layout, before calibration."""

    stash: float
    scores: float  # score elements (not bytes) of the largest layer
    logits: float
    policy: str  # the CALIBRATION row: the remat policy, "pipelined <policy>" for a pipeline

    def bytes(self, calibration: dict[str, tuple[float, float]] = CALIBRATION) -> float:
        # A pipelined policy not in the grid takes the plain policy's row.
        a, b = calibration.get(self.policy) or calibration[self.policy.split()[-1]]
        return a * self.stash + b * self.scores + self.logits


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
    enc_scores = heads * (3 * config.block_len + g) * length
    dec_scores = heads * (target + length) * target
    enc_layers = config.num_encoder_layers / pipeline
    dec_layers = config.num_decoder_layers / pipeline
    logits = rows / pipeline * target * config.vocab_size / t * 12  # a pipeline splits the head
    inputs = b * d * (enc_layers * length + dec_layers * target)  # every layer's input, per row
    policy = f"pipelined {remat}" if pipeline > 1 else remat
    if pipeline > 1:
        micro = rows / microbatches
        # The stage's slots of the rows' ring, and the encoder output every stage reads.
        buffers = b * d * (rows / pipeline * (length + target) + rows * length)
        # Every stage runs all rows through its layers, bubble iterations too.
        rows *= (microbatches * repeats + pipeline - 1) / (microbatches * repeats)
    else:
        micro, buffers = rows, 0.0
    if remat == "full":
        scores = micro * max(enc_scores, dec_scores)
        return Activations(rows * inputs + buffers, scores, logits, policy)
    # Per token of one layer: every activation (none), or the matmul outputs (save_dots).
    enc = b * (10 * d + 4 * hk / t + 4 * f / t) + (8 + b) * heads * (3 * config.block_len + g)
    dec = b * (14 * d + 8 * hk / t + 4 * f / t) + (8 + b) * heads * (target + length)
    if remat == "save_dots":
        enc, dec = b * (4 * d + 3 * hk / t + 2 * f / t), b * (6 * d + 6 * hk / t + 2 * f / t)
    stash = inputs + enc_layers * enc * length + dec_layers * (dec * target + cross_kv)
    scores = 0.0 if remat == "none" else micro * max(enc_scores, dec_scores)
    return Activations(rows * stash + buffers, scores, logits, policy)


def fit(samples: list[tuple[Activations, float, float]]) -> dict[str, tuple[float, float]]:
    """Coefficients per policy from (activations, static bytes, compiled bytes) samples: those
    (a, b >= 0) whose worst relative error on the whole memory is smallest."""
    out = {}
    for policy in sorted({a.policy for a, _, _ in samples}):
        # error_i(a, b) = (a x_i + b y_i + c_i) / compiled_i - 1, affine in (a, b)
        rows = [
            (act.stash / total, act.scores / total, (static + act.logits) / total - 1)
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
