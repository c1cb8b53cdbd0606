"""Check a data config before training: batch shapes, padding/packing efficiency, an example.

python -m longt5_jax.data.preview --gin_file=configs/data/aclsum.gin [--num_batches 3]
    [--split train] [--gin.DataConfig.input_length=16384]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from longt5_jax import configuration
from longt5_jax.data.pipeline import DataConfig, load_tokenizer, make_dataset


def _summary(batch: dict[str, np.ndarray]) -> str:
    enc, dec = batch["encoder_segment_ids"], batch["decoder_segment_ids"]
    segments = [len(np.unique(row[row > 0])) for row in enc]
    return (
        f"encoder {enc.shape} {100 * (enc > 0).mean():5.1f}% tokens, "
        f"decoder {dec.shape} {100 * (dec > 0).mean():5.1f}% tokens, "
        f"{np.mean(segments):.2f} examples/row"
    )


def main(argv: list[str] | None = None) -> int:
    files, bindings, rest = configuration.split_gin_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_batches", type=int, default=2)
    parser.add_argument("--split", default="train")
    args = parser.parse_args(rest)
    try:
        configuration.parse(files, bindings)
        cfg = configuration.build(DataConfig)
    except configuration.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    tokenizer = load_tokenizer(cfg)
    print(
        f"tokenizer: {tokenizer.path.name}, {tokenizer.vocab_size} ids "
        f"(model vocab {tokenizer.padded_vocab_size}), {time.perf_counter() - start:.1f} s"
    )
    ds = make_dataset(cfg, tokenizer, args.split, process_index=0, process_count=1)
    first = None
    for i, batch in zip(range(args.num_batches), ds, strict=False):
        first = batch if first is None else first
        print(f"batch {i}: {_summary(batch)}")
    if first is None:
        print("no batches")
        return 1
    row = first["encoder_segment_ids"][0]
    inputs = first["encoder_input_tokens"][0][row == 1]
    targets = first["decoder_target_tokens"][0][first["decoder_segment_ids"][0] == 1]
    print(f"example 0 inputs ({len(inputs)} tokens): {tokenizer.decode(inputs)[:400]!r} ...")
    print(f"example 0 targets ({len(targets)} tokens): {tokenizer.decode(targets)[:400]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
