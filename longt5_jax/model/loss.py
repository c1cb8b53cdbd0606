"""The loss and its statistics: token cross-entropy with T5X's z-loss, in float32, summed over
`decoder_loss_weights`. Training (its gradient) and evaluation (its statistics) both read it here.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import jax
import jax.numpy as jnp

from longt5_jax.model.transformer import LongT5

Batch = dict[str, jax.Array]


def cross_entropy(
    logits: jax.Array, targets: jax.Array, z_loss: float = 0.0
) -> tuple[jax.Array, jax.Array]:
    """Per-token (loss, z_loss term), each [B, T]; loss includes z_loss * log(Z)^2.

    The z-loss keeps the softmax normaliser near 1 (T5X uses 1e-4); masking and normalisation
    are the caller's, since they differ between training setups.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    z_term = z_loss * jnp.square(log_z)
    return log_z - target_logit + z_term, z_term


def summed_loss(
    model: LongT5, params: Any, batch: Batch, z_loss: float, rng: jax.Array | None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(summed loss, statistics) of `batch`: the loss with z-loss, and the sums training and
    evaluation both report (loss, z-loss, weight, correct tokens). Dropout when `rng` is set."""
    # `apply` returns the logits alone: only a `mutable` collection adds the variables to it.
    logits = cast(
        jax.Array,
        model.apply(
            {"params": params},
            batch["encoder_input_tokens"],
            None,
            batch["decoder_input_tokens"],
            encoder_segment_ids=batch["encoder_segment_ids"],
            encoder_positions=batch["encoder_positions"],
            decoder_segment_ids=batch["decoder_segment_ids"],
            deterministic=rng is None,
            rngs=None if rng is None else {"dropout": rng},
            row_ids=batch.get("row_ids"),
        ),
    )
    per_token, z_term = cross_entropy(logits, batch["decoder_target_tokens"], z_loss)
    weights = batch["decoder_loss_weights"]
    correct = jnp.argmax(logits, -1) == batch["decoder_target_tokens"]
    stats = {
        "loss_sum": jnp.sum(per_token * weights),
        "z_loss_sum": jnp.sum(z_term * weights),
        "weight": jnp.sum(weights),
        "correct": jnp.sum(correct * weights),
    }
    return stats["loss_sum"], stats


@functools.partial(jax.jit, static_argnames="model")
def eval_stats(model: LongT5, params: Any, batch: Batch) -> dict[str, jax.Array]:
    """Summed loss (no z-loss), weight and correct tokens of `batch`, deterministic."""
    return summed_loss(model, params, batch, 0.0, None)[1]
