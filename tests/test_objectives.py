"""Objectives: span corruption inverts exactly, gap sentences match PEGASUS, sentences split."""

import numpy as np
import pytest

from longt5_jax.data import objectives as obj

# Sentinels above every ordinary id, enough for 16k-token documents (T5's own 100 are not).
SENTINELS = 50_000 - np.arange(1_000, dtype=np.int32)
MASK = 7


def _document(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 32_000, length, dtype=np.int32)


def _sentinel_order(ids: np.ndarray) -> np.ndarray:
    """Index i of each extra_id_i in `ids`, in order of appearance."""
    return 50_000 - ids[ids > 40_000]


# --------------------------------------------------------------------------------------------
# Span corruption.


@pytest.mark.parametrize("length", [1, 2, 5, 100, 16384])
def test_span_corruption_reconstructs_exactly(length):
    for seed in range(4):
        tokens = _document(length, seed)
        inputs, targets = obj.span_corruption(tokens, np.random.default_rng(seed), SENTINELS)
        assert inputs.dtype == targets.dtype == np.int32
        assert inputs.size and targets.size
        np.testing.assert_array_equal(
            obj.reconstruct_from_spans(inputs, targets, SENTINELS), tokens
        )


def test_span_corruption_noise_fraction_is_t5s_rounding():
    for length in range(10, 3000, 97):
        inputs, targets = obj.span_corruption(
            _document(length, length), np.random.default_rng(length), SENTINELS
        )
        noise = targets[targets < 40_000].size
        assert noise == round(length * 0.15)
        assert abs(noise - 0.15 * length) <= 0.5
        assert inputs[inputs < 40_000].size == length - noise


def test_span_corruption_mean_span_length_is_three():
    lengths = []
    for seed in range(200):
        length = int(np.random.default_rng(seed).integers(200, 1200))
        _, targets = obj.span_corruption(
            _document(length, seed), np.random.default_rng(seed), SENTINELS
        )
        bounds = np.flatnonzero(targets > 40_000)
        lengths += list(np.diff(np.append(bounds, targets.size)) - 1)
    lengths = np.array(lengths)
    assert abs(lengths.mean() - 3.0) < 0.05
    assert lengths.min() >= 1 and lengths.std() > 1.0  # random partitions, not all 3s


def test_span_corruption_sentinels_in_order_and_paired():
    tokens = _document(1000, 0)
    inputs, targets = obj.span_corruption(tokens, np.random.default_rng(1), SENTINELS)
    num_spans = obj.noise_span_counts(1000)[1]
    np.testing.assert_array_equal(_sentinel_order(inputs), np.arange(num_spans))
    np.testing.assert_array_equal(_sentinel_order(targets), np.arange(num_spans))
    assert targets[0] == SENTINELS[0]  # targets open with extra_id_0
    assert inputs[-1] == SENTINELS[num_spans - 1]  # T5's last span is noise


def test_span_corruption_is_deterministic_per_seed():
    tokens = _document(1000, 0)
    a = obj.span_corruption(tokens, np.random.default_rng(5), SENTINELS)
    b = obj.span_corruption(tokens, np.random.default_rng(5), SENTINELS)
    c = obj.span_corruption(tokens, np.random.default_rng(6), SENTINELS)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert a[0].size != c[0].size or not np.array_equal(a[0], c[0])


def test_span_corruption_callable_sentinels_and_edge_cases():
    tokens = _document(300, 0)
    with_array = obj.span_corruption(tokens, np.random.default_rng(2), SENTINELS)
    with_fn = obj.span_corruption(tokens, np.random.default_rng(2), lambda i: 50_000 - i)
    np.testing.assert_array_equal(with_array[0], with_fn[0])
    np.testing.assert_array_equal(with_array[1], with_fn[1])
    one = obj.span_corruption(tokens[:1], np.random.default_rng(0), SENTINELS)
    np.testing.assert_array_equal(one[0], tokens[:1])
    np.testing.assert_array_equal(one[1], SENTINELS[:1])
    empty = obj.span_corruption(tokens[:0], np.random.default_rng(0), SENTINELS)
    assert empty[0].size == empty[1].size == 0


def test_span_corruption_raises_when_sentinels_run_out():
    t5_sentinels = 32099 - np.arange(100, dtype=np.int32)
    limit = obj.max_span_corruption_length(100)
    assert obj.noise_span_counts(limit)[1] == 100 < obj.noise_span_counts(limit + 1)[1]
    obj.span_corruption(_document(limit, 0), np.random.default_rng(0), t5_sentinels)
    with pytest.raises(ValueError, match="sentinels"):
        obj.span_corruption(_document(limit + 1, 0), np.random.default_rng(0), t5_sentinels)


