"""ROUGE as T5X reports it: `rouge-score` per pair, bootstrap-aggregated, F-measure x 100.

As T5's `rouge` metric: no stemming, " . " becomes " .\\n" so that rougeLsum sees sentences, and
the reported value is the bootstrap median of the mean F-measure (with its 95% interval).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def _prepare(summary: str) -> str:
    # rougeLsum splits summaries on newlines; T5X's outputs mark sentence ends with " . ".
    return summary.replace(" . ", " .\n")


def rouge(references: Sequence[str], predictions: Sequence[str], seed: int = 0) -> dict[str, float]:
    """{'rouge1': F x 100, 'rouge1_low': ..., 'rouge1_high': ..., ...} over the pairs."""
    if len(references) != len(predictions):
        raise ValueError(f"{len(references)} references but {len(predictions)} predictions")
    if not references:
        raise ValueError("ROUGE of no examples")
    # rouge-score pulls in nltk and scipy (slow): imported when a score is asked for, so that
    # training without a ROUGE eval and every other command start without it.
    from rouge_score import rouge_scorer, scoring

    scorer = rouge_scorer.RougeScorer(list(KEYS))
    aggregator = scoring.BootstrapAggregator()
    for reference, prediction in zip(references, predictions, strict=True):
        aggregator.add_scores(scorer.score(_prepare(reference), _prepare(prediction)))
    # rouge-score resamples with numpy's global generator: seed it for a reproducible median,
    # and give the caller's generator state back afterwards.
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        result = aggregator.aggregate()
    finally:
        np.random.set_state(saved)
    out = {}
    for key in KEYS:
        out[key] = result[key].mid.fmeasure * 100
        out[f"{key}_low"] = result[key].low.fmeasure * 100
        out[f"{key}_high"] = result[key].high.fmeasure * 100
    return out
