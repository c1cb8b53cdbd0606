"""Pretraining and fine-tuning objectives on token ids: span corruption, gap sentences, summaries.

Every function is pure numpy, deterministic given its `np.random.Generator`, returns int32 arrays
and appends no EOS (batching adds it).
"""

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

SentinelIds = Callable[[int], int] | np.ndarray


# --------------------------------------------------------------------------------------------
# T5 span corruption (t5.data.preprocessors.random_spans_noise_mask and the sentinel helpers).


def noise_span_counts(
    length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """(noise tokens, noise spans) T5 uses for a document of `length` tokens."""
    length = max(length, 2)  # T5 pads to 2 so that one noise and one clean token always exist
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(round(num_noise / mean_noise_span_length), 1)
    # Each span needs at least one token of both kinds; T5 does not clamp and would produce
    # garbage for extreme densities, which the defaults never reach.
    return num_noise, min(num_spans, num_noise, length - num_noise)


def max_span_corruption_length(
    num_sentinels: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> int:
    """Longest document whose noise spans fit in `num_sentinels` sentinels."""
    lo, hi = 1, 1
    while noise_span_counts(hi, noise_density, mean_noise_span_length)[1] <= num_sentinels:
        lo, hi = hi, hi * 2
        if hi > 1 << 40:  # the count never grows (e.g. density 0): any length fits
            return hi
    while hi - lo > 1:  # the span count never decreases with length: bisect
        mid = (lo + hi) // 2
        fits = noise_span_counts(mid, noise_density, mean_noise_span_length)[1] <= num_sentinels
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Uniformly random positive integers, `num_segments` of them, summing to `num_items`."""
    # T5 shuffles a 0/1 "segment starts here" indicator over the num_items - 1 inner positions;
    # drawing the cut positions without replacement is the same distribution.
    cuts = np.sort(rng.choice(num_items - 1, num_segments - 1, replace=False, shuffle=False)) + 1
    return np.diff(np.concatenate([[0], cuts, [num_items]]))


def _noise_mask(
    length: int, rng: np.random.Generator, noise_density: float, mean_noise_span_length: float
) -> np.ndarray:
    """T5's random_spans_noise_mask: alternating clean/noise spans, starting clean."""
    num_noise, num_spans = noise_span_counts(length, noise_density, mean_noise_span_length)
    padded = max(length, 2)
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)
    clean_lengths = _random_segmentation(padded - num_noise, num_spans, rng)
    interleaved = np.stack([clean_lengths, noise_lengths], axis=1).ravel()
    is_noise = np.tile(np.array([False, True]), num_spans)
    return np.repeat(is_noise, interleaved)[:length]


def _sentinel_array(sentinel_ids: SentinelIds, count: int) -> np.ndarray:
    """The first `count` sentinel ids; ValueError if the array holds fewer."""
    if callable(sentinel_ids):
        return np.array([sentinel_ids(i) for i in range(count)], np.int32)
    sentinels = np.asarray(sentinel_ids, np.int32)
    if count > sentinels.size:
        raise ValueError(
            f"span corruption needs {count} sentinels but only {sentinels.size} were given; "
            "shorten the document (see max_span_corruption_length) or pass more sentinel ids"
        )
    return sentinels[:count]


def _collapse_spans(tokens: np.ndarray, mask: np.ndarray, sentinels: np.ndarray) -> np.ndarray:
    """Each run of masked tokens -> the next sentinel (T5's noise_span_to_unique_sentinel)."""
    previous = np.concatenate([[False], mask[:-1]])
    first = mask & ~previous
    out = tokens.copy()
    out[first] = sentinels[: int(first.sum())]
    return out[~(mask & previous)]


def span_corruption(
    tokens: np.ndarray,
    rng: np.random.Generator,
    sentinel_ids: SentinelIds,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
) -> tuple[np.ndarray, np.ndarray]:
    """T5 span corruption: (clean tokens with one sentinel per noise span, sentinel + span each).

    `sentinel_ids[i]` (or `sentinel_ids(i)`) is the id of extra_id_i. Unlike T5, which silently
    runs on into ordinary vocabulary ids after extra_id_99, too few sentinels raise ValueError.
    Edge cases follow T5: an empty document gives two empty arrays; a one-token document is left
    clean, so inputs = [token] and targets = [extra_id_0].
    """
    tokens = np.asarray(tokens, np.int32)
    if tokens.size == 0:
        return tokens.copy(), tokens.copy()
    mask = _noise_mask(tokens.size, rng, noise_density, mean_noise_span_length)
    num_spans = noise_span_counts(tokens.size, noise_density, mean_noise_span_length)[1]
    sentinels = _sentinel_array(sentinel_ids, num_spans)
    return _collapse_spans(tokens, mask, sentinels), _collapse_spans(tokens, ~mask, sentinels)


def reconstruct_from_spans(
    inputs: np.ndarray, targets: np.ndarray, sentinel_ids: np.ndarray
) -> np.ndarray:
    """Invert span_corruption: put each sentinel's target span back in place of the sentinel."""
    inputs, targets = np.asarray(inputs, np.int32), np.asarray(targets, np.int32)
    sentinels = np.asarray(sentinel_ids, np.int32)
    bounds = np.flatnonzero(np.isin(targets, sentinels))
    ends = np.append(bounds[1:], targets.size)
    spans = {int(targets[b]): targets[b + 1 : e] for b, e in zip(bounds, ends, strict=True)}
    pieces: list[np.ndarray] = []
    start = 0
    for pos in np.flatnonzero(np.isin(inputs, sentinels)):
        if int(inputs[pos]) not in spans:
            raise ValueError(f"sentinel {int(inputs[pos])} is in the inputs but not the targets")
        pieces += [inputs[start:pos], spans[int(inputs[pos])]]
        start = int(pos) + 1
    pieces.append(inputs[start:])
    return np.concatenate(pieces).astype(np.int32)


# --------------------------------------------------------------------------------------------
# Sentence splitting for scientific English.

# Case-sensitive: "No." is an abbreviation, "no." usually ends a sentence.
_ABBREVIATION_LIST = (
    "e.g. i.e. al. cf. vs. viz. approx. resp. ca. Fig. Figs. fig. figs. Eq. Eqs. eq. eqs. Eqn. "
    "Eqns. Sec. Secs. Tab. Ref. Refs. Ch. Vol. vol. No. Nos. pp. Thm. Def. Prop. Dr. Mr. Mrs. "
    "Ms. Prof. St. Jr. Sr. Inc. Ltd. Co. Jan. Feb. Aug. Sept. Oct. Nov. Dec."
)
_ABBREVIATIONS = frozenset(_ABBREVIATION_LIST.split())
_INITIALS = re.compile(r"(?:[A-Za-z]\.)+")  # "J.", "U.S.", "e.g."
_OPENERS = "\"'“‘([{"
# A word ending in . ! or ?, optional closing quotes/brackets, then whitespace before a next word.
_CANDIDATE = re.compile(r"(\S*)([.!?])[\"'”’)\]}]*\s+(?=\S)")


def _is_boundary(match: re.Match, next_char: str) -> bool:
    """Whether a candidate match ends a sentence."""
    if not (next_char.isupper() or next_char.isdigit() or next_char in _OPENERS):
        return False
    if match.group(2) != ".":
        return True
    word = (match.group(1) + ".").lstrip(_OPENERS)
    return word not in _ABBREVIATIONS and not _INITIALS.fullmatch(word)


def split_sentences(text: str) -> list[str]:
    """Split at line breaks and after . ! ? before a capital, digit, quote or bracket."""
    # Pieces are contiguous slices of each line with only outer whitespace stripped, so joining
    # them keeps every non-space character of `text`, in order.
    sentences = []
    for line in text.splitlines():
        start = 0
        for match in _CANDIDATE.finditer(line):
            if _is_boundary(match, line[match.end()]):
                sentences.append(line[start : match.end()].strip())
                start = match.end()
        sentences.append(line[start:].strip())
    return [s for s in sentences if s]


# --------------------------------------------------------------------------------------------
# PEGASUS gap-sentence generation (pegasus/ops/sentence_selection.cc, pretrain_parsing_ops.cc).


def _f1(
    overlap: npt.ArrayLike, candidate_len: npt.ArrayLike, reference_len: npt.ArrayLike
) -> np.ndarray:
    """ROUGE-N F1 from clipped overlaps and lengths, with PEGASUS's max(1, length) guards."""
    precision = overlap / np.maximum(candidate_len, 1)
    recall = overlap / np.maximum(reference_len, 1)
    both = (precision > 0) & (recall > 0)
    return np.where(both, 2 * precision * recall / np.where(both, precision + recall, 1), 0.0)


def rouge1_f(a: np.ndarray, b: np.ndarray) -> float:
    """ROUGE-1 F1 of two token-id sequences (unigram counts clipped to the smaller count)."""
    ids_a, counts_a = np.unique(np.asarray(a), return_counts=True)
    ids_b, counts_b = np.unique(np.asarray(b), return_counts=True)
    _, ia, ib = np.intersect1d(ids_a, ids_b, assume_unique=True, return_indices=True)
    overlap = np.minimum(counts_a[ia], counts_b[ib]).sum()
    return float(_f1(np.float64(overlap), np.size(a), np.size(b)))


@dataclass(frozen=True)
class _Unigrams:
    """Sparse sentence-by-unigram counts: one entry per (sentence, distinct token) pair."""

    sentence: np.ndarray  # entry -> sentence index, sorted
    vocab: np.ndarray  # entry -> index into the document's distinct tokens
    count: np.ndarray  # entry -> occurrences of that token in that sentence
    starts: np.ndarray  # sentence i's entries are starts[i]:starts[i + 1]
    totals: np.ndarray  # distinct token -> occurrences in the whole document
    lengths: np.ndarray  # sentence -> tokens

    @classmethod
    def build(cls, sentences: list[np.ndarray]) -> "_Unigrams":
        lengths = np.array([s.size for s in sentences], np.int64)
        sentence_of_token = np.repeat(np.arange(lengths.size), lengths)
        distinct, vocab_of_token = np.unique(np.concatenate(sentences), return_inverse=True)
        keys, count = np.unique(
            sentence_of_token * distinct.size + vocab_of_token, return_counts=True
        )
        sentence = keys // distinct.size
        return cls(
            sentence=sentence,
            vocab=keys % distinct.size,
            count=count,
            starts=np.searchsorted(sentence, np.arange(lengths.size + 1)),
            totals=np.bincount(vocab_of_token, minlength=distinct.size),
            lengths=lengths,
        )


def _rouge_against_rest(ug: _Unigrams) -> np.ndarray:
    """ROUGE-1 F1 of every sentence against the rest of the document."""
    rest = ug.totals[ug.vocab] - ug.count
    overlap = np.bincount(ug.sentence, np.minimum(ug.count, rest), ug.lengths.size)
    return _f1(overlap, ug.lengths, ug.lengths.sum() - ug.lengths)


def _select_dynamic_rouge(
    ug: _Unigrams, k: int, noise_ratio: float, rng: np.random.Generator
) -> np.ndarray:
    """PEGASUS 'dynamic_rouge': top-k sentences by independently scored, noised ROUGE-1."""
    # PEGASUS multiplies each score by 1 + ratio * N(0, ratio), so the relative noise has
    # standard deviation ratio**2 (0.04 for LongT5). Its std::default_random_engine is
    # default-seeded per call, i.e. the same noise for every document; we draw fresh noise.
    scores = _rouge_against_rest(ug)
    scores = scores * (1 + noise_ratio * rng.normal(0.0, noise_ratio, scores.size))
    order = np.lexsort((-np.arange(scores.size), -scores))  # ties: later sentence first, as C++
    return np.sort(order[:k])


def _select_greedy_rouge(ug: _Unigrams, k: int) -> np.ndarray:
    """PEGASUS 'greedy_rouge': k times, add the sentence maximising selected-vs-rest ROUGE-1."""
    n, total_len = ug.lengths.size, ug.lengths.sum()
    selected = np.zeros_like(ug.totals)
    remaining = ug.totals.copy()
    chosen = np.zeros(n, bool)
    selected_len = 0
    for _ in range(k):
        # Adding sentence i changes min(selected, remaining - i) only on i's own tokens, so the
        # overlap of every candidate is the current overlap plus a sparse per-entry delta: one
        # O(document) pass per step instead of O(sentences x vocabulary).
        sel, rem = selected[ug.vocab], remaining[ug.vocab]
        delta = np.minimum(sel + ug.count, rem - ug.count) - np.minimum(sel, rem)
        overlap = np.minimum(selected, remaining).sum() + np.bincount(ug.sentence, delta, n)
        cand_len = selected_len + ug.lengths
        scores = np.where(chosen, -1.0, _f1(overlap, cand_len, total_len - cand_len))
        best = n - 1 - int(np.argmax(scores[::-1]))  # C++ keeps the last maximum (`>=`)
        chosen[best] = True
        entries = slice(ug.starts[best], ug.starts[best + 1])
        selected[ug.vocab[entries]] += ug.count[entries]
        remaining[ug.vocab[entries]] -= ug.count[entries]
        selected_len += ug.lengths[best]
    return np.flatnonzero(chosen)


def gap_sentences(
    sentences: list[np.ndarray],
    rng: np.random.Generator,
    mask_id: int,
    mask_ratio: float = 0.2,
    rouge_noise_ratio: float = 0.2,
    mask_sentence_prob: float = 0.9,
    dynamic_mask_min_ratio: float = 0.33,
    strategy: str = "dynamic_rouge",
) -> tuple[np.ndarray, np.ndarray]:
    """PEGASUS gap sentences: (document with chosen sentences masked, chosen sentences in order).

    Defaults are LongT5's pretraining parser. 'dynamic_rouge' picks the top k sentences by
    noised ROUGE-1 against the rest, with k = int(n * mask_ratio * U(dynamic_mask_min_ratio, 1))
    clamped to [1, n]; 'greedy_rouge' picks k = int(n * mask_ratio) sequentially, ignoring the
    noise and the dynamic ratio, as PEGASUS does. Each chosen sentence becomes one `mask_id` with
    probability `mask_sentence_prob`, else stays intact; targets hold every chosen sentence.
    Empty sentences are dropped first; a one-sentence document is chosen, so it yields
    ([mask_id] or the sentence, the sentence); a document with no tokens gives two empty arrays.
    """
    if strategy not in ("dynamic_rouge", "greedy_rouge"):
        raise ValueError(f"strategy={strategy!r}: expected 'dynamic_rouge' or 'greedy_rouge'")
    sentences = [a for a in (np.asarray(s, np.int32) for s in sentences) if a.size]
    n = len(sentences)
    if n == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    ug = _Unigrams.build(sentences)
    if strategy == "dynamic_rouge":
        ratio = mask_ratio * rng.uniform(dynamic_mask_min_ratio, 1.0)
        k = min(max(int(n * ratio), 1), n)  # PEGASUS truncates, then clamps
        chosen = _select_dynamic_rouge(ug, k, rouge_noise_ratio, rng)
    else:
        chosen = _select_greedy_rouge(ug, min(max(int(n * mask_ratio), 1), n))
    masked = chosen[rng.random(chosen.size) < mask_sentence_prob]
    targets = np.concatenate([sentences[i] for i in chosen])
    mask = np.array([mask_id], np.int32)
    pieces = list(sentences)
    for i in masked:
        pieces[i] = mask
    return np.concatenate(pieces), targets


# --------------------------------------------------------------------------------------------
# Supervised summarisation.


def summarization(
    inputs: np.ndarray, targets: np.ndarray, prefix: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(prefix + inputs, targets) as int32; LongT5 itself uses no prefix."""
    inputs, targets = np.asarray(inputs, np.int32), np.asarray(targets, np.int32)
    if prefix is not None:
        inputs = np.concatenate([np.asarray(prefix, np.int32), inputs])
    return inputs, targets