# --------------------------------------------------------------------------------------------
# Gap sentences.


def _sentences(n: int, seed: int, vocab: int = 200) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 100 + vocab, rng.integers(5, 40), dtype=np.int32) for _ in range(n)]


def _decode(sentences, inputs, targets):
    """(masked, chosen) sentence indices, asserting inputs/targets are built from `sentences`."""
    masked, chosen, pos, tpos = [], [], 0, 0
    for i, s in enumerate(sentences):
        if inputs[pos] == MASK:
            masked.append(i)
            pos += 1
        else:
            np.testing.assert_array_equal(inputs[pos : pos + s.size], s)
            pos += s.size
        if i in masked or np.array_equal(targets[tpos : tpos + s.size], s):
            np.testing.assert_array_equal(targets[tpos : tpos + s.size], s)
            chosen.append(i)
            tpos += s.size
    assert pos == inputs.size and tpos == targets.size
    return masked, chosen


def _brute_force(sentences, k, greedy):
    """Reference selection written with rouge1_f on concatenated sentences."""
    chosen = []
    for _ in range(k if greedy else 1):
        scores = []
        for i in range(len(sentences)):
            candidate = [*chosen, i] if greedy else [i]
            rest = [s for j, s in enumerate(sentences) if j not in candidate]
            picked = np.concatenate([sentences[j] for j in candidate])
            scores.append(-1.0 if i in chosen else obj.rouge1_f(picked, np.concatenate(rest)))
        if not greedy:
            return sorted(np.lexsort((-np.arange(len(scores)), -np.array(scores)))[:k])
        chosen.append(len(scores) - 1 - int(np.argmax(scores[::-1])))
    return sorted(chosen)


def test_gap_sentences_chooses_a_fifth_and_masks_with_one_token():
    sentences = _sentences(50, 0)
    for seed in range(20):
        inputs, targets = obj.gap_sentences(
            sentences, np.random.default_rng(seed), MASK, dynamic_mask_min_ratio=1.0
        )
        masked, chosen = _decode(sentences, inputs, targets)
        assert len(chosen) == 10 and set(masked) <= set(chosen)
        assert np.count_nonzero(inputs == MASK) == len(masked)


def test_gap_sentences_dynamic_ratio_and_intact_fraction():
    sentences = _sentences(100, 1)
    counts, intact = [], 0
    for seed in range(400):
        inputs, targets = obj.gap_sentences(sentences, np.random.default_rng(seed), MASK)
        masked, chosen = _decode(sentences, inputs, targets)
        counts.append(len(chosen))
        intact += len(chosen) - len(masked)
    # k = int(100 * 0.2 * U(0.33, 1)) lies in 6..20 with mean 12.8 (standard error 0.2 here).
    assert min(counts) >= 6 and max(counts) <= 20 and len(set(counts)) > 10
    assert 12.1 < np.mean(counts) < 13.5
    assert 0.08 < intact / sum(counts) < 0.12  # 10% left in place, standard error 0.004


@pytest.mark.parametrize("strategy", ["dynamic_rouge", "greedy_rouge"])
def test_gap_sentences_picks_the_obvious_sentence(strategy):
    sentences = [
        np.array([1, 2, 3, 4]),
        np.array([10, 11, 12, 13, 14]),  # shares five unigrams with sentences 2 and 3
        np.array([10, 11, 12, 20]),
        np.array([13, 14, 21]),
        np.array([5, 6, 8]),
    ]
    for seed in range(10):
        inputs, targets = obj.gap_sentences(
            sentences, np.random.default_rng(seed), 0, rouge_noise_ratio=0.0, strategy=strategy
        )
        np.testing.assert_array_equal(targets, sentences[1])
        assert inputs.size in (15, 19)  # 19 tokens, minus sentence 1 plus one mask if masked


@pytest.mark.parametrize("greedy", [False, True])
def test_gap_sentences_selection_matches_brute_force(greedy):
    strategy = "greedy_rouge" if greedy else "dynamic_rouge"
    for seed in range(4):
        sentences = _sentences(25, seed, vocab=30)
        expected = _brute_force(sentences, 5, greedy)
        _, targets = obj.gap_sentences(
            sentences,
            np.random.default_rng(seed),
            MASK,
            rouge_noise_ratio=0.0,
            dynamic_mask_min_ratio=1.0,
            strategy=strategy,
        )
        np.testing.assert_array_equal(targets, np.concatenate([sentences[i] for i in expected]))


