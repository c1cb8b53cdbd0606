"""Packed rows (T5X segment ids and positions) equal the same examples run one by one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_params

from longt5_jax.model import LongT5, LongT5Config


def _pack(examples, length):
    ids, seg, pos = (
        np.zeros(length, np.int32),
        np.zeros(length, np.int32),
        np.zeros(length, np.int32),
    )
    i = 0
    for s, x in enumerate(examples, start=1):
        ids[i : i + len(x)], seg[i : i + len(x)], pos[i : i + len(x)] = x, s, np.arange(len(x))
        i += len(x)
    return ids, seg, pos


@pytest.mark.parametrize(
    "attention", [pytest.param("local", marks=pytest.mark.slow), "transient-global"]
)
def test_packed_rows_equal_unpacked_examples(attention):
    # Blocks of 4 tokens for both local and global attention, so segment boundaries fall inside
    # blocks and some segments are shorter than a global block.
    config = LongT5Config.preset("tiny", attention)
    params = random_params(config, seed=3)
    model = LongT5(config)
    rng = np.random.default_rng(0)
    rows = [[(11, 4), (2, 3), (17, 5)], [(9, 6), (22, 2)]]
    length, target_length = 42, 14

    packed = [
        [
            (rng.integers(2, config.vocab_size, n), rng.integers(2, config.vocab_size, t))
            for n, t in row
        ]
        for row in rows
    ]
    enc = np.stack([_pack([x for x, _ in row], length) for row in packed], axis=1)
    dec_inputs = [[np.concatenate([[0], y[:-1]]) for _, y in row] for row in packed]
    dec = np.stack([_pack(row, target_length) for row in dec_inputs], axis=1)
    kwargs = dict(encoder_segment_ids=enc[1], encoder_positions=enc[2], decoder_segment_ids=dec[1])
    apply = jax.jit(model.apply, static_argnames="method")  # op by op: 22 s, jitted 15
    logits = apply({"params": params}, enc[0], None, dec[0], **kwargs)
    encoded = apply(
        {"params": params}, enc[0], segment_ids=enc[1], positions=enc[2], method=LongT5.encode
    )

    @jax.jit
    def alone(x, y):  # one example, unpadded
        mask = jnp.ones_like(x)
        encoded = model.apply({"params": params}, x, mask, method=LongT5.encode)
        return encoded, model.apply({"params": params}, x, mask, y)

    for r, row in enumerate(packed):
        i = j = 0
        for (x, _), y in zip(row, dec_inputs[r], strict=True):
            alone_enc, alone_logits = alone(x[None], y[None])
            np.testing.assert_allclose(
                encoded[r, i : i + len(x)], alone_enc[0], rtol=1e-5, atol=1e-5
            )
            np.testing.assert_allclose(
                logits[r, j : j + len(y)], alone_logits[0], rtol=1e-5, atol=1e-5
            )
            i, j = i + len(x), j + len(y)


def test_half_packed_inputs_are_refused():
    config = LongT5Config.preset("tiny")
    model, params = LongT5(config), random_params(config)
    ids = np.ones((1, 8), np.int32)
    seg, pos = np.ones((1, 8), np.int32), np.arange(8, dtype=np.int32)[None]
    with pytest.raises(ValueError, match="need both encoder_segment_ids and decoder_segment_ids"):
        model.apply(
            {"params": params}, ids, None, ids, encoder_segment_ids=seg, encoder_positions=pos
        )
    with pytest.raises(ValueError, match="encoder_segment_ids given without encoder_positions"):
        model.apply(
            {"params": params}, ids, None, ids, encoder_segment_ids=seg, decoder_segment_ids=seg
        )
