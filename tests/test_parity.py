"""Our LongT5 against transformers' PyTorch LongT5 on the same random weights, in float32."""

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import max_rel, padded_batch, random_params, torch_model

from longt5_jax.formats import hf
from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.model.loss import cross_entropy

# (name, config overrides, input length, target length, input lengths, target lengths)
CASES = [
    ("tiny", {}, 23, 7, [23, 17, 3], [7, 5, 2]),
    ("tiny-long", {}, 61, 9, [61, 50, 33, 4], [9, 9, 3, 1]),
    (
        "tiny-t5-buckets",
        dict(
            local_radius=5,
            global_block_size=8,
            relpos_buckets=32,
            relpos_max_distance=128,
            num_heads=2,
            d_kv=16,
        ),
        45,
        20,
        [45, 40, 7],
        [20, 11, 20],
    ),
    ("shorter-than-a-block", {}, 3, 4, [3, 2], [4, 3]),
]
ATTENTION = ["local", "transient-global"]


def _pairs(cases):
    """(attention, case) pairs; local attention beyond the first case runs in the slow run (the
    default run keeps every TGlobal case and local on the first)."""
    return [
        pytest.param(
            attention,
            case,
            id=f"{case[0]}-{attention}",
            marks=pytest.mark.slow if attention == "local" and case is not cases[0] else (),
        )
        for case in cases
        for attention in ATTENTION
    ]


def _setup(attention, overrides, length, target_length, input_lens, target_lens):
    config = LongT5Config.preset("tiny", attention, **overrides)
    params = random_params(config)
    batch = padded_batch(config, input_lens, target_lens, length, target_length)
    return config, params, batch


def _torch_forward(config, params, batch):
    model = torch_model(config, params)
    labels = np.where(batch.decoder_attention_mask > 0, batch.labels, -100)
    out = model(
        input_ids=torch.tensor(batch.input_ids).long(),
        attention_mask=torch.tensor(batch.attention_mask),
        decoder_input_ids=torch.tensor(batch.decoder_input_ids).long(),
        decoder_attention_mask=torch.tensor(batch.decoder_attention_mask),
        labels=torch.tensor(labels).long(),
    )
    return model, out


def _logits(params, model, batch):
    return model.apply(
        {"params": params},
        batch.input_ids,
        batch.attention_mask,
        batch.decoder_input_ids,
        batch.decoder_attention_mask,
    )


def _loss_of(logits, batch):
    per_token, _ = cross_entropy(logits, jnp.asarray(batch.labels))
    weights = batch.decoder_attention_mask
    return jnp.sum(per_token * weights) / jnp.sum(weights)


def _loss(params, model, batch):
    return _loss_of(_logits(params, model, batch), batch)


@pytest.mark.parametrize("attention, case", _pairs(CASES))
def test_forward_and_loss_match_transformers(attention, case):
    config, params, batch = _setup(attention, *case[1:])
    _, out = _torch_forward(config, params, batch)
    model = LongT5(config)

    # Jitted (op by op, the three took twice as long), as training runs them.
    @jax.jit
    def ours(params, batch):
        encoded = model.apply(
            {"params": params}, batch.input_ids, batch.attention_mask, method=LongT5.encode
        )
        logits = _logits(params, model, batch)
        return encoded, logits, _loss_of(logits, batch)

    encoded, logits, loss = ours(params, batch)
    real = batch.attention_mask.astype(bool)
    abs_err, rel_err = max_rel(encoded, out.encoder_last_hidden_state.detach().numpy(), real)
    print(f"\n{case[0]} {attention}: encoder abs {abs_err:.2e} rel {rel_err:.2e}", end="")
    # Worst of every case, both attentions: encoder abs 3.8e-6 rel 1.1e-6, logits abs 1.2e-5
    # rel 2.7e-6 (tiny-t5-buckets, local), loss abs 9.5e-7 rel 1.4e-7.
    assert abs_err <= 1e-5 and rel_err <= 3e-6

    assert logits.shape == (*batch.decoder_input_ids.shape, config.vocab_size)
    targets = batch.decoder_attention_mask.astype(bool)
    abs_err, rel_err = max_rel(logits, out.logits.detach().numpy(), targets)
    print(f"; logits abs {abs_err:.2e} rel {rel_err:.2e}", end="")
    assert abs_err <= 3e-5 and rel_err <= 1e-5

    abs_err, rel_err = max_rel(loss, out.loss.item())
    print(f"; loss abs {abs_err:.2e} rel {rel_err:.2e}", end="")
    assert abs_err <= 3e-6 and rel_err <= 5e-7


@pytest.mark.parametrize("attention, case", _pairs(CASES[:3]))
def test_gradients_match_transformers(attention, case):
    config, params, batch = _setup(attention, *case[1:])
    torch_model_, out = _torch_forward(config, params, batch)
    out.loss.backward()
    torch_grads = {n: p.grad.numpy() for n, p in torch_model_.named_parameters()}
    ref = flax.traverse_util.flatten_dict(hf.from_hf(config, torch_grads), sep="/")

    model = LongT5(config)
    grads = jax.jit(jax.grad(lambda params, batch: _loss(params, model, batch)))(params, batch)
    ours = flax.traverse_util.flatten_dict(grads, sep="/")
    assert ours.keys() == ref.keys()
    worst = max((max_rel(ours[k], ref[k])[1], k) for k in ours)
    print(f"\n{case[0]} {attention}: worst gradient rel {worst[0]:.2e} ({worst[1]})", end="")
    for k in ours:
        assert np.abs(ref[k]).max() > 0, k  # every parameter takes part in the loss
        # Measured: 1.1e-5 at worst (tiny-t5-buckets TGlobal, encoder/relpos_bias/rel_embedding).
        assert max_rel(ours[k], ref[k])[1] <= 2e-5, k


@pytest.mark.parametrize("attention", ATTENTION)
def test_bfloat16_compute_stays_close(attention):
    config, params, batch = _setup(attention, *CASES[1][1:])
    args = (
        batch.input_ids,
        batch.attention_mask,
        batch.decoder_input_ids,
        batch.decoder_attention_mask,
    )
    f32 = LongT5(config).apply({"params": params}, *args)
    bf16 = LongT5(config.__class__(**{**config.__dict__, "dtype": "bfloat16"})).apply(
        {"params": params}, *args
    )
    assert bf16.dtype == jnp.float32  # the output projection runs in float32
    assert np.isfinite(np.asarray(bf16)).all()
    real = batch.decoder_attention_mask.astype(bool)
    _, rel = max_rel(bf16, f32, real)
    assert rel < 5e-2  # bfloat16 keeps ~3 significant digits through 4 layers: 3.0e-2 measured
