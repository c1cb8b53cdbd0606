"""Cached greedy decoding against uncached argmax decoding and transformers' generate."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from reference import padded_batch, random_params, torch_model

from longt5_jax.decode import greedy_decode
from longt5_jax.model import LongT5, LongT5Config

STEPS = 9


def _uncached_greedy(model, params, ids, mask, steps):
    """Re-runs the whole decoder on the prefix each step (a fixed-width buffer: causal attention
    makes the positions after the prefix irrelevant to the last real one)."""
    c = model.config
    forward = jax.jit(lambda dec: model.apply({"params": params}, ids, mask, dec))
    dec = np.full((ids.shape[0], steps), c.pad_id, np.int32)
    dec[:, 0] = c.decoder_start_id
    out = np.zeros_like(dec)
    done = np.zeros(ids.shape[0], bool)
    for t in range(steps):
        token = np.asarray(jnp.argmax(forward(dec)[:, t], axis=-1), np.int32)
        out[:, t] = np.where(done, c.pad_id, token)
        done |= out[:, t] == c.eos_id
        if t + 1 < steps:
            dec[:, t + 1] = out[:, t]
    return out


def _setup(attention):
    config = LongT5Config.preset("tiny", attention)
    params = random_params(config, seed=5, noise=0.3)
    batch = padded_batch(config, [29, 18, 5], [1, 1, 1], 29, 1, seed=2)
    first = np.asarray(
        greedy_decode(LongT5(config), params, batch.input_ids, batch.attention_mask, STEPS)
    )
    # Make the token row 0 emits at step 3 the EOS id, so stopping and padding are exercised.
    config = dataclasses.replace(config, eos_id=int(first[0, 3]))
    return config, params, batch


@pytest.mark.parametrize("attention", ["local", "transient-global"])
def test_cached_greedy_equals_uncached_argmax(attention):
    config, params, batch = _setup(attention)
    model = LongT5(config)
    cached = np.asarray(greedy_decode(model, params, batch.input_ids, batch.attention_mask, STEPS))
    uncached = _uncached_greedy(model, params, batch.input_ids, batch.attention_mask, STEPS)
    np.testing.assert_array_equal(cached, uncached)
    eos = np.flatnonzero(cached[0] == config.eos_id)
    assert eos.size and (cached[0, eos[0] + 1 :] == config.pad_id).all()


@pytest.mark.parametrize("attention", ["local", "transient-global"])
def test_greedy_equals_transformers_generate(attention):
    config, params, batch = _setup(attention)
    ours = np.asarray(
        greedy_decode(LongT5(config), params, batch.input_ids, batch.attention_mask, STEPS)
    )
    theirs = (
        torch_model(config, params)
        .generate(
            input_ids=torch.tensor(batch.input_ids).long(),
            attention_mask=torch.tensor(batch.attention_mask),
            max_new_tokens=STEPS,
            min_length=0,
            do_sample=False,
            num_beams=1,
        )
        .numpy()[:, 1:]
    )  # drop the decoder start token
    theirs = np.pad(theirs, [(0, 0), (0, STEPS - theirs.shape[1])], constant_values=config.pad_id)
    np.testing.assert_array_equal(ours, theirs)
