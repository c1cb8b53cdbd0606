"""The one boundary every command crosses.

Bad input the user can fix (a `UsageError`, a `ValueError` raised by this package, a file that is
missing, is a directory or cannot be read, a data or tokenizer file that does not parse) ends as
one line on stderr, `error: ...` naming the file, field or value, and exit 2. Anything else is a
bug: its traceback is kept and the exit is 1. Third-party noise that would follow a one-line
error (orbax's and absl's log lines, asyncio's "Task exception was never retrieved", jax's
CUDA-plugin traceback on a machine without a GPU) is cut down or silenced before any of it starts.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent)


class UsageError(ValueError):
    """Bad input the user can fix, said in one line naming the file, field or value."""


def _raised_here(e: BaseException) -> bool:
    """Whether `e` was raised by this package's own code (its innermost frame is ours)."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PACKAGE)


def _third_party_input_error(e: BaseException) -> bool:
    """Errors that third-party readers raise for a bad file: a Parquet file that is not one,
    a SentencePiece model that does not parse, a gin binding that is not Python."""
    name = type(e).__name__
    return name in ("ArrowInvalid", "ArrowIOError", "ParseError") or (
        isinstance(e, (SyntaxError, RuntimeError))
        and any(
            s in str(e) for s in ("could not parse ModelProto", "Could not parse", "gin", "Parquet")
        )
    )


def one_line(e: BaseException) -> str | None:
    """The one line a known error is said in, or None for a bug (keep its traceback)."""
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    if isinstance(e, UsageError) or (isinstance(e, ValueError) and _raised_here(e)):
        text = str(e)
    elif _third_party_input_error(e):
        text = f"{type(e).__name__}: {e}"
    else:
        return None
    return " ".join(text.split()) or type(e).__name__


class _PluginTraceback(logging.Filter):
    """jax logs a CUDA plugin that cannot start (the `gpu` extra on a machine without a GPU) with
    a traceback; one line says the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "plugin" in record.getMessage().lower():
            reason = str(record.exc_info[1]).splitlines()[0][:200]
            record.msg, record.args, record.exc_info = f"{record.getMessage()}: {reason}", (), None
        return True


def quiet_third_party() -> None:
    """Silence what other libraries print around a run's own output; call before jax starts."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's C++ INFO/WARNING lines
    logging.getLogger("jax._src.xla_bridge").addFilter(_PluginTraceback())
    for name in ("absl", "orbax", "asyncio"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """`main(argv)` behind the boundary; returns the exit status."""
    quiet_third_party()
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        line = one_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
