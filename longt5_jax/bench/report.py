"""What every benchmark writes: its report as JSON and its figure as PNG, each announced."""

from __future__ import annotations

import json
from pathlib import Path, PurePath
from typing import Any

from longt5_jax.formats.atomic import write_atomic


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
