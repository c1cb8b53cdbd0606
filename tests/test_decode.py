"""Decoding: cached vs uncached, greedy and beam search vs transformers' generate, sampling
filters vs transformers' warpers, and sharded vs one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import padded_batch, random_params, torch_model

from longt5_jax.estimate import decode_bytes, targets
from longt5_jax.infer.decode import (
    DecodeConfig,
    beam_search,
    filter_logits,
    generate,
    greedy_decode,
)
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


@pytest.mark.parametrize(
    "attention", [pytest.param("local", marks=pytest.mark.slow), "transient-global"]
)
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


def test_decoding_with_the_kernels_equals_the_xla_path():
    """The encoder's kernels (interpreted here) encode for decoding as XLA's attention does:
    greedy and beam search give the same tokens and scores (cached steps run XLA's path)."""
    config, params, batch = _setup("transient-global")
    pallas = dataclasses.replace(config, attention_kernel="pallas")
    for cfg in (DecodeConfig(), DecodeConfig(num_beams=3)):
        want, want_scores = generate(
            LongT5(config), params, batch.input_ids, batch.attention_mask, cfg, STEPS
        )
        got, scores = generate(
            LongT5(pallas), params, batch.input_ids, batch.attention_mask, cfg, STEPS
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(cfg))
        # measured: 5.8e-7 greedy, 2.2e-7 with beams
        np.testing.assert_allclose(np.asarray(scores), np.asarray(want_scores), rtol=2e-6)


SETTINGS = [  # (beams, length penalty, early stopping): transformers' default, 'never', 'finished'
    (4, 1.0, "heuristic"),
    (4, 2.0, "never"),
    (3, 0.5, "finished"),
]
HF_EARLY = {"heuristic": False, "finished": True, "never": "never"}


def _hf_beams(config, params, batch, beams, penalty, early):
    out = torch_model(config, params).generate(
        input_ids=torch.tensor(batch.input_ids).long(),
        attention_mask=torch.tensor(batch.attention_mask),
        max_new_tokens=STEPS,
        min_length=0,
        do_sample=False,
        num_beams=beams,
        length_penalty=penalty,
        early_stopping=HF_EARLY[early],
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences.numpy()[:, 1:]  # drop the decoder start token
    tokens = np.pad(tokens, [(0, 0), (0, STEPS - tokens.shape[1])], constant_values=config.pad_id)
    for row in tokens:  # transformers fills after EOS with EOS; we pad
        eos = np.flatnonzero(row == config.eos_id)
        if eos.size:
            row[eos[0] + 1 :] = config.pad_id
    return tokens, out.sequences_scores.numpy()


@pytest.mark.parametrize(
    "attention", [pytest.param("local", marks=pytest.mark.slow), "transient-global"]
)
def test_beam_search_equals_transformers_generate(attention):
    config, params, batch = _setup(attention)
    model = LongT5(config)
    for beams, penalty, early in SETTINGS:
        cfg = DecodeConfig(num_beams=beams, length_penalty=penalty, early_stopping=early)
        ours, scores = generate(model, params, batch.input_ids, batch.attention_mask, cfg, STEPS)
        theirs, their_scores = _hf_beams(config, params, batch, beams, penalty, early)
        np.testing.assert_array_equal(np.asarray(ours), theirs, err_msg=str(cfg))
        np.testing.assert_allclose(np.asarray(scores), their_scores, rtol=2e-5, err_msg=str(cfg))
    # Row 0 ended at EOS in at least one setting, so finished hypotheses were exercised.
    assert (np.asarray(ours)[0] == config.eos_id).any() or (theirs == config.eos_id).any()


@pytest.mark.slow
def test_beam_search_with_one_beam_equals_greedy():
    config, params, batch = _setup("transient-global")
    model = LongT5(config)
    encoded = model.apply(
        {"params": params}, batch.input_ids, batch.attention_mask, method=LongT5.encode
    )
    one = DecodeConfig(num_beams=1)
    tokens, _ = beam_search(model, params, encoded, batch.attention_mask, one, STEPS)
    greedy = greedy_decode(model, params, batch.input_ids, batch.attention_mask, STEPS)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(greedy))
    assert (np.asarray(greedy)[0] == config.eos_id).any()


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 1.0), (7, 0.5), (0, 0.05)])
def test_top_k_top_p_filters_equal_transformers_warpers(top_k, top_p):
    from transformers.generation import logits_process as lp

    logits = np.random.default_rng(top_k).normal(size=(6, 50)).astype(np.float32) * 3
    ours = np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p))
    scores = torch.tensor(logits)
    if top_k:
        scores = lp.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = lp.TopPLogitsWarper(top_p)(None, scores)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(scores.numpy()))
    np.testing.assert_array_equal(ours[np.isfinite(ours)], logits[np.isfinite(ours)])