def test_gap_sentences_rouge_noise_changes_the_choice():
    sentences = _sentences(100, 3, vocab=40)  # many near-equal scores

    def targets(seed, noise):
        rng = np.random.default_rng(seed)
        return obj.gap_sentences(sentences, rng, MASK, 0.2, noise, 1.0, 1.0)[1].tobytes()

    assert len({targets(seed, 0.0) for seed in range(8)}) == 1
    assert len({targets(seed, 0.2) for seed in range(8)}) > 1


def test_gap_sentences_edge_cases():
    one = [np.array([4, 5, 6])]
    inputs, targets = obj.gap_sentences(one, np.random.default_rng(0), MASK)
    np.testing.assert_array_equal(targets, one[0])
    assert inputs.tolist() in ([MASK], [4, 5, 6])
    inputs, targets = obj.gap_sentences([np.array([], np.int32)], np.random.default_rng(0), MASK)
    assert inputs.size == targets.size == 0
    with_empty = [np.array([4, 5]), np.array([], np.int32), np.array([4, 6])]
    inputs, targets = obj.gap_sentences(with_empty, np.random.default_rng(0), MASK, 0.5, 0, 1)
    assert targets.size == 2 and inputs.size == 3
    with pytest.raises(ValueError, match="strategy"):
        obj.gap_sentences(one, np.random.default_rng(0), MASK, strategy="lead")


def test_rouge1_f():
    assert obj.rouge1_f(np.array([1, 1, 2]), np.array([1, 2, 2, 3])) == pytest.approx(4 / 7)
    assert obj.rouge1_f(np.array([3, 4]), np.array([4, 3])) == pytest.approx(1.0)
    assert obj.rouge1_f(np.array([3, 4]), np.array([], np.int32)) == 0.0
    assert obj.rouge1_f(np.array([3, 4]), np.array([5])) == 0.0


# --------------------------------------------------------------------------------------------
# Sentence splitting and summarisation.


def test_split_sentences_keeps_abbreviations_and_initials():
    text = (
        "Smith et al. (2019) showed this. See Fig. 2 and Eq. 4 for details. We compare A vs. B "
        "here. Dr. Watson, e.g. Sherlock's friend, agreed, i.e. He nodded. J. R. Smith "
        'disagreed! Was it 3.5 or 4? (We are not sure.) "Quite," he said. It rose by 5. 10 '
        "samples were used. the end. cf. Table 3."
    )
    assert obj.split_sentences(text) == [
        "Smith et al. (2019) showed this.",
        "See Fig. 2 and Eq. 4 for details.",
        "We compare A vs. B here.",
        "Dr. Watson, e.g. Sherlock's friend, agreed, i.e. He nodded.",
        "J. R. Smith disagreed!",
        "Was it 3.5 or 4?",
        "(We are not sure.)",
        '"Quite," he said.',
        "It rose by 5.",
        "10 samples were used. the end. cf. Table 3.",
    ]


def test_split_sentences_at_line_breaks_without_empty_strings():
    text = "Title Line\nFirst sentence here. second stays.\n\n  \nNew paragraph\r\nlast"
    assert obj.split_sentences(text) == [
        "Title Line",
        "First sentence here. second stays.",
        "New paragraph",
        "last",
    ]
    assert obj.split_sentences("") == [] and obj.split_sentences(" \n\t\n") == []


def test_split_sentences_keeps_every_character_in_order():
    text = (
        "Abstract\n\nWe present LongT5, a model that scales both input length and model size "
        "at the same time (cf. Guo et al., 2022).  Specifically, we integrate attention ideas "
        "from long-input transformers (ETC) and adopt pre-training strategies from "
        "summarization pre-training (PEGASUS) into the scalable T5 architecture.\tThe result "
        'is a new attention mechanism we call "Transient Global" (TGlobal)! Does it work? '
        "Yes: ROUGE-1 improves by 2.3 points on arXiv [Table 2]. See Sec. 4.1, e.g. Fig. 3.\r\n"
        "U.S. researchers, i.e. the authors, wrote it in Mountain View, CA. 16k tokens fit."
    )
    sentences = obj.split_sentences(text)
    assert len(sentences) >= 7 and all(s and s == s.strip() for s in sentences)
    assert "".join(" ".join(sentences).split()) == "".join(text.split())
    assert sentences[:2] == ["Abstract", sentences[1]] and sentences[1].endswith("2022).")


def test_summarization_prepends_prefix():
    inputs, targets = obj.summarization(np.array([5, 6]), np.array([7]), np.array([1, 2]))
    assert inputs.tolist() == [1, 2, 5, 6] and targets.tolist() == [7]
    assert inputs.dtype == targets.dtype == np.int32
    assert obj.summarization(np.array([5]), np.array([7]))[0].tolist() == [5]
