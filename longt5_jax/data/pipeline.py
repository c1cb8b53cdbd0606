"""The input pipeline: source -> shuffle -> tokenize + objective (one global sequence of
examples) -> this process's rows, padded or packed (data/stream.py) -> global jax.Arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, TypedDict

import grain
import jax
import numpy as np
import numpy.typing as npt

from longt5_jax.data import DataError, batching, objectives
from longt5_jax.data.aclsum import aclsum_source
from longt5_jax.data.sources import open_source
from longt5_jax.data.stream import GlobalRows
from longt5_jax.data.tokenizer import Tokenizer, train_tokenizer

Objective = Literal["summarization", "span_corruption", "gap_sentences"]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to read, how to turn it into examples, and how to batch them."""

    task: str = "aclsum"  # 'aclsum' (embedded) or 'files' (train_files / eval_files)
    # Globs or paths (.jsonl[.gz|.zst], .parquet, .array_record), in gin a list:
    # ['a/*.jsonl', 'b.parquet'], or one alone as a string.
    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    input_field: str = "article"
    target_field: str = "abstract"
    skip_bad_records: int = 0
    objective: Objective = "summarization"
    prefix: str = ""  # LongT5 uses none
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    gap_sentence_ratio: float = 0.2
    input_length: int = 4096
    target_length: int = 512
    batch_size: int = 8  # global, over all processes
    pack: bool = False
    shuffle: bool = True
    seed: int = 0
    num_epochs: int | None = None  # None repeats forever
    worker_count: int = 0  # grain worker processes; 0 reads in the main process
    worker_buffer_size: int = 2
    tokenizer: str = ""  # a SentencePiece model; '' trains one on the aclsum training split
    tokenizer_vocab_size: int = 8000

    def __post_init__(self):
        # gin gives a list (or one string), kept as the tuple a frozen config holds.
        for name in ("train_files", "eval_files"):
            files = getattr(self, name)
            object.__setattr__(self, name, (files,) if isinstance(files, str) else tuple(files))
        if self.objective not in ("summarization", "span_corruption", "gap_sentences"):
            raise ValueError(
                f"DataConfig.objective={self.objective!r}: expected 'summarization', "
                "'span_corruption' or 'gap_sentences'"
            )
        if self.task not in ("aclsum", "files"):
            raise ValueError(f"DataConfig.task={self.task!r}: expected 'aclsum' or 'files'")
        for name, least in (("input_length", 2), ("target_length", 2), ("batch_size", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"DataConfig.{name}={getattr(self, name)}: expected >= {least}")


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The configured SentencePiece model, or the default trained on aclsum's train split."""
    if cfg.tokenizer:
        return Tokenizer(cfg.tokenizer)
    source = aclsum_source("train")
    lines = (
        line
        for i in range(len(source))
        for r in (source[i],)
        for text in (r["inputs"], r["targets"])
        for line in text.split("\n")
        if line.strip()
    )
    return Tokenizer(train_tokenizer(lines, cfg.tokenizer_vocab_size, "aclsum"))


def open_split(cfg: DataConfig, split: str):
    """The record source of a split ('train', 'val'/'validation', 'test')."""
    if cfg.task == "aclsum":
        return aclsum_source("val" if split == "validation" else split)
    files = cfg.train_files if split == "train" else cfg.eval_files
    if not files:
        raise DataError(
            f"DataConfig.{'train' if split == 'train' else 'eval'}_files is empty: "
            f"task 'files' needs paths for split {split!r}"
        )
    return open_source(list(files), cfg.input_field, cfg.target_field, cfg.skip_bad_records)


class Preprocess(grain.transforms.RandomMap):
    """Text record -> {'inputs', 'targets'} token ids with EOS, per the configured objective."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.prefix = tokenizer.encode(cfg.prefix) if cfg.prefix else None

    def random_map(self, record: dict[str, str], rng: np.random.Generator) -> dict[str, np.ndarray]:
        cfg, tok = self.cfg, self.tokenizer
        if cfg.objective == "summarization":
            inputs, targets = objectives.summarization(
                tok.encode(record["inputs"]), tok.encode(record["targets"]), self.prefix
            )
        elif cfg.objective == "span_corruption":
            # Corrupt only what fits: sentinels shorten the inputs, so input_length is the budget.
            document = tok.encode(record["inputs"])[: cfg.input_length - 1]
            # Long documents need more than the 100 sentinels; like T5, the ids go on counting
            # down into ordinary pieces (extra_id_i = vocab_size - 1 - i for every i).
            sentinels = tok.vocab_size - 1 - np.arange(len(document) + 1, dtype=np.int32)
            inputs, targets = objectives.span_corruption(
                document, rng, sentinels, cfg.noise_density, cfg.mean_noise_span_length
            )
        else:
            inputs, targets = objectives.gap_sentences(
                self._sentences_within_budget(record["inputs"]),
                rng,
                int(tok.sentinel_ids()[0]),
                cfg.gap_sentence_ratio,
            )
        return {
            "inputs": batching.trim_with_eos(inputs, cfg.input_length),
            "targets": batching.trim_with_eos(targets, cfg.target_length),
        }

    def _sentences_within_budget(self, text: str) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        used = 0
        for sentence in objectives.split_sentences(text):
            ids = self.tokenizer.encode(sentence)
            if out and used + len(ids) > self.cfg.input_length - 1:
                break
            out.append(ids)
            used += len(ids)
        return out


def examples(cfg: DataConfig, tokenizer: Tokenizer, split: str = "train") -> grain.MapDataset:
    """The run's one sequence of examples: example g is a function of g (and the seed) only.

    Epoch e is the source reshuffled with seed + e; every random draw of an objective comes
    from a generator keyed by g, which counts on through the epochs.
    """
    ds = grain.MapDataset.source(open_split(cfg, split))
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.random_map(Preprocess(cfg, tokenizer), seed=cfg.seed)
    return ds if cfg.num_epochs == 1 else ds.repeat(cfg.num_epochs)


def make_dataset(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    split: str = "train",
    process_index: int | None = None,
    process_count: int | None = None,
) -> GlobalRows:
    """Batches of this process's block of rows: `batch_size / process_count` rows of T5X
    features (data/stream.py: what fills each global row, and how a position moves)."""
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if cfg.batch_size % count:
        raise ValueError(
            f"DataConfig.batch_size={cfg.batch_size} does not divide over {count} processes"
        )
    return GlobalRows(
        examples(cfg, tokenizer, split),
        cfg.batch_size,
        (cfg.input_length, cfg.target_length),
        cfg.pack,
        index,
        count,
        cfg.worker_count,
        cfg.worker_buffer_size,
    )


class Batch(TypedDict):
    """One step's T5X features as the pipeline yields them: this process's rows, [rows, length]
    each (data/batching.py builds them; segment id 0 is padding)."""

    encoder_input_tokens: npt.NDArray[np.int32]
    encoder_segment_ids: npt.NDArray[np.int32]
    encoder_positions: npt.NDArray[np.int32]
    decoder_target_tokens: npt.NDArray[np.int32]
    decoder_input_tokens: npt.NDArray[np.int32]
    decoder_segment_ids: npt.NDArray[np.int32]
    decoder_positions: npt.NDArray[np.int32]
    decoder_loss_weights: npt.NDArray[np.float32]


# A batch as the step reads it: Batch's features as global jax.Arrays (the model, which imports
# nothing of the data, names the same keys).
GlobalBatch = dict[str, jax.Array]


def global_batch(
    local: Batch | Mapping[str, npt.NDArray[Any]], sharding: jax.sharding.Sharding
) -> GlobalBatch:
    """This process's rows (a training Batch, or an evaluation's) -> global jax.Arrays laid out
    by `sharding` (batch on the first axis)."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
