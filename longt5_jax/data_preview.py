"""Check a data config before training: batch shapes, padding/packing efficiency, an example.

python -m longt5_jax.data_preview --gin_file=configs/data/aclsum.gin [--num_batches 3]
    [--split train] [--gin.DataConfig.input_length=16384]
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np

from longt5_jax import cli, configuration
from longt5_jax.data.pipeline import DataConfig, load_tokenizer, make_dataset
from longt5_jax.data.sources import DataError


@dataclasses.dataclass(frozen=True)
class PreviewSections:
    """The one section the preview builds."""

    data: DataConfig


def _summary(batch: dict[str, np.ndarray]) -> str:
    enc, dec = batch["encoder_segment_ids"], batch["decoder_segment_ids"]
    segments = [len(np.unique(row[row > 0])) for row in enc]
    return (
        f"encoder {enc.shape} {100 * (enc > 0).mean():5.1f}% tokens, "
        f"decoder {dec.shape} {100 * (dec > 0).mean():5.1f}% tokens, "
        f"{np.mean(segments):.2f} examples/row"
    )


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    parser = cli.ArgumentParser(
        prog="python -m longt5_jax.data_preview", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--num_batches", type=cli.positive, default=2)
    parser.add_argument("--split", default="train")
    args, rest = parser.parse_known_args(argv)
    # A run config's required MODEL_DIR is never used here: bind one so the config parses.
    sections, _ = configuration.from_args(rest, PreviewSections, preset=["MODEL_DIR = ''"])
    cfg = sections.data
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
        raise DataError(f"split {args.split!r}: no batches")
    row = first["encoder_segment_ids"][0]
    inputs = first["encoder_input_tokens"][0][row == 1]
    targets = first["decoder_target_tokens"][0][first["decoder_segment_ids"][0] == 1]
    print(f"example 0 inputs ({len(inputs)} tokens): {tokenizer.decode(inputs)[:400]!r} ...")
    print(f"example 0 targets ({len(targets)} tokens): {tokenizer.decode(targets)[:400]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
