"""Decoding many documents in batches grouped by length.

Documents are sorted longest first and cut into batches of a fixed number of rows; each batch is
padded only to the shortest bucket length that holds its longest member, the last batch's spare
rows left empty, and the summaries come back in the documents' own order. Bucket lengths are few
(the model's block grid, doubling up to the input length), so few programs are compiled.

The plan depends on the documents' lengths alone, and the sort is stable: every process of a
multi-host run, reading the same documents, makes the same plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from longt5_jax.model import LongT5Config


def granularity(config: LongT5Config) -> int:
    """The step between bucket lengths: whole local-attention blocks (the encoder pads a length
    to them, so a length between two costs the next one's work) and, for TGlobal, whole global
    blocks (a partial one makes no side key)."""
    if config.attention == "transient-global":
        return math.lcm(config.block_len, config.global_block_size)
    return config.block_len


def bucket_lengths(input_length: int, step: int) -> tuple[int, ...]:
    """`step`, doubling while under `input_length`, then `input_length` itself, on the grid or
    not: the model takes any length (its attention pads to whole blocks inside)."""
    lengths = []
    length = step
    while length < input_length:
        lengths.append(length)
        length *= 2
    return (*lengths, input_length)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of a plan: its documents (indices, row by row) and the length it is padded to."""

    documents: tuple[int, ...]  # fewer than the plan's rows in the last batch: the rest are empty
    length: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """Batches of `rows` rows covering every document once, and what their padding costs."""

    batches: tuple[Batch, ...]
    rows: int
    tokens: int  # the documents' token positions, all batches together
    input_length: int  # the longest bucket: what every batch was padded to in file order

    @property
    def padding(self) -> float:
        """The share of the encoder's input positions that are padding (its wasted work)."""
        positions = self.rows * sum(b.length for b in self.batches)
        return 1.0 - self.tokens / positions if positions else 0.0

    @property
    def file_order_padding(self) -> float:
        """That share had every batch been cut in file order and padded to the input length."""
        positions = self.rows * len(self.batches) * self.input_length
        return 1.0 - self.tokens / positions if positions else 0.0

    def summary(self) -> str:
        return (
            f"padding: {self.padding:.1%} of input positions "
            f"(file order at full length: {self.file_order_padding:.1%})"
        )


def by_length(lengths: Sequence[int], rows: int, buckets: Sequence[int]) -> Plan:
    """Batches of `rows` documents, longest first, each padded to the shortest bucket that
    holds its longest member."""
    if rows < 1:
        raise ValueError(f"{rows} rows a batch: expected >= 1")
    longest = max(buckets)
    too_long = [i for i, n in enumerate(lengths) if n > longest]
    if too_long:
        raise ValueError(
            f"document {too_long[0]} has {lengths[too_long[0]]} tokens, more than the longest "
            f"bucket ({longest}): truncate documents to the input length first"
        )
    # Longest first: the largest program and its memory come first, so a batch that does not
    # fit fails at once, not after hours of shorter ones.
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches = []
    for start in range(0, len(order), rows):
        chunk = tuple(order[start : start + rows])
        need = lengths[chunk[0]]  # the longest of the chunk: it comes first
        batches.append(Batch(chunk, min(b for b in buckets if b >= need)))
    return Plan(tuple(batches), rows, sum(lengths), longest)


def for_model(lengths: Sequence[int], rows: int, input_length: int, config: LongT5Config) -> Plan:
    """`by_length` on `config`'s block grid up to `input_length`."""
    return by_length(lengths, rows, bucket_lengths(input_length, granularity(config)))


def padded(
    documents: Sequence[np.ndarray], batch: Batch, rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """([rows, length] token ids, [rows, length] mask of the real tokens) of one batch."""
    ids = np.zeros((rows, batch.length), np.int32)
    mask = np.zeros((rows, batch.length), np.int32)
    for r, i in enumerate(batch.documents):
        n = len(documents[i])
        ids[r, :n] = documents[i]
        mask[r, :n] = 1
    return ids, mask


def decode(
    generate: Callable[[np.ndarray, np.ndarray], np.ndarray],
    documents: Sequence[np.ndarray],
    plan: Plan,
    progress: Callable[[int], None] | None = None,
) -> list[np.ndarray]:
    """Each document's decoded tokens, in the documents' order: `generate(ids, mask)` decodes a
    whole padded batch ([rows, length] each) into [rows, T] tokens; `progress(n)` is told of
    each batch's n documents as they are done."""
    planned = sorted(i for b in plan.batches for i in b.documents)
    if planned != list(range(len(documents))):
        raise ValueError(f"a plan of {len(planned)} documents given {len(documents)}")
    out: dict[int, np.ndarray] = {}
    for batch in plan.batches:
        tokens = generate(*padded(documents, batch, plan.rows))
        for r, i in enumerate(batch.documents):
            out[i] = tokens[r]
        if progress is not None:
            progress(len(batch.documents))
    return [out[i] for i in range(len(documents))]
