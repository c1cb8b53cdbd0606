"""ROUGE as T5X aggregates it, against rouge-score's own per-pair values and hand counts."""

import numpy as np
import pytest
from rouge_score import rouge_scorer, scoring

from longt5_jax.infer.rouge import KEYS, rouge

PAIRS = [
    ("the cat sat on the mat .", "the cat on the mat ."),
    ("long inputs need sparse attention . global tokens help .", "global tokens help a lot ."),
    ("we summarise papers .", "we summarise long scientific papers ."),
    ("a b c . d e f .", "d e f . a b c ."),
]


def test_one_pair_is_its_f_measure_counted_by_hand():
    scores = rouge(["the cat sat on the mat"], ["the cat on the mat"])
    # 5 of the 6 reference unigrams, all 5 predicted: F = 2 * 1 * 5/6 / (1 + 5/6).
    assert scores["rouge1"] == pytest.approx(100 * 10 / 11, rel=1e-12)
    # Bigrams: the cat, on the, the mat are shared; 5 in the reference, 4 predicted.
    assert scores["rouge2"] == pytest.approx(100 * 2 * (3 / 4) * (3 / 5) / (3 / 4 + 3 / 5))
    assert scores["rouge1_low"] == scores["rouge1"] == scores["rouge1_high"]


def test_many_pairs_equal_rouge_score_per_pair_values_aggregated():
    scorer = rouge_scorer.RougeScorer(list(KEYS))
    refs, preds = zip(*PAIRS, strict=True)
    ours = rouge(refs, preds)
    for key in KEYS:
        # T5X's sentence marking: " . " ends a line, so rougeLsum sees sentences.
        per_pair = [
            scorer.score(r.replace(" . ", " .\n"), p.replace(" . ", " .\n"))[key].fmeasure
            for r, p in PAIRS
        ]
        assert ours[f"{key}_low"] <= ours[key] <= ours[f"{key}_high"]
        # The bootstrap median of the mean lies near the plain mean of the pairs.
        assert abs(ours[key] - 100 * np.mean(per_pair)) < 100 * np.std(per_pair)
    assert ours["rougeLsum"] != ours["rougeL"]  # sentence splitting took effect
    assert rouge(refs, preds) == ours  # seeded bootstrap: reproducible
    # T5X's aggregation itself: rouge-score's bootstrap over the same pairs and seed.
    aggregator = scoring.BootstrapAggregator()
    for r, p in PAIRS:
        aggregator.add_scores(scorer.score(r.replace(" . ", " .\n"), p.replace(" . ", " .\n")))
    np.random.seed(0)
    theirs = aggregator.aggregate()
    for key in KEYS:
        assert ours[key] == 100 * theirs[key].mid.fmeasure
        assert ours[f"{key}_low"] == 100 * theirs[key].low.fmeasure


def test_rouge_keeps_the_callers_random_state_and_refuses_bad_lists():
    np.random.seed(7)
    expected = np.random.rand()
    np.random.seed(7)
    rouge(["a b"], ["a"])
    assert np.random.rand() == expected
    with pytest.raises(ValueError, match="2 references but 1 predictions"):
        rouge(["a", "b"], ["a"])
