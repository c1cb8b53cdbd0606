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

The coefficients (a, b) per remat policy are fitted, with non-negative least squares on relative
error, to the memory XLA's GPU compiler assigns for the 8 x 4 A100-80GB cluster across base,
large and xl at 4k-16k inputs, every ZeRO stage and data / tensor / pipeline layouts:
`python -m longt5_jax.bench memory --fit` compiles that grid and prints them. The structure is
the model's; only these two numbers per policy come from the fit.
"""

from __future__ import annotations

import dataclasses

from longt5_jax.model import LongT5Config

# (stash scale a, bytes per score element b), from `bench memory --fit` (see the docstring).
CALIBRATION = {
    "none": (1.05, 0.0),
    "save_dots": (0.60, 13.6),
    "full": (1.34, 11.0),
}


@dataclasses.dataclass(frozen=True)
class Activations:
    """Activation bytes per device of a layout, before calibration."""

    stash: float
    scores: float  # score elements (not bytes) of the largest layer
    logits: float
    policy: str  # the CALIBRATION row: the remat policy

    def bytes(self, calibration: dict[str, tuple[float, float]] = CALIBRATION) -> float:
        a, b = calibration[self.policy]
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
        return Activations(rows * inputs + buffers, scores, logits, "full")
    # Per token of one layer: every activation (none), or the matmul outputs (save_dots).
    enc = b * (10 * d + 4 * hk / t + 4 * f / t) + (8 + b) * heads * (3 * config.block_len + g)
    dec = b * (14 * d + 8 * hk / t + 4 * f / t) + (8 + b) * heads * (target + length)
    if remat == "save_dots":
        enc, dec = b * (4 * d + 3 * hk / t + 2 * f / t), b * (6 * d + 6 * hk / t + 2 * f / t)
    stash = inputs + enc_layers * enc * length + dec_layers * (dec * target + cross_kv)
    scores = 0.0 if remat == "none" else micro * max(enc_scores, dec_scores)
    return Activations(rows * stash + buffers, scores, logits, remat)


def fit(samples: list[tuple[Activations, float]]) -> dict[str, tuple[float, float]]:
    """Coefficients per policy from (activations, compiled activation bytes) pairs: least
    squares on relative error with both coefficients kept >= 0."""
    out = {}
    for policy in sorted({a.policy for a, _ in samples}):
        rows = [
            (a.stash / y, a.scores / y, 1 - a.logits / y) for a, y in samples if a.policy == policy
        ]
        out[policy] = _nonnegative_lstsq(rows)
    return out


def _nonnegative_lstsq(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """argmin over a, b >= 0 of sum (a x + b y - z)^2 for rows (x, y, z)."""
    sxx = sum(x * x for x, _, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    sxz = sum(x * z for x, _, z in rows)
    syz = sum(y * z for _, y, z in rows)
    det = sxx * syy - sxy * sxy
    if det > 0:
        a, b = (sxz * syy - syz * sxy) / det, (syz * sxx - sxz * sxy) / det
        if a >= 0 and b >= 0:
            return a, b
    # The best with one coefficient at zero.
    only_a = (max(sxz / sxx, 0.0), 0.0) if sxx else (0.0, 0.0)
    only_b = (0.0, max(syz / syy, 0.0)) if syy else (0.0, 0.0)

    def loss(ab):
        return sum((ab[0] * x + ab[1] * y - z) ** 2 for x, y, z in rows)

    return min(only_a, only_b, key=loss)
