"""Token-level cross-entropy with T5X's z-loss, in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
