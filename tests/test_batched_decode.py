"""Decoding many documents in batches grouped by length (`infer.batches`): the plan (buckets,
order, padding measured), and the same tokens as decoding each document alone."""

import numpy as np
import pytest
from helpers import random_params

from longt5_jax.data.pipeline import DataConfig
from longt5_jax.infer import batches, evaluation
from longt5_jax.infer.decode import DecodeConfig, generate
from longt5_jax.model import LongT5, LongT5Config

TINY = LongT5Config.preset("tiny", "transient-global")  # blocks of 4 tokens, globals of 4


def test_buckets_follow_the_model_blocks_doubling_up_to_the_input_length():
    assert batches.granularity(TINY) == 4
    assert batches.granularity(LongT5Config()) == 128  # base: blocks of 128, globals of 16
    odd = LongT5Config.preset("tiny", "transient-global", local_radius=5, global_block_size=4)
    assert batches.granularity(odd) == 12  # whole local blocks (6) and whole globals (4)
    assert batches.granularity(LongT5Config.preset("tiny", "local", local_radius=5)) == 6
    assert batches.bucket_lengths(64, 4) == (4, 8, 16, 32, 64)
    assert batches.bucket_lengths(100, 16) == (16, 32, 64, 100)
    assert batches.bucket_lengths(3, 4) == (3,)


def test_a_plan_groups_by_length_and_measures_its_padding():
    lengths = [5, 30, 12, 7, 12]
    plan = batches.by_length(lengths, 2, (8, 16, 32))
    # Longest first, ties in file order; the last batch's second row is empty.
    assert [(b.documents, b.length) for b in plan.batches] == [
        ((1, 2), 32),
        ((4, 3), 16),
        ((0,), 8),
    ]
    # 66 tokens in 2 x (32 + 16 + 8) = 112 positions; in file order at 32: 3 x 2 x 32 = 192.
    assert plan.padding == pytest.approx(1 - 66 / 112)
    assert plan.file_order_padding == pytest.approx(1 - 66 / 192)
    assert plan.summary() == "padding: 41.1% of input positions (file order at full length: 65.6%)"

    with pytest.raises(ValueError, match="document 1 has 30 tokens, more than the longest"):
        batches.by_length(lengths, 2, (8, 16))


def test_every_document_is_decoded_once_in_a_bucket_that_holds_it_and_returned_in_order():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(1, 65, 23)]
    documents = [np.arange(1, n + 1, dtype=np.int32) + 100 * i for i, n in enumerate(lengths)]
    buckets = batches.bucket_lengths(64, 4)
    plan = batches.by_length(lengths, 4, buckets)
    # The same lengths give the same plan: what every process of a multi-host run relies on.
    assert plan == batches.by_length(list(lengths), 4, buckets)
    seen, told = [], []

    def fake_generate(ids, mask):
        """Each row's first token and its length: which document it was, and whole."""
        seen.append(ids.shape)
        assert ((ids > 0) == (mask > 0)).all()
        return np.stack([ids[:, 0], mask.sum(1)], axis=1)

    out = batches.decode(fake_generate, documents, plan, told.append)
    assert [tuple(t) for t in out] == [(100 * i + 1, n) for i, n in enumerate(lengths)]
    assert told == [len(b.documents) for b in plan.batches] and sum(told) == len(lengths)
    assert all(shape[0] == 4 and shape[1] in buckets for shape in seen)
    for b in plan.batches:
        assert max(lengths[i] for i in b.documents) <= b.length
        smaller = [x for x in buckets if x < b.length]
        assert not smaller or max(lengths[i] for i in b.documents) > smaller[-1]
    with pytest.raises(ValueError, match="a plan of 23 documents given 22"):
        batches.decode(fake_generate, documents[:-1], plan)


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=5, noise=0.3)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_grouped_batches_decode_the_same_tokens_as_each_document_alone(params, num_beams):
    """Three documents (27, 6 and 13 tokens) two at a time: [27, 13] padded to 32, then [6] and
    an empty row padded to 8; each against itself at batch 1 and its own length, unpadded.
    Float32 tokens are exact: padded positions are masked out of every softmax (local, side
    keys of TGlobal, cross-attention), and the extra global blocks padding makes belong to
    no segment."""
    model, cfg, steps = LongT5(TINY), DecodeConfig(num_beams=num_beams), 8
    rng = np.random.default_rng(1)
    docs = [np.append(rng.integers(2, TINY.vocab_size, n - 1), TINY.eos_id) for n in (27, 6, 13)]
    examples = [
        evaluation.Example(str(i), d.astype(np.int32), np.zeros(0), "") for i, d in enumerate(docs)
    ]
    data = DataConfig(input_length=32, target_length=steps)

    plan = evaluation.decoding_plan(examples, data, 2, TINY)
    assert [(b.documents, b.length) for b in plan.batches] == [((0, 2), 32), ((1,), 8)]
    grouped = evaluation.predict(
        lambda ids, mask: generate(model, params, ids, mask, cfg, steps)[0],
        examples,
        plan,
    )
    for doc, tokens in zip(docs, grouped, strict=True):
        alone = generate(model, params, doc[None], np.ones((1, len(doc)), np.int32), cfg, steps)
        np.testing.assert_array_equal(tokens, np.asarray(alone[0])[0])
