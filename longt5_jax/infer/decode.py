"""Decoding with a key/value cache: greedy, sampling (temperature, top-k, top-p) and beam search.

The encoder runs once per document; the decoder then runs one token per step over its cache
(cross-attention keys and values are filled on the first step and reused). Loops stop as soon as
every row (or every beam search) is done, so short summaries cost short loops.

Letter key: B batch, N beams, K candidates (2N), T decoded length, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from longt5_jax.model import LongT5, LongT5Config, init_cache
from longt5_jax.model.blocks import joined_for_decoding
from longt5_jax.model.cache import reordered, with_ancestry

LOOP = "decode_loop"  # the token loops' name in a compiled program (`estimate.decode_bytes`)
NEG = -1.0e9  # transformers' "never chosen" score, kept so beam scores match it exactly


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How summaries are decoded; the defaults are greedy decoding."""

    max_length: int = 0  # decoded tokens at most; 0 takes DataConfig.target_length
    num_beams: int = 1
    # Beam scores are summed log-probabilities over a length penalty: len**alpha
    # ('transformers') or ((5 + len) / 6)**alpha ('t5x', GNMT's brevity penalty).
    length_penalty: float = 1.0
    length_penalty_style: Literal["transformers", "t5x"] = "transformers"
    # When a beam search ends: 'heuristic' once no live beam can beat the worst finished one at
    # its current length (transformers' early_stopping=False); 'finished' as soon as num_beams
    # hypotheses have ended (True); 'never' only when no live beam can beat them at any length.
    early_stopping: Literal["heuristic", "finished", "never"] = "heuristic"
    temperature: float = 0.0  # 0: argmax; > 0: sample from softmax(logits / temperature)
    top_k: int = 0  # sampling only: keep the k most likely tokens (0: all)
    top_p: float = 1.0  # sampling only: keep the smallest set of tokens with this much mass
    seed: int = 0

    def __post_init__(self):
        if self.num_beams < 1 or self.max_length < 0 or self.top_k < 0:
            raise ValueError(
                f"DecodeConfig num_beams={self.num_beams}, max_length={self.max_length}, "
                f"top_k={self.top_k}: expected num_beams >= 1, max_length >= 0, top_k >= 0"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"DecodeConfig temperature={self.temperature}, top_p={self.top_p}: expected "
                "temperature >= 0 and 0 < top_p <= 1"
            )
        if self.num_beams > 1 and self.temperature > 0:
            raise ValueError(
                "DecodeConfig: sampling (temperature > 0) with num_beams > 1 is not supported"
            )

    def penalty(self, length: jax.Array | int) -> jax.Array:
        """The divisor of a finished hypothesis' summed log-probability at `length` tokens."""
        length = jnp.asarray(length, jnp.float32)
        base = length if self.length_penalty_style == "transformers" else (5.0 + length) / 6.0
        return base**self.length_penalty


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Logits [..., V] with tokens outside the top-k and the top-p nucleus set to -inf.

    As transformers' warpers: top-k first; then the nucleus keeps every token whose probability
    mass above it (in ascending order) is over 1 - top_p, and always the most likely token.
    """
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ascending = jnp.sort(logits, axis=-1)
        mass_below = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        removed = mass_below <= 1.0 - top_p
        removed = removed.at[..., -1].set(False)
        # The smallest logit kept; ties with it are kept too, as the sorted scatter would.
        threshold = jnp.min(jnp.where(removed, jnp.inf, ascending), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


Step = Callable[[jax.Array, Any, int | jax.Array], tuple[jax.Array, Any]]


def _stepper(model: LongT5, params: Any, encoded: jax.Array, mask: jax.Array) -> Step:
    """step(tokens [R], cache, index) -> (float32 logits [R, V], cache) for the R rows.

    The decoder's layers enter the token loop an array a layer (sliced once a call) and are
    stacked again inside it: a step's layers are unrolled, and XLA reads each layer's slice of
    that stack as the layer's own array, where it lies. Sliced from the stack every step, each
    layer's weights were copied every token (XLA:CPU's matmuls and a GPU's alike). The kernels a
    step multiplies by one input are joined first (`blocks.joined_for_decoding`).
    """
    decoder = params["decoder"]
    joined = joined_for_decoding(decoder["layers"])
    layers = [
        jax.tree.map(lambda p, i=i: p[i], joined) for i in range(model.config.num_decoder_layers)
    ]

    def step(tokens, cache, index):
        stacked = jax.tree.map(lambda *each: jnp.stack(each), *layers)
        logits, cache = model.apply(
            {"params": {**params, "decoder": {**decoder, "layers": stacked}}},
            encoded,
            mask,
            tokens[:, None],
            cache=cache,
            cache_index=index,
            method=LongT5.decode,
        )
        return logits[:, -1].astype(jnp.float32), cache

    return step


def _token_loop(cond: Callable, body: Callable, init: Any) -> Any:
    """jax.lax.while_loop named LOOP: a compiled program's step is found by it."""
    with jax.named_scope(LOOP):
        return jax.lax.while_loop(cond, body, init)


