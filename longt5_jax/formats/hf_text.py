"""The text side of a transformers LongT5 directory: the tokenizer files and generation defaults.

With these beside `hf.save`'s weights, `AutoTokenizer.from_pretrained(DIR)` gives our
tokenizer's ids and `pipeline("summarization", model=DIR)` summarises as `predict` does. The
SentencePiece model is written as it is, in T5's layout (pad 0, eos 1, unk 2, 100 sentinels
counting down from the top); embedding rows past pieces + 100 (the vocabulary padded to a
multiple of 128) have no token, as in T5 (32100 tokens, 32128 rows).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from longt5_jax.formats.atomic import write_atomic
from longt5_jax.model.config import LongT5Config

SPIECE = "spiece.model"  # the name T5's tokenizers look for
EXTRA_IDS = 100  # T5's sentinels, numbered down from the top of pieces + EXTRA_IDS


def save_tokenizer(
    path: str | os.PathLike, spiece: bytes, special: tuple[str, str, str], max_input: int = 0
) -> None:
    """spiece.model and tokenizer_config.json (each atomically) for T5's tokenizers.

    `special` names the SentencePiece model's pad, eos and unk pieces; `max_input` (if known) is
    the input length the model was trained on. transformers converts the slow tokenizer to the
    fast one AutoTokenizer returns, keeping its sentinel ids and its dummy prefix; a
    T5TokenizerFast built from the model file alone lacks that prefix and gives other ids.
    """
    path = Path(path)
    pad, eos, unk = special
    settings = {
        "tokenizer_class": "T5Tokenizer",
        "pad_token": pad,
        "eos_token": eos,
        "unk_token": unk,
        "extra_ids": EXTRA_IDS,
        # Each text between special tokens is encoded as SentencePiece encodes a text (with its
        # dummy prefix): our tokenizer's ids. legacy=False drops the prefix after a special.
        "legacy": True,
        # Decoded text as SentencePiece decodes it, without rewriting " ." to "." and the like.
        "clean_up_tokenization_spaces": False,
    }
    if max_input:
        settings["model_max_length"] = max_input
    write_atomic(path / SPIECE, spiece)
    write_atomic(path / "tokenizer_config.json", json.dumps(settings, indent=2) + "\n")


def save_generation_config(
    config: LongT5Config, path: str | os.PathLike, decoding: dict[str, Any] | None = None
) -> None:
    """generation_config.json: our special ids and `decoding`, the run's decode settings in
    transformers' names (max_length, num_beams, do_sample, ...)."""
    settings = {
        "decoder_start_token_id": config.decoder_start_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
        **(decoding or {}),
    }
    write_atomic(Path(path) / "generation_config.json", json.dumps(settings, indent=2) + "\n")


def read_spiece(path: str | os.PathLike) -> bytes | None:
    """The SentencePiece model of a transformers directory (spiece.model), or None."""
    f = Path(path) / SPIECE
    return f.read_bytes() if f.is_file() else None
