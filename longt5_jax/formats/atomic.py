"""Files and directories written whole or not at all.

Everything is written under a hidden `.NAME.*.partial` name beside NAME and renamed to NAME only
once complete, so a kill mid-write never leaves half a NAME, and nothing a glob for NAME's
pattern would mistake for it. A file replaces what was there; a directory replaces only an empty
one (the OS refuses a non-empty one), so a finished checkpoint is never merged into or replaced.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes, shared: bool = False) -> None:
    """`data` as the file `path` (see `publishing` for `shared`)."""
    with publishing(path, shared=shared) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)


@contextlib.contextmanager
def publishing(path: str | Path, directory: bool = False, shared: bool = False) -> Iterator[Path]:
    """A temporary path beside `path` to write the file (or fill the directory made there) in;
    renamed to `path` when the block ends without error, removed when it fails.

    With one writer per path, only a dead one leaves `.NAME.*.partial` behind, and this clears
    them; `shared`: several processes may be writing `path` at once (a cache every worker fills
    on first use), so those are left alone.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not shared:
        for stale in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
            _remove(stale)
    # Not mkstemp/mkdtemp: what they make is private to its owner (0600), and the rename would
    # publish it so; the writer makes the file here with the permissions it would get anyway.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
