"""From token sequences to T5X's encoder-decoder features, padded or packed.

Every batch carries the same eight features whether packed or not (unpacked rows are one
segment), so the training step has a single code path:
encoder_input_tokens, encoder_segment_ids, encoder_positions, decoder_target_tokens,
decoder_input_tokens, decoder_segment_ids, decoder_positions, decoder_loss_weights.
"""

from __future__ import annotations

import numpy as np

from longt5_jax.data.tokenizer import EOS_ID

Example = dict[str, np.ndarray]
FEATURES = (
    "encoder_input_tokens",
    "encoder_segment_ids",
    "encoder_positions",
    "decoder_target_tokens",
    "decoder_input_tokens",
    "decoder_segment_ids",
    "decoder_positions",
    "decoder_loss_weights",
)


def trim_with_eos(ids: np.ndarray, length: int) -> np.ndarray:
    """The first length-1 tokens and EOS (seqio's append-EOS-after-trim)."""
    return np.append(ids[: length - 1], EOS_ID).astype(np.int32)


def _pad(x: np.ndarray, length: int) -> np.ndarray:
    return np.pad(x, (0, length - len(x)))


ROW_KEYS = (
    "inputs",
    "inputs_segment_ids",
    "inputs_positions",
    "targets",
    "targets_segment_ids",
    "targets_positions",
)


def packed_row(examples: list[Example], input_length: int, target_length: int) -> Example:
    """Examples one after another in one row, segment i + 1 each, positions restarting at 0
    for each; then padding (segment 0). No examples give a row of padding."""
    row = {}
    for side, length in (("inputs", input_length), ("targets", target_length)):
        parts = [np.asarray(e[side], np.int32) for e in examples]
        sizes = [len(x) for x in parts]
        if sum(sizes) > length:
            raise ValueError(f"{sum(sizes)} {side} tokens do not fit a row of {length}")
        row[side] = _pad(np.concatenate([np.zeros(0, np.int32), *parts]), length)
        segments = np.repeat(np.arange(1, len(parts) + 1, dtype=np.int32), sizes)
        row[f"{side}_segment_ids"] = _pad(segments, length)
        positions = [np.arange(n, dtype=np.int32) for n in sizes]
        row[f"{side}_positions"] = _pad(np.concatenate([np.zeros(0, np.int32), *positions]), length)
    return row


def padded_example(example: Example, input_length: int, target_length: int) -> Example:
    """One example in one row: a single segment followed by padding."""
    return packed_row([example], input_length, target_length)


def shift_right(targets: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """Decoder inputs: targets moved one step right, with start id 0 at each segment's start."""
    shifted = np.zeros_like(targets)
    shifted[..., 1:] = targets[..., :-1]
    starts = np.ones_like(segment_ids, dtype=bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    return np.where(starts, 0, shifted) * (segment_ids > 0)


def to_features(rows: Example) -> Example:
    """Batched rows (from `packed_row`) -> the eight T5X features."""
    dec_seg = rows["targets_segment_ids"].astype(np.int32)
    return {
        "encoder_input_tokens": rows["inputs"].astype(np.int32),
        "encoder_segment_ids": rows["inputs_segment_ids"].astype(np.int32),
        "encoder_positions": rows["inputs_positions"].astype(np.int32),
        "decoder_target_tokens": rows["targets"].astype(np.int32),
        "decoder_input_tokens": shift_right(rows["targets"], dec_seg).astype(np.int32),
        "decoder_segment_ids": dec_seg,
        "decoder_positions": rows["targets_positions"].astype(np.int32),
        "decoder_loss_weights": (dec_seg > 0).astype(np.float32),
    }
