"""Evaluation of a split: teacher-forced loss over every example, decoded summaries and ROUGE.

Every process reads the same examples in the same order (and so makes the same plan of batches
grouped by length to decode them in, `batches`); each batch's rows are laid out over the `data`
axis with each process giving its contiguous block, and decoded tokens are gathered back, so all
processes see every prediction (process 0 writes them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from longt5_jax.data import batching
from longt5_jax.data.pipeline import DataConfig, Preprocess, open_split
from longt5_jax.data.tokenizer import Tokenizer
from longt5_jax.infer import batches
from longt5_jax.infer.rouge import rouge
from longt5_jax.model import LongT5Config


@dataclasses.dataclass(frozen=True)
class Example:
    id: str
    inputs: np.ndarray  # token ids with EOS, at most input_length
    targets: np.ndarray  # token ids with EOS, at most target_length
    reference: str  # the untruncated target text ROUGE compares against


def load_examples(
    cfg: DataConfig, tokenizer: Tokenizer, split: str, limit: int = 0
) -> list[Example]:
    """The first `limit` (0: all) examples of a split in file order, made by the objective."""
    source = open_split(cfg, split)
    count = len(source) if limit <= 0 else min(limit, len(source))
    preprocess = Preprocess(cfg, tokenizer)
    examples = []
    for i in range(count):
        record = source[i]
        # A fixed stream per example: noise-based objectives evaluate the same corruption each time.
        made = preprocess.random_map(record, np.random.default_rng([cfg.seed, i]))
        examples.append(
            Example(str(record.get("id", i)), made["inputs"], made["targets"], record["targets"])
        )
    return examples


def _batches(examples: list[Example], cfg: DataConfig, batch_size: int) -> Iterator[dict]:
    """Padded feature batches of `batch_size` rows; rows past the end have zero loss weight."""
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        rows = [
            batching.padded_example(
                {"inputs": e.inputs, "targets": e.targets}, cfg.input_length, cfg.target_length
            )
            for e in chunk
        ]
        rows += [
            batching.padded_example(
                {"inputs": np.zeros(0, np.int32), "targets": np.zeros(0, np.int32)},
                cfg.input_length,
                cfg.target_length,
            )
        ] * (batch_size - len(chunk))
        yield batching.to_features({k: np.stack([r[k] for r in rows]) for k in rows[0]})


def local_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's contiguous block of a global batch's rows."""
    n, i = jax.process_count(), jax.process_index()
    rows = next(iter(batch.values())).shape[0] // n
    return {k: v[i * rows : (i + 1) * rows] for k, v in batch.items()}


def eval_loss(
    evaluate: Callable[[dict], dict], examples: list[Example], cfg: DataConfig, batch_size: int
) -> dict[str, float]:
    """Token-mean cross-entropy and accuracy over `examples` with `evaluate(global batch)`."""
    totals = {"loss_sum": 0.0, "weight": 0.0, "correct": 0.0}
    for batch in _batches(examples, cfg, batch_size):
        stats = jax.device_get(evaluate(local_rows(batch)))
        for k in totals:
            totals[k] += float(stats[k])
    weight = max(totals["weight"], 1.0)
    return {
        "loss": totals["loss_sum"] / weight,
        "accuracy": totals["correct"] / weight,
        "tokens": totals["weight"],
    }


def decoding_plan(
    examples: list[Example], cfg: DataConfig, batch_size: int, model: LongT5Config
) -> batches.Plan:
    """The batches `predict` decodes `examples` in: grouped by length, on `model`'s block grid."""
    return batches.for_model([len(e.inputs) for e in examples], batch_size, cfg.input_length, model)


def predict(
    generate: Callable[[np.ndarray, np.ndarray], Any],
    examples: list[Example],
    plan: batches.Plan,
    progress: Callable[[int], None] | None = None,
) -> list[np.ndarray]:
    """Decoded token ids of each example, in order, in the batches of `plan` (`decoding_plan`);
    `generate(ids, mask)` takes this process's rows."""

    def whole_batch(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        local = local_rows({"ids": ids, "mask": mask})
        tokens = generate(local["ids"], local["mask"])
        if jax.process_count() > 1:
            tokens = multihost_utils.process_allgather(tokens, tiled=True)
        return np.asarray(jax.device_get(tokens))

    return batches.decode(whole_batch, [e.inputs for e in examples], plan, progress)


def rouge_of(
    tokenizer: Tokenizer, examples: list[Example], tokens: list[np.ndarray]
) -> tuple[dict[str, float], list[dict]]:
    """ROUGE against the reference texts, and one record per example for predictions JSONL."""
    texts = [tokenizer.decode(t) for t in tokens]
    records = [
        {"id": e.id, "prediction": text, "reference": e.reference}
        for e, text in zip(examples, texts, strict=True)
    ]
    return rouge([e.reference for e in examples], texts), records


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Which split `evaluate` reads, and how often training evaluates on it."""

    split: str = "val"  # 'val'/'validation'/'test' (aclsum), or any name for DataConfig.eval_files
    loss_every: int = 0  # training: eval loss every N steps (0: never)
    loss_examples: int = 0  # ... over the split's first N examples (0: all)
    rouge_every: int = 0  # training: decode and score ROUGE every N steps (0: never)
    rouge_examples: int = 8  # ... on the split's first N examples

    def __post_init__(self):
        for name in ("loss_every", "loss_examples", "rouge_every", "rouge_examples"):
            if getattr(self, name) < 0:
                raise ValueError(f"EvalConfig.{name}={getattr(self, name)}: expected >= 0")
