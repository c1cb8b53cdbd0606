"""Compressed JSONL made seekable: decompressed once into the data cache, keyed by content."""

from __future__ import annotations

import gzip
import hashlib
import shutil
from collections.abc import Callable
from typing import IO

import zstandard

from longt5_jax.data import DataError, cache_dir
from longt5_jax.formats.atomic import publishing

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _gunzip(path: str, out: IO[bytes]) -> None:
    with gzip.open(path) as src:
        shutil.copyfileobj(src, out, 1 << 20)


def _unzstd(path: str, out: IO[bytes]) -> None:
    """Decompresses concatenated zstd frames, failing on a truncated last frame."""
    # zstandard's stream_reader and copy_stream stop silently inside a truncated frame.
    context = zstandard.ZstdDecompressor()
    frame, fed = context.decompressobj(), False
    with open(path, "rb") as src:
        while chunk := src.read(1 << 20):
            while chunk:
                out.write(frame.decompress(chunk))
                fed = not frame.eof
                if fed:
                    break
                chunk, frame = frame.unused_data, context.decompressobj()
    if fed:
        raise zstandard.ZstdError("the last frame is truncated")


def plain_jsonl(path: str) -> str:
    """Returns a seekable uncompressed path for a JSONL file: itself, or a cached decompression."""
    # Seeking in a gzip/zstd stream decompresses from the start (or needs a dependency that indexes
    # it); one decompression into a cache keyed by content hash gives O(1) seeks, is shared by all
    # worker processes and later runs, and can never be stale.
    with open(path, "rb") as f:
        magic = f.read(4)
    decompress: Callable[[str, IO[bytes]], None]
    if magic.startswith(_GZIP_MAGIC):
        decompress = _gunzip
    elif magic == _ZSTD_MAGIC:
        decompress = _unzstd
    else:
        return path
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    cached = cache_dir() / "jsonl" / f"{digest[:32]}.jsonl"
    if cached.exists():
        return str(cached)
    cached.parent.mkdir(parents=True, exist_ok=True)  # unwritable cache: not a bad input file
    try:  # shared: workers and concurrent runs may decompress the same file at once
        with publishing(cached, shared=True) as tmp, open(tmp, "wb") as out:
            decompress(path, out)
    except (OSError, EOFError, zstandard.ZstdError) as e:
        raise DataError(f"{path}: cannot decompress ({e})") from e
    return str(cached)