def _greedy_or_sample(step: Step, cfg: DecodeConfig, eos: int, pad: int, start, cache, length, rng):
    """[B, length] tokens (pad after EOS) and their summed log-probabilities [B]."""
    b = start.shape[0]

    def pick(logits, i):
        logp = jax.nn.log_softmax(logits)
        if cfg.temperature == 0:
            token = jnp.argmax(logits, axis=-1)
        else:
            warped = filter_logits(logits / cfg.temperature, cfg.top_k, cfg.top_p)
            token = jax.random.categorical(jax.random.fold_in(rng, i), warped)
        token = token.astype(jnp.int32)
        return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]

    def advance(carry, logits, i):
        out, score, done, cache = carry
        token, logp = pick(logits, i)
        token = jnp.where(done, pad, token)
        score = score + jnp.where(done, 0.0, logp)
        return out.at[:, i].set(token), score, done | (token == eos), cache

    out = jnp.full((b, length), pad, jnp.int32)
    # The first step also fills the cross-attention keys and values into the cache.
    logits, cache = step(start, cache, 0)
    carry = advance((out, jnp.zeros((b,), jnp.float32), jnp.zeros((b,), bool), cache), logits, 0)

    def body(state):
        i, (out, score, done, cache) = state
        logits, cache = step(out[:, i - 1], cache, i)
        return i + 1, advance((out, score, done, cache), logits, i)

    def cond(state):
        i, (_, _, done, _) = state
        return (i < length) & ~jnp.all(done)

    _, (out, score, _, _) = _token_loop(cond, body, (jnp.int32(1), carry))
    return out, score


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b, j], ...] for x [B, M, ...] and index [B, J]."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def _finish(cfg: DecodeConfig, finished, cand_BKT, cand_score_BK, ended_BK, open_, t):
    """The N best ended hypotheses after step t: only candidates among the top N may join,
    scored with the length penalty."""
    fin_seq, fin_score, fin_done = finished
    n, k = cfg.num_beams, cand_score_BK.shape[1]
    joined = ended_BK & (jnp.arange(k) < n)[None]
    penalised = cand_score_BK / cfg.penalty(t + 1)
    full = jnp.all(fin_done, axis=-1, keepdims=True) & (cfg.early_stopping == "finished")
    # Three separate masks, as transformers adds them: the same scores, not just the same order.
    penalised = penalised + full * NEG + ~open_[:, None] * NEG + ~joined * NEG
    merged_score = jnp.concatenate([fin_score, penalised], axis=1)
    keep = jax.lax.top_k(merged_score, n)[1]
    fin_seq = _take(jnp.concatenate([fin_seq, cand_BKT], axis=1), keep)
    fin_done = _take(jnp.concatenate([fin_done, joined], axis=1), keep)
    return fin_seq, _take(merged_score, keep), fin_done


