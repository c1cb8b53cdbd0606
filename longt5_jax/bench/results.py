"""A benchmark's table in markdown, said where it came from, and the results page's block it owns.

Each table on the results page (docs/benchmarks.md) sits between `<!-- results: bench NAME ARGS
-->` and `<!-- /results -->`; `python -m longt5_jax.bench NAME ARGS --results PAGE` rewrites the
block whose command is its own (`--results` and `--out_dir` aside), so a figure there is what a
command printed at a commit, not a number copied by hand.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

import jax

from longt5_jax.errors import UsageError
from longt5_jax.formats.atomic import write_atomic

# Flags that say where results go, not what is measured: a block's command leaves them out.
PLACES = ("--results", "--out_dir")
OPEN = re.compile(r"^<!-- results: (?P<command>.+?) -->$", re.MULTILINE)
CLOSE = "<!-- /results -->"
# The line above every table: what ran it, when, where and at which commit.
SOURCE = re.compile(
    r"^Measured by `(?P<command>[^`]+)` on (?P<date>\d{4}-\d{2}-\d{2}), "
    r"(?P<machine>.+), commit (?P<commit>[0-9a-f]{7,40}|unknown)\.$",
    re.MULTILINE,
)


def add_argument(parser: argparse.ArgumentParser) -> None:
    """`--results PAGE`: rewrite the page's block of this command with the table it makes."""
    parser.add_argument(
        "--results", type=Path, metavar="PAGE",
        help="rewrite the block of PAGE (docs/benchmarks.md) between <!-- results: bench NAME "
        "ARGS --> and <!-- /results --> whose command is this one with this run's table",
    )  # fmt: skip


def command(name: str, argv: Sequence[str]) -> str:
    """The block's key: `bench NAME ARGS`, without the flags that only say where results go."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in PLACES:
            skip = True
        elif not arg.startswith(tuple(f"{p}=" for p in PLACES)):
            kept.append(arg)
    return shlex.join(["bench", name, *kept])


def commit(root: Path | None = None) -> str:
    """The checkout's short commit (of the one holding this package by default), or "unknown"
    (no git, or not a checkout)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root or Path(__file__).resolve().parents[2],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def machine(target: str | None = None, gpu: str | None = None) -> str:
    """This host and its devices (platform, device kind, count), or the `gpu` a child process
    ran on (this one's backend left unstarted); a deviceless program's target."""
    host = f"{platform.system()} {platform.machine()}"
    if gpu is not None:
        return f"{host} with 1 x {gpu} (gpu)"
    devices = jax.devices()
    here = f"{host} with {len(devices)} x {devices[0].device_kind} ({devices[0].platform})"
    return f"{here}, compiled deviceless for {target}" if target else here


def markdown(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; each cell as its text, `|` escaped."""
    lines = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in lines)


def records(rows: Sequence[dict], columns: dict[str, tuple[str, str]]) -> str:
    """A markdown table of report rows: each column a dotted path into a row and a format
    (`GiB`, `GB`: bytes in those; `ms`: seconds in ms); a path a row lacks leaves its cell empty."""
    return markdown(list(columns), [[_cell(r, *spec) for spec in columns.values()] for r in rows])


def _cell(row: dict, path: str, spec: str) -> str:
    value: object = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return ""
        value = value[key]
    if value is None:
        return ""
    scale = {"GiB": 2**-30, "GB": 1e-9, "ms": 1e3}.get(spec)
    if scale is not None:
        return f"{float(value) * scale:.{1 if spec != 'GiB' else 2}f}"  # type: ignore[arg-type]
    return format(value, spec)


def source_line(name: str, argv: Sequence[str], where: str, today: str | None = None) -> str:
    """The line above a table: its command line, the date, the machine and the commit."""
    shown = "python -m longt5_jax." + command(name, argv)
    today = today or datetime.date.today().isoformat()
    return f"Measured by `{shown}` on {today}, {where}, commit {commit()}."


def replace_block(page: str, key: str, body: str) -> str:
    """`page` with the block whose command is `key` holding `body`; the rest unchanged."""
    found = [m for m in OPEN.finditer(page) if _same(m.group("command"), key)]
    if len(found) != 1:
        why = "no block" if not found else f"{len(found)} blocks"
        raise UsageError(f"{why} <!-- results: {key} --> in the results page")
    start = found[0].end()
    end = page.find(CLOSE, start)
    if end < 0:
        raise UsageError(f"<!-- results: {key} --> has no {CLOSE} after it")
    return f"{page[:start]}\n{body.strip()}\n{page[end:]}"


def check(page: Path | None, name: str, argv: Sequence[str]) -> None:
    """Refuse, before a long run, a `--results` page without this command's block."""
    if page is not None:
        replace_block(_read(page), command(name, argv), "")


def _read(page: Path) -> str:
    try:
        return Path(page).read_text()
    except OSError as e:
        raise UsageError(f"--results {page}: {e.strerror or e}") from None


def _same(marked: str, key: str) -> bool:
    return shlex.split(marked) == shlex.split(key)


def publish(args: argparse.Namespace, name: str, argv: Sequence[str], table: str, *, where: str):
    """The table under its source line as OUT_DIR/NAME.md, and into the block of `--results`."""
    body = f"{source_line(name, argv, where)}\n\n{table}\n"
    path = Path(args.out_dir) / f"{name}.md"
    write_atomic(path, body)
    print(f"wrote {path}")
    if args.results is not None:
        text = replace_block(_read(args.results), command(name, argv), body)
        write_atomic(Path(args.results), text)
        print(f"updated {args.results}")
