"""Test helpers: random tiny models and batches; transformers' LongT5 holding the same weights."""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from longt5_jax.bench.torch_reference import torch_longt5
from longt5_jax.model import LongT5, LongT5Config


def random_params(config: LongT5Config, seed: int = 0, noise: float = 0.1):
    """Initialised params with every leaf perturbed, so norm scales and relpos tables matter."""
    params = _initialised(config, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    # Op by op: jitted, XLA fuses the sum into one multiply-add, and the params move by an ulp.
    return jax.tree.unflatten(
        treedef,
        [x + noise * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)],
    )


# Jitted, one program per config for every seed (op by op, a call took 4-6 s): the same values.
@functools.partial(jax.jit, static_argnums=0)
def _initialised(config: LongT5Config, key: jax.Array):
    ids = jnp.ones((1, 1), jnp.int32)
    return nn.unbox(LongT5(config).init(key, ids, None, ids))["params"]


@flax.struct.dataclass
class Batch:
    input_ids: np.ndarray
    attention_mask: np.ndarray
    decoder_input_ids: np.ndarray
    decoder_attention_mask: np.ndarray
    labels: np.ndarray


def padded_batch(
    config: LongT5Config, input_lens, target_lens, length: int, target_length: int, seed: int = 0
) -> Batch:
    """Right-padded random tokens; decoder inputs are the labels shifted right after start id 0."""
    rng = np.random.default_rng(seed)
    b = len(input_lens)
    mask = (np.arange(length)[None] < np.array(input_lens)[:, None]).astype(np.int32)
    ids = rng.integers(2, config.vocab_size, (b, length)).astype(np.int32) * mask
    dmask = (np.arange(target_length)[None] < np.array(target_lens)[:, None]).astype(np.int32)
    labels = rng.integers(2, config.vocab_size, (b, target_length)).astype(np.int32) * dmask
    dec = np.concatenate([np.zeros((b, 1), np.int32), labels[:, :-1]], axis=1) * dmask
    return Batch(ids, mask, dec, dmask, labels)


def logits(config: LongT5Config, params, batch: Batch) -> np.ndarray:
    """Our model's logits of `batch` (jitted), as numpy."""
    model = LongT5(config)
    return np.asarray(
        jax.jit(model.apply)(
            {"params": params}, batch.input_ids, batch.attention_mask, batch.decoder_input_ids
        )
    )


def torch_model(config: LongT5Config, params):
    """transformers' LongT5ForConditionalGeneration holding exactly `params`, in eval mode."""
    return torch_longt5(config, params)


def max_rel(ours, ref, where=None) -> tuple[float, float]:
    """(max |ours - ref|, that over max |ref|), optionally only where `where` is true."""
    diff, ref = np.abs(np.asarray(ours) - np.asarray(ref)), np.abs(np.asarray(ref))
    if where is not None:
        diff, ref = diff[where], ref[where]
    return float(diff.max()), float(diff.max() / max(ref.max(), 1e-30))
