"""No measured figure in the library's comments and docstrings: figures live on the results page
(docs/benchmarks.md) or in the journal (docs/journal.md), where they carry a date and a machine.

A figure is a number with a unit of time, bytes, percent, speed-up or rate that looks measured: a
decimal one, a time, a range or change ("8-25 MB", "6.8 -> 6.1 s"), a whole percent or speed-up,
or any decimal or unit figure beside "measured" or "took". Not figures: device names and sizes
("A100-80GB", "80 GB A100", "8 x 4"), whole amounts of bytes or rates (chunk sizes, data sheets:
"64 MiB", "600 GB/s"), compute capabilities ("8.0": no unit), quoted examples, defaults, and the
paper's figures.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "longt5_jax"
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?"
TIME = r"(?:s|ms|us|µs|ns|min|seconds|minutes)"
SIZE = r"(?:GiB|MiB|KiB|TiB|GB|MB|KB|TB|bytes)"
RATE = r"(?:[TGP]FLOP/s|[TGM]B/s|tokens/s|samples/s|summaries/s)"
UNIT = rf"(?:\s?(?:{TIME}|{SIZE}|{RATE}|%)|x)"  # a speed-up's x follows its number: 8 x 4 is none
FIGURE = re.compile(
    rf"(?<![\w.\-/^])(?P<value>{NUMBER}(?:\s*(?:-|->|to)\s*{NUMBER})?)(?P<unit>{UNIT})(?![\w/])"
    rf"|(?<![\w.])x\d+\.\d+\b"  # x0.90: a speed-up
)
DECIMAL = r"\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+"
MEASURED = re.compile(rf"\b(?:measured|took|timed)\b[^.;:]{{0,30}}?(?<![\w.])(?:{DECIMAL})", re.I)
# Quoted examples, and what a figure beside these words is: a default, a statistic, the paper's.
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`")
NOT_OURS = re.compile(r"\b(?:default|interval|paper|peak)\b", re.I)


def is_measured(match: re.Match) -> bool:
    """Whether a number with its unit reads as a measurement (the module docstring's rules)."""
    if match.group(0).startswith("x"):
        return True
    value, unit = match.group("value"), match.group("unit").strip()
    decimal, ranged = "." in value, bool(re.search(r"\d\s*(?:-|->|to)\s*\d", value))
    return decimal or ranged or re.fullmatch(TIME, unit) is not None or unit in "%x"


def figures(text: str) -> list[str]:
    """The measured figures in a line of prose."""
    text = QUOTED.sub("''", text)
    found = [m.group(0) for m in MEASURED.finditer(text)]
    for m in FIGURE.finditer(text):
        before, after = text[max(0, m.start() - 40) : m.start()], text[m.end() : m.end() + 12]
        if is_measured(m) and not NOT_OURS.search(before + after):
            found.append(m.group(0))
    return found


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of each comment and each line of each docstring of a module."""
    lines = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                first = node.body[0].lineno
                lines += [(first + i, x) for i, x in enumerate(docstring.splitlines())]
    return lines


def measured_in(path: Path) -> list[str]:
    found = []
    for number, text in prose(path.read_text()):
        found += [f"{path.relative_to(PACKAGE.parent)}:{number}: {f}" for f in figures(text)]
    return found


def test_no_measured_figure_in_a_library_comment_or_docstring():
    found = [f for path in sorted(PACKAGE.rglob("*.py")) for f in measured_in(path)]
    assert found == [], "move these to docs/benchmarks.md or docs/journal.md:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("# float16's drift from float32 measured 3.4e-5", ["measured 3.4e-5"]),
        ("# moves 0.5-3.6% less HBM", ["0.5-3.6%"]),
        ("# small TGlobal at 4k: 6.8 -> 6.1 s a step", ["6.8 -> 6.1 s"]),
        ("# on an H100 that step took 0.161 s", ["took 0.161", "0.161 s"]),
        ("# 8 s -> 4 s each, 18 ms an array", ["8 s", "4 s", "18 ms"]),
        ("# 79% of a 16k step; 2.5x faster; x0.90 with offload", ["79%", "2.5x", "x0.90"]),
        ("# 236.2 GB a step, 1,119.6 GB, at 635 TFLOP/s measured", ["236.2 GB", "1,119.6 GB"]),
        ("# 8-25 MB more a step, 6-10x less traffic", ["8-25 MB", "6-10x"]),
        ("# 12.5 TFLOP/s, 1.7 GiB", ["12.5 TFLOP/s", "1.7 GiB"]),
    ],
)
def test_the_checker_finds_measured_figures(text, expected):
    assert figures(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "# 8 x 4 A100-80GB; an 80 GB A100; memory % of 80 GB; 40 and 80 GB cards",
        "`--target a100-80gb | h200-141gb` compiles for 4 A100s",
        "# float32 kernels from compute capability 9.0, bf16 from 8.0",
        "# query blocks of 128 tokens, chunks of at most 64 MiB, 1 KiB a program",
        "# A100: 312 TFLOP/s bf16, NVLink 3 (600 GB/s both ways), HDR 200 Gb/s, PCIe 4 x16",
        "'42.1 s', '12 min 5 s' or '3 h 20 min'.",
        "# jax's default stops at 75%; the 95% interval; FLOPs at 100% of peak",
        "the paper reports 93% from 16 to 64 GPUs; 2 x pipeline microbatches",
        "# SLURM_TASKS_PER_NODE reads like '4(x8)'; 2**30 bytes a GiB; -2^100",
        "# chained 2048^2 matmuls measured in the same run; the measured idle fraction is 1 - T",
    ],
)
def test_the_checker_passes_what_is_no_measurement(text):
    assert figures(text) == []


def test_the_checker_reads_comments_and_docstrings_not_code_or_help():
    source = '''"""A module: 1.7 s."""
X = "4.2 s"  # took 2.5 ms


def f():
    """One line, 3.1 GiB."""
    parser.add_argument("--x", help="at 40.5 GB/s")
'''
    assert [(n, figures(t)) for n, t in prose(source) if figures(t)] == [
        (2, ["took 2.5", "2.5 ms"]),
        (1, ["1.7 s"]),
        (6, ["3.1 GiB"]),
    ]
