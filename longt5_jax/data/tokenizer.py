"""SentencePiece tokenizer with T5's layout: pad=0, eos=1, unk=2, 100 sentinels at the top.

T5's vocabulary is 32000 pieces; extra_id_0 is 32099 and the sentinels count down to 32000; the
model's embedding is padded to 32128. The embedded default trains a smaller model of the same
layout on the aclsum training split on first use and caches it by content hash.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import sentencepiece as spm

from longt5_jax.data import cache_dir
from longt5_jax.data.sources import DataError
from longt5_jax.formats.atomic import write_atomic

EXTRA_IDS = 100
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


class Tokenizer:
    """Text <-> int32 ids with T5's special ids; sentinels are ids >= the SentencePiece size."""

    def __init__(self, model_path: str | os.PathLike, proto: bytes | None = None):
        """From a file, or from the model's bytes (`proto`) with `model_path` naming where
        they came from (a checkpoint)."""
        path = Path(model_path)
        if proto is None and not path.is_file():
            raise DataError(f"{path}: SentencePiece model not found")
        self.path = path
        self._proto = path.read_bytes() if proto is None else proto
        self._sp = self._load()

    @property
    def proto(self) -> bytes:
        """The serialized SentencePiece model."""
        return self._proto

    def _load(self) -> spm.SentencePieceProcessor:
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(self._proto)
        except (RuntimeError, OSError) as e:
            raise DataError(f"{self.path}: not a SentencePiece model ({e})") from None
        if (sp.pad_id(), sp.eos_id()) != (PAD_ID, EOS_ID):
            raise DataError(
                f"{self.path}: pad/eos ids are {sp.pad_id()}/{sp.eos_id()}, "
                f"expected T5's {PAD_ID}/{EOS_ID}"
            )
        return sp

    def __getstate__(self):  # the SWIG processor does not pickle; grain workers need copies
        return {"path": self.path, "_proto": self._proto}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._sp = self._load()

    @property
    def special_pieces(self) -> tuple[str, str, str]:
        """The pieces of pad, eos and unk ('<pad>', '</s>', '<unk>' in T5's model)."""
        sp = self._sp
        return sp.id_to_piece(PAD_ID), sp.id_to_piece(EOS_ID), sp.id_to_piece(sp.unk_id())

    @property
    def piece_count(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab_size(self) -> int:
        """Pieces plus sentinels."""
        return self.piece_count + EXTRA_IDS

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of 128, the model's embedding rows (T5: 32128)."""
        return -(-self.vocab_size // 128) * 128

    def sentinel_ids(self) -> np.ndarray:
        """sentinel_ids()[i] is extra_id_i; they count down from the top of the vocabulary."""
        return self.vocab_size - 1 - np.arange(EXTRA_IDS, dtype=np.int32)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first EOS, padding dropped, sentinels as <extra_id_i>."""
        pieces: list[int] = []
        out: list[str] = []
        for i in (int(i) for i in ids):
            if i == EOS_ID:
                break
            if i == PAD_ID or i >= self.vocab_size:  # ids past the vocabulary: embedding padding
                continue
            if i >= self.piece_count:
                out += [self._sp.decode(pieces), f"<extra_id_{self.vocab_size - 1 - i}>"]
                pieces = []
            else:
                pieces.append(i)
        return "".join(out + [self._sp.decode(pieces)])


def train_tokenizer(texts: Iterable[str], vocab_size: int, name: str) -> Path:
    """Train a T5-layout unigram model on `texts` (cached by content hash) and return its path."""
    texts = list(texts)
    digest = hashlib.sha256()
    for t in texts:
        digest.update(t.encode("utf-8") + b"\0")
    digest.update(f"unigram-{vocab_size}".encode())
    target = cache_dir() / f"{name}-{vocab_size}-{digest.hexdigest()[:16]}.model"
    if target.is_file():
        return target
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=0.9999,
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        bos_id=-1,
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        max_sentence_length=1 << 16,
        hard_vocab_limit=False,  # a small corpus gets a smaller vocabulary, not an error
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    # Concurrent first uses (several processes) each train and write the same file.
    write_atomic(target, model.getvalue(), shared=True)
    return target
