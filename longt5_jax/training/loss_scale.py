"""Dynamic loss scaling, for float16 training.

float16 keeps 5 exponent bits: gradients below 6e-8 flush to zero and activations above 65504
overflow. The loss is multiplied by a large scale before the backward pass, so the float16
cotangents sit in range, and the float32 gradients are divided by it again (folded into the
normalisation by the batch's weight, one multiply). A step whose gradients come out non-finite
was scaled too far: its update is skipped (parameters and optimizer state kept bitwise, so the
learning-rate schedule does not advance either) and the scale halved; after
`StepConfig.loss_scale_period` finite steps in a row the scale doubles. jmp's
`DynamicLossScale` does that arithmetic; the state the run keeps is ours, plain scalars in the
train state, so a checkpoint stores it and a restore on any layout brings it back (replicated,
it has no layout).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import jmp

# jmp's floor: a scale below 1 would shrink gradients, which is never what an overflow needs.
MIN_SCALE = 1.0


@flax.struct.dataclass
class LossScale:
    """The scale and its history: part of the train state, checkpointed with it."""

    scale: jax.Array  # float32: the loss is multiplied by this before the backward pass
    good_steps: jax.Array  # int32: finite steps since the scale last changed (jmp's counter)
    skipped: jax.Array  # int32: steps skipped for non-finite gradients, over the whole run

    @classmethod
    def initial(cls, scale: float) -> LossScale:
        return cls(
            jnp.asarray(scale, jnp.float32),
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.int32),
        )

    def after(self, finite: jax.Array, period: int, factor: int) -> LossScale:
        """The state after a step whose gradients were `finite` (or not): the scale divided by
        `factor` on overflow, multiplied by it after `period` finite steps in a row."""
        dynamic = jmp.DynamicLossScale(
            self.scale, self.good_steps, period, factor, jnp.float32(MIN_SCALE)
        )
        adjusted = dynamic.adjust(finite)
        skipped = self.skipped + jnp.logical_not(finite).astype(jnp.int32)
        return LossScale(adjusted.loss_scale, adjusted.counter.astype(jnp.int32), skipped)

    def at_floor(self) -> jax.Array:
        """Whether the scale can shrink no further: an overflow here is not the scale's doing."""
        return self.scale <= MIN_SCALE