def test_tokens_tied_at_the_threshold_are_all_kept():
    # transformers keeps whichever tied tokens its sort puts first; we keep all of them.
    logits = jnp.asarray([[3.0, 2.0, 2.0, 2.0, -1.0]])
    assert np.isfinite(filter_logits(logits, 2, 1.0)).sum() == 4
    assert np.isfinite(filter_logits(logits, 0, 0.6)).sum() == 4  # 3.0 holds < 0.6 of the mass


@pytest.mark.slow
def test_sampling_is_seeded_and_top_k_one_is_greedy():
    config, params, batch = _setup("local")
    model = LongT5(config)
    args = (model, params, batch.input_ids, batch.attention_mask)
    greedy = np.asarray(greedy_decode(*args, STEPS))
    top1 = generate(*args, DecodeConfig(temperature=0.7, top_k=1, seed=3), STEPS)[0]
    np.testing.assert_array_equal(np.asarray(top1), greedy)
    hot = DecodeConfig(temperature=5.0, seed=3)
    first, again = (np.asarray(generate(*args, hot, STEPS)[0]) for _ in range(2))
    other = np.asarray(generate(*args, DecodeConfig(temperature=5.0, seed=4), STEPS)[0])
    np.testing.assert_array_equal(first, again)
    assert (first != greedy).any() and (first != other).any()


@pytest.mark.parametrize("beams", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_decoding_on_a_data_tensor_mesh_equals_one_device(beams):
    from longt5_jax.infer.generator import Generator, param_shardings
    from longt5_jax.parallel.mesh import ParallelConfig, make_mesh

    config, params, _ = _setup("transient-global")
    batch = padded_batch(config, [29, 18, 5, 12], [1] * 4, 29, 1, seed=3)
    cfg = DecodeConfig(num_beams=beams)
    model = LongT5(config)
    single = generate(model, params, batch.input_ids, batch.attention_mask, cfg, STEPS)
    parallel = ParallelConfig(data=4, tensor=2, zero_stage=0)
    mesh = make_mesh(parallel)
    sharded = jax.device_put(params, param_shardings(config, mesh, 0))
    tokens, scores = Generator(model, sharded, mesh, parallel, cfg, STEPS)(
        batch.input_ids, batch.attention_mask
    )
    assert tokens.sharding.spec[0] == "data"
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(single[0]))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(single[1]), rtol=1e-5)


@pytest.mark.slow  # two deviceless GPU compiles of the whole decoding program
@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_beams_read_their_documents_cross_attention_keys_once_a_step():
    """On an H100 (compiled without it): a step with two beams a document moves less than a
    quarter of the documents' cross-attention keys and values more than a step with one. With
    the keys repeated for each beam, the second beam read them all again; with the cache scanned
    through the layers, every step rewrote them too."""
    config = LongT5Config.preset(
        "tiny", "transient-global", dtype="bfloat16", d_model=256, num_heads=4, d_kv=64, d_ff=512
    )
    target = targets.load("h100-80gb")
    one, two = (decode_bytes.measured(config, target, 4, n, 2048, 16) for n in (1, 2))
    assert one.bound.cross == two.bound.cross == 2 * 2 * 4 * 2048 * 4 * 64 * 2
    # Measured: 38.2 MB a step with one beam, 23.4 MB with two; the keys and values are 16.8 MB.
    assert two.step - one.step < one.bound.cross / 4, (one.step, two.step)
    assert one.step < 3 * one.bound.total, (one.step, one.bound)


@pytest.mark.slow  # a deviceless GPU compile of the whole decoding program
@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_a_beam_reorder_rewrites_the_ancestry_table_not_the_cache():
    """On an H100 (compiled without it), 4 beams of 256 tokens, where the self-attention cache
    outweighs the cross-attention keys: a step reads each row's past through the table of the
    rows holding it, within 1.5x of the least a step reads. Reordering the cache itself (a
    gather of all of it each step, then a copy into the loop's buffer) took 3.55x."""
    config = LongT5Config.preset(
        "tiny", "transient-global", dtype="bfloat16", d_model=256, num_heads=4, d_kv=64, d_ff=512
    )
    four = decode_bytes.measured(config, targets.load("h100-80gb"), 4, 4, 512, 256)
    assert four.bound.self_cache == 2 * 2 * 16 * 256 * 4 * 64 * 2 > four.bound.cross
    # Measured: 21.8 MB a step against the bound's 16.5 MB (1.32x).
    assert four.step < 1.5 * four.bound.total, (four.step, four.bound)
