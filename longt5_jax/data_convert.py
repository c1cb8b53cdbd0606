"""Converts records from any source format into sharded ArrayRecord files for fast random access.

    python -m longt5_jax.data_convert --input 'data/*.jsonl.gz' --output_dir out/ --num_shards 4
        [--input_field article] [--target_field abstract] [--format jsonl]
        [--skip_bad_records N] [--name train] [--overwrite]

writes out/{name}-{i:05d}-of-{n:05d}.array_record, each record the UTF-8 JSON object
{input_field: ..., target_field: ...}. Shards are contiguous runs of the input: reading the shards
in name order gives back the input order exactly, and each shard reads its slice of the source
sequentially. Round-robin would buy nothing, since grain shuffles by global index anyway.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from array_record.python import array_record_module
from tqdm import tqdm

from longt5_jax import cli
from longt5_jax.data.sources import FORMATS, DataError, expand, open_source
from longt5_jax.formats.atomic import publishing

# Grain reads one record at a time; a group size of 1 makes each read decode only that record.
WRITER_OPTIONS = "group_size:1"


class Records(Protocol):
    """What is converted: records by index (a source of data/sources.py, or a list)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Mapping[str, str]: ...


def shard_paths(output_dir: Path, name: str, num_shards: int) -> list[Path]:
    """The final paths of the shards, in order."""
    return [
        output_dir / f"{name}-{i:05d}-of-{num_shards:05d}.array_record" for i in range(num_shards)
    ]


def _existing_shards(output_dir: Path, name: str) -> list[Path]:
    # Any shard count: a glob like 'out/train-*.array_record' would mix stale shards with new ones.
    return sorted(output_dir.glob(f"{name}-?????-of-?????.array_record"))


def _write_shard(
    source: Records,
    indices: range,
    path: Path,
    fields: tuple[str, str],
    progress: tqdm,
) -> None:
    """Writes one shard under a temporary name and renames it only once it is complete."""
    with publishing(path) as tmp:
        writer = array_record_module.ArrayRecordWriter(str(tmp), WRITER_OPTIONS)
        try:
            for index in indices:
                example = source[index]
                record = {fields[0]: example["inputs"], fields[1]: example["targets"]}
                writer.write(json.dumps(record, ensure_ascii=False).encode("utf-8"))
                progress.update()
        finally:
            writer.close()


def check_no_shards(output_dir: Path, name: str, overwrite: bool) -> None:
    """Refuses to replace existing shards of this name unless overwrite is set."""
    existing = _existing_shards(Path(output_dir), name)
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise DataError(f"{existing[0]} already exists{more}; pass --overwrite to replace it")


def write_shards(
    source: Records,
    output_dir: str | os.PathLike[str],
    num_shards: int,
    name: str = "train",
    fields: tuple[str, str] = ("article", "abstract"),
    overwrite: bool = False,
) -> list[Path]:
    """Writes a source as contiguous ArrayRecord shards; returns their paths."""
    output_dir = Path(output_dir)
    check_no_shards(output_dir, name, overwrite)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = shard_paths(output_dir, name, num_shards)
    stale = set(_existing_shards(output_dir, name)) - set(paths)
    total = len(source)
    with tqdm(total=total, desc=f"writing {name}", unit="rec") as progress:
        for i, path in enumerate(paths):
            indices = range(i * total // num_shards, (i + 1) * total // num_shards)
            _write_shard(source, indices, path, fields, progress)
    for path in stale:  # only with --overwrite: shards of an earlier run with another count
        path.unlink()
    return paths


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(
        prog="python -m longt5_jax.data_convert", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--input", nargs="+", required=True, help="files or glob patterns")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--num_shards", type=cli.positive, default=1)
    parser.add_argument("--name", default="train", help="shard name prefix, e.g. train")
    parser.add_argument("--input_field", default="article")
    parser.add_argument("--target_field", default="abstract")
    parser.add_argument("--format", choices=FORMATS, help="default: from the file extensions")
    parser.add_argument("--skip_bad_records", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace existing shards")
    args = parser.parse_args(argv)
    if args.skip_bad_records < 0:
        parser.error(f"--skip_bad_records={args.skip_bad_records}: expected >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (2 with a one-line error for bad input)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    fields = (args.input_field, args.target_field)
    # Checked before reading the input, which can take minutes to validate.
    check_no_shards(Path(args.output_dir), args.name, args.overwrite)
    # A shard replaced while the source still reads it would mix old records and new; shards of
    # another count (resharding in place) are removed only after every read.
    cli.check_outputs(
        [("the shard", p) for p in shard_paths(Path(args.output_dir), args.name, args.num_shards)],
        [("--input", f) for f in expand(args.input)],
    )
    source = open_source(args.input, *fields, args.skip_bad_records, args.format)
    paths = write_shards(
        source, args.output_dir, args.num_shards, args.name, fields, args.overwrite
    )
    size = sum(p.stat().st_size for p in paths)
    print(f"read {source!r}")
    print(
        f"wrote {len(source)} records to {len(paths)} shards in {args.output_dir} "
        f"({size:,} bytes, {size / 2**20:.1f} MiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
