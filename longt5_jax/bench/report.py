"""What every benchmark writes: its report as JSON and its figure as PNG, each announced."""

from __future__ import annotations

import argparse
import json
from pathlib import Path, PurePath
from typing import Any

from longt5_jax.formats.atomic import write_atomic


def count(text: str) -> int:
    """An argparse type: an integer >= 0, for a flag whose 0 means none (no warm-up, no
    workers, a part skipped); `cli.positive` where 0 means nothing."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def write_json(out_dir: str | Path, name: str, report: Any) -> Path:
    """`report` as OUT_DIR/NAME.json (the directory made if needed); paths in it (a
    benchmark's options, as parsed) as their text."""
    path = Path(out_dir) / f"{name}.json"
    text = json.dumps(report, indent=2, default=_path_text)
    write_atomic(path, text)  # a killed run keeps the last whole report
    print(f"wrote {path}")
    return path


def _path_text(value: Any) -> str:
    """A path as its text; anything else json cannot write stays an error."""
    if isinstance(value, PurePath):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def pyplot():
    """matplotlib's pyplot without a screen; imported here: it takes a second, and only the
    figures need it."""
    import matplotlib  # deferred: slow to import, and only the figures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no screen

    return plt


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