def _beams_at_start(b: int, n: int, length: int, pad: int) -> tuple:
    """Live sequences and scores (only beam 0 live), the finished set (empty), open rows."""
    return (
        jnp.full((b, n, length), pad, jnp.int32),
        jnp.zeros((b, n), jnp.float32).at[:, 1:].set(NEG),
        jnp.full((b, n, length), pad, jnp.int32),
        jnp.full((b, n), NEG, jnp.float32),
        jnp.zeros((b, n), bool),
        jnp.ones((b,), bool),
    )


def _top_k_a_row_at_a_time(x_RV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """top_k of each row, a row at a time: XLA:CPU runs top_k of one row as its partial TopK,
    of several as a full sort of every row. A GPU's TopK takes the rows at once (a row at a time,
    it wrote a scratch copy of each; figures: docs/journal.md, "Decoding")."""
    rows = [jax.lax.top_k(x_RV[r : r + 1], k) for r in range(x_RV.shape[0])]
    top, index = (jnp.concatenate(each) for each in zip(*rows, strict=True))
    return top, index


def _candidates(logits_RV: jax.Array, score_BN: jax.Array, k: int) -> tuple:
    """The k best continuations of a document's beams ([B, K] scores, parent beams, tokens): a
    beam's log-probabilities plus its score, in the order of top_k over all beams' [N * V]. Each
    beam's own k best are found first (log_softmax keeps a row's order), so the vocabulary is
    read twice (top_k, the normaliser's sum; the row's maximum is top_k's first) and the summed
    [B, N * V] scores are never written; the log-probabilities are log_softmax's own."""
    b, n = score_BN.shape
    top_RK, token_RK = jax.lax.platform_dependent(
        logits_RV,
        cpu=functools.partial(_top_k_a_row_at_a_time, k=k),
        default=lambda x: tuple(jax.lax.top_k(x, k)),
    )
    peak_R1 = jax.lax.stop_gradient(top_RK[:, :1])
    total_R1 = jnp.sum(jnp.exp(logits_RV - peak_R1), axis=-1, keepdims=True)
    logp_RK = (top_RK - peak_R1) - jnp.log(total_R1)
    summed = logp_RK.reshape(b, n * k) + jnp.repeat(score_BN, k, axis=1)
    # Ties keep top_k's order over [N * V]: a lower beam, then a lower token.
    cand_score_BK, flat = jax.lax.top_k(summed, k)
    parent_BK = flat // k
    token_BK = jnp.take_along_axis(token_RK.reshape(b, n * k), flat, axis=1)
    return cand_score_BK, parent_BK, token_BK.astype(jnp.int32)


def _beam_search(step: Step, cfg: DecodeConfig, eos: int, pad: int, start, cache, length, b):
    """transformers' vectorised beam search (the same candidates, scores and stopping rule).
    Each step keeps the K = 2N best continuations of all live beams, so that N of them stay live
    even when N end at EOS; the finished set keeps the N best ended hypotheses by penalised score.
    """
    n, k = cfg.num_beams, 2 * cfg.num_beams
    rows = jnp.arange(b)[:, None] * n

    def advance(state, logits, t):
        seq, score, fin_seq, fin_score, fin_done, open_, cache = state
        cand_score_BK, parent_BK, token_BK = _candidates(logits, score, k)
        cand_BKT = _take(seq, parent_BK).at[:, :, t].set(token_BK)
        ended_BK = (token_BK == eos) | (t + 1 >= length)

        # Live beams: the N best candidates that did not end.
        live_score = cand_score_BK + ended_BK * NEG
        best = jax.lax.top_k(live_score, n)[1]
        seq, score, parent = _take(cand_BKT, best), _take(live_score, best), _take(parent_BK, best)

        fin_seq, fin_score, fin_done = _finish(
            cfg, (fin_seq, fin_score, fin_done), cand_BKT, cand_score_BK, ended_BK, open_, t
        )

        # Could a live beam still beat the worst finished one? (at its length, or at the longest)
        best_length = length if cfg.early_stopping == "never" and cfg.length_penalty > 0 else t + 1
        hope = score[:, 0] / cfg.penalty(best_length)
        worst = jnp.where(fin_done, jnp.min(fin_score, axis=1, keepdims=True), NEG)
        open_ = open_ & jnp.any(hope[:, None] > worst, axis=1)

        # Each live beam continues its parent's cache; cross-attention is the same for all beams.
        order = (rows + parent).reshape(-1)
        cache = reordered(cache, order, t)
        going = jnp.any(open_) & ~jnp.all(ended_BK)
        if cfg.early_stopping == "finished":
            going = going & ~jnp.all(fin_done)
        return (seq, score, fin_seq, fin_score, fin_done, open_, cache), going

    logits, cache = step(jnp.repeat(start, n), cache, 0)
    state, going = advance((*_beams_at_start(b, n, length, pad), cache), logits, 0)

    def body(carry):
        t, state, _ = carry
        seq = state[0]
        last = seq[:, :, t - 1].reshape(-1)
        logits, cache = step(last, state[-1], t)
        state, going = advance((*state[:-1], cache), logits, t)
        return t + 1, state, going

    def cond(carry):
        t, _, going = carry
        return going & (t < length)

    _, state, _ = _token_loop(cond, body, (jnp.int32(1), state, going))
    return state[2][:, 0], state[3][:, 0]


def generate(
    model: LongT5,
    params: Any,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    cfg: DecodeConfig,
    length: int,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """([B, length] decoded tokens, pad after EOS; [B] scores) for a batch of documents.

    Scores are summed log-probabilities (greedy, sampling) or penalised beam scores. Sampling
    draws from `rng`, by default the key of `cfg.seed`.
    """
    rng = jax.random.key(cfg.seed) if rng is None else rng
    # The seed reaches the program as a key: another seed does not compile it again.
    cfg = dataclasses.replace(cfg, seed=0)
    return _generate(model, params, input_ids, attention_mask, cfg, length, rng)


def _decoding_params(params: Any, c: LongT5Config) -> Any:
    """The parameters with the decoder's layers in the compute dtype. Each layer casts its
    weights where it uses them; cast once a call instead, a step reads the half-size copy (the
    same values) rather than reading the float32 weights and writing a copy every token."""
    if c.compute_dtype == jnp.float32:
        return params
    layers = jax.tree.map(lambda p: p.astype(c.compute_dtype), params["decoder"]["layers"])
    return {**params, "decoder": {**params["decoder"], "layers": layers}}


@functools.partial(jax.jit, static_argnames=("model", "cfg", "length"))
def _generate(model, params, input_ids, attention_mask, cfg, length, rng):
    c = model.config
    b = input_ids.shape[0]
    params = _decoding_params(params, c)
    encoded = model.apply({"params": params}, input_ids, attention_mask, method=LongT5.encode)
    if cfg.num_beams > 1:
        return beam_search(model, params, encoded, attention_mask, cfg, length)
    step = _stepper(model, params, encoded, attention_mask)
    start = jnp.full((b,), c.decoder_start_id, jnp.int32)
    cache = init_cache(c, b, length)
    return _greedy_or_sample(step, cfg, c.eos_id, c.pad_id, start, cache, length, rng)


def beam_search(
    model: LongT5,
    params: Any,
    encoded: jax.Array,
    attention_mask: jax.Array,
    cfg: DecodeConfig,
    length: int,
) -> tuple[jax.Array, jax.Array]:
    """Beam search over an encoder output [B, L, D] (any num_beams, 1 included)."""
    c, b, n = model.config, encoded.shape[0], cfg.num_beams
    # The decoder's rows are the beams, N a document; its cross-attention keys and values are
    # the document's, once (`blocks.DecoderLayer`).
    step = _stepper(model, params, encoded, attention_mask)
    start = jnp.full((b,), c.decoder_start_id, jnp.int32)
    cache = with_ancestry(init_cache(c, b * n, length))
    return _beam_search(step, cfg, c.eos_id, c.pad_id, start, cache, length, b)


def greedy_decode(
    model: LongT5, params: Any, input_ids: jax.Array, attention_mask: jax.Array, max_length: int
) -> jax.Array:
    """[B, max_length] greedy continuation of the decoder start token; pad after each EOS."""
    return generate(model, params, input_ids, attention_mask, DecodeConfig(), max_length)[0]
