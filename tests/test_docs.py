"""Every command the README and docs/*.md show, checked as a reader would paste it.

`python -m longt5_jax...` lines of their shell code blocks are collected as a shell reads them.
Each must name a command whose flags parse: it is called in-process and stopped, before any work,
where its argparse parser returns or it hands its gin arguments on, which are then parsed as the
command would. `--help` and `--print_config` forms run for real. The pages' links must resolve.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path
from unittest import mock

import gin
import pytest

from longt5_jax import configuration

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOPICS = "training parallelism checkpoints data evaluation monitoring benchmarks architecture"
# The README's two set-up commands, which CI (.ci/run) and users copy as they are.
SET_UP = (
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python -m longt5_jax.train"
    " --gin_file=configs/demo.gin --gin.MODEL_DIR=\"'/tmp/demo'\"",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test,gpu]' && .venv/bin/python -m"
    " pytest -q",
)
SHELL = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)")
PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$|^\$\{?PYTHON\}?$")
SEPARATORS = {"&&", "||", ";", "|"}
# What may come before `python` on a command line: environment assignments, launchers and their
# options (`XLA_FLAGS=... srun --ntasks=2 python -m ...`).
LEADING = re.compile(r"^(\w+=.*|-.*|\d+|srun|mpirun|env|time|nohup|exec|timeout|numactl)$")
QUICK = {"--help", "-h", "--print_config"}
MEASURED_BY = re.compile(r"^Measured by `(?P<command>[^`]+)`", re.MULTILINE)
SCRIPT = re.compile(r"^\s*(\w+=\S*\s+)*(bash|sh|sbatch)\s")


Command = collections.namedtuple("Command", "where module argv")  # where: page:line


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line of the shell code blocks, `\\` continuations joined,
    the fence's indentation removed (a block inside a list item is indented)."""
    found, fence, start, parts = [], None, None, []
    for number, line in enumerate(text.splitlines(), start=1):
        if fence is None:
            opened = FENCE.match(line)
            fence = opened and (opened.group(3).lower() in SHELL, len(opened.group(1)))
        elif line.strip() in ("```", "~~~"):
            fence = None
        elif fence[0]:
            line = (line if line[: fence[1]].strip() else line[fence[1] :]).rstrip()
            start = number if start is None else start
            if line.endswith("\\") and not line.lstrip().startswith("#"):
                parts.append(line[:-1])
                continue
            found.append((start, " ".join([*parts, line])))
            start, parts = None, []
    return found


def commands_in(line: str) -> list[tuple[str, list[str]]]:
    """(module, arguments) of each `python -m longt5_jax...` in a shell line."""
    found, segment = [], []
    for token in [*shlex.split(line, comments=True), ";"]:
        if token not in SEPARATORS:
            segment.append(token)
            continue
        for i, word in enumerate(segment[:-2]):
            if PYTHON.search(word) and segment[i + 1] == "-m":
                if segment[i + 2].startswith("longt5_jax"):
                    found.append((segment[i + 2], segment[i + 3 :]))
                break
            if not LEADING.match(word):  # prose in a block, not a command line
                break
        segment = []
    return found


def page_commands(page: Path) -> list[Command]:
    """The commands of a page's shell blocks, and of each results table's `Measured by` line
    (what reran it must still parse)."""
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    text = page.read_text()
    measured = [
        (text.count("\n", 0, m.start()) + 1, m["command"]) for m in MEASURED_BY.finditer(text)
    ]
    return [
        Command(f"{name}:{number}", module, argv)
        for number, line in shell_lines(text) + measured
        if "longt5_jax" in line and "-m" in line
        for module, argv in commands_in(line)
    ]


def all_commands() -> list[Command]:
    """Every page's commands; a launcher's training arguments (after `--`) are one more."""
    commands = [c for page in PAGES for c in page_commands(page)]
    return commands + [
        Command(c.where, "longt5_jax.train", c.argv[c.argv.index("--") + 1 :])
        for c in commands
        if c.module == "longt5_jax.launch.local" and "--" in c.argv
    ]


COMMANDS = all_commands()


class Parsed(BaseException):
    """Raised where a command has parsed its arguments (no `except Exception` catches it)."""

    def __init__(self, gin_args: list[str] | None = None, error: str | None = None, **from_args):
        super().__init__()
        self.gin_args, self.error, self.from_args = gin_args, error, from_args


@contextlib.contextmanager
def stop_when_parsed():
    """`Parsed` is raised where the outermost `parse_args` or `parse_known_args` returns (what
    the latter leaves over is gin arguments), or at `configuration.from_args`, or, for a command
    that went past that, at `configuration.parse`."""
    depth = [0]

    def stopping(original, leftover):
        def parse(self, *args, **kwargs):
            self.allow_abbrev = False  # a page spells flags out: `--case` is no `--cases`
            depth[0] += 1  # an error ends the check: no need to count back
            result = original(self, *args, **kwargs)
            depth[0] -= 1
            if depth[0]:
                return result
            raise Parsed(result[1] if leftover else None)

        return parse

    def from_args(argv, sections=None, **kwargs):
        raise Parsed(list(argv), sections=sections, **kwargs)

    def parse(*args, **kwargs):  # reached past from_args: stop before any work all the same
        raise Parsed(error="it parses gin outside configuration.from_args")

    parser = argparse.ArgumentParser
    with (
        mock.patch.object(parser, "parse_args", stopping(parser.parse_args, False)),
        mock.patch.object(parser, "parse_known_args", stopping(parser.parse_known_args, True)),
        mock.patch.object(configuration, "from_args", from_args),
        mock.patch.object(configuration, "parse", parse),
    ):
        yield


def command_main(module: str):
    """The `main` that `python -m module` runs (a package's `__main__`)."""
    spec = importlib.util.find_spec(module)
    if spec and spec.submodule_search_locations is not None:  # a package: its __main__ runs
        module += ".__main__"
        spec = importlib.util.find_spec(module)
    main = spec and getattr(importlib.import_module(module), "main", None)
    if not callable(main):
        raise LookupError(f"{module}: no such module, or it has no main")
    return main


def run_until_parsed(main, argv: list[str]) -> Parsed | str | None:
    """Where the command stopped having parsed `argv`; None after `--help`; or why not."""
    err = io.StringIO()
    with (
        stop_when_parsed(),
        contextlib.chdir(ROOT),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(err),
    ):
        try:
            status = main(argv)
        except Parsed as parsed:
            return parsed
        except SystemExit as e:  # --help
            return None if e.code in (0, None) else f"exit {e.code}: {err.getvalue().strip()}"
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return f"exit {status}: {err.getvalue().strip()}" if status else "it ran without parsing"


def check_command(module: str, argv: list[str]) -> str | None:
    """Why the command as shown would not start (None: it parses)."""
    try:
        main = command_main(module)
    except (LookupError, ImportError) as e:
        return str(e)
    elided = "..." in argv  # the page left arguments out
    outcome = run_until_parsed(main, [a for a in argv if a != "..."])
    if not isinstance(outcome, Parsed):
        return outcome
    if outcome.error or outcome.gin_args is None:
        return outcome.error
    # Left over by a command's parser: it binds MODEL_DIR itself (evaluate: the checkpoint's).
    kwargs = outcome.from_args or {"preset": ["MODEL_DIR = '/run'"]}
    with contextlib.chdir(ROOT):
        return check_gin(outcome.gin_args, elided=elided, **kwargs)


def binding_error(binding: str) -> str | None:
    """A binding's name that is no configurable field and no macro of the configs/ tree."""
    name = binding.split("=", 1)[0].strip().rsplit("/", 1)[-1]
    if "." not in name:
        texts = [p.read_text() for p in (ROOT / "configs").rglob("*.gin")]
        used = any(re.search(rf"%{re.escape(name)}\b", text) for text in texts)
        return None if used else f"--gin.{name}: no gin file uses the macro {name}"
    owner, field = name.rsplit(".", 1)
    classes = {cls.__name__: cls for cls in configuration.SECTIONS.values()}
    if owner not in classes:
        return f"--gin.{name}: no configurable {owner} (expected one of {', '.join(classes)})"
    if field not in {f.name for f in dataclasses.fields(classes[owner])}:
        return f"--gin.{name}: {owner} has no field {field}"
    return None


def check_gin(argv, elided=False, sections=None, flags=(), preset=(), file_required=""):
    """Gin arguments parsed as `configuration.from_args` parses them, and the `sections` built
    (a command's record of sections; None: those the arguments bind). None, or what is wrong."""
    files, bindings, rest = configuration.split_gin_args(argv)
    errors = [f"unknown argument {a}" for a in rest if a not in flags]
    errors += [file_required] if file_required and not files else []
    errors += [e for e in map(binding_error, bindings) if e]
    if errors or any(f.startswith("/") or "$" in f for f in files):
        return errors[0] if errors else None  # a run's own config.gin: binding names checked
    try:
        configuration.parse(files, [*preset, *bindings])
        classes = configuration.SECTIONS.values()
        if sections is not None:
            classes = configuration.section_types(sections).values()
        for cls in classes:
            if sections is not None or gin.get_bindings(cls):
                configuration.build(cls)
    except configuration.ConfigError as e:
        if elided and "is required" in str(e):
            return None  # the value is among the arguments the page left out
        return str(e)
    return None


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def headings(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        in_code ^= bool(FENCE.match(line))
        if not in_code and line.startswith("#"):
            found.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return found


def broken_links(page: Path) -> list[str]:
    """Relative links to no file, or to a heading the page does not have."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        stale = anchor and resolved.suffix == ".md" and anchor not in headings(resolved)
        if not resolved.exists() or stale:
            broken.append(target)
    return broken


def scripts_run(page: Path) -> list[str]:
    """The repository's scripts a page's commands run (`bash X`, `sbatch ... X`)."""
    lines = [line for _, line in shell_lines(page.read_text()) if SCRIPT.match(line)]
    return [[w for w in shlex.split(line, True) if not LEADING.match(w)][1] for line in lines]


def test_the_readme_is_a_front_door_to_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    for topic in TOPICS.split():
        assert (ROOT / "docs" / f"{topic}.md").is_file(), topic
        assert f"(docs/{topic}.md" in readme, f"README.md does not link docs/{topic}.md"
    for command in SET_UP:  # as CI and users copy them
        assert command in readme.splitlines(), command
    shown = {c.module for c in COMMANDS}
    for module in ("train", "evaluate", "predict", "ckpt", "plan", "bench", "launch.local"):
        assert f"longt5_jax.{module}" in shown, module


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_scripts_resolve(page):
    assert broken_links(page) == []
    assert [s for s in scripts_run(page) if not (ROOT / s).is_file()] == []


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.where}:{c.module}")
def test_every_command_shown_exists_and_parses(command):
    error = check_command(command.module, command.argv)
    shown = shlex.join(["python", "-m", command.module, *command.argv])
    assert error is None, f"{command.where}: {shown}: {error}"


RUNS = [c for c in COMMANDS if QUICK & set(c.argv)] + [
    # Reading the embedded data set and training or loading its tokenizer: 5-10 s each.
    pytest.param(c, marks=pytest.mark.slow)
    for c in COMMANDS
    if c.module == "longt5_jax.data_preview"
]


@pytest.mark.parametrize("command", RUNS, ids=lambda c: c.where)
def test_the_quick_commands_run(command, capsys):
    """`--help`, `--print_config` and data previews, run for real in this process."""
    with contextlib.chdir(ROOT):
        try:
            status = command_main(command.module)(command.argv)
        except SystemExit as e:  # --help
            status = e.code or 0
    out, err = capsys.readouterr()
    assert status == 0 and out.strip(), f"{command.where}: exit {status}: {err}"


FAKE_PAGE = """Inline `python -m longt5_jax.train` is no command. [ok](other.md#a-heading-here)
[gone](missing.md) [bad anchor](other.md#nowhere) [web](https://example.com) ![image](x.png)
```bash
# a comment: python -m longt5_jax.nonesuch
XLA_FLAGS=--xla_dump_to=/tmp/x .venv/bin/python -m longt5_jax.train --gin_file=configs/demo.gin \\
    --gin.MODEL_DIR="'/tmp/x'"   # trailing comment
cd /tmp && srun --ntasks=2 python3 -m longt5_jax.ckpt ls /tmp/x
```
```
plan/    python -m longt5_jax.plan: targets, compile-ahead
$PYTHON -m longt5_jax.bench data
sbatch --ntasks=2 launch/slurm/train.sbatch
```
```python
print("python -m longt5_jax.demo")
```
"""


def test_commands_links_and_scripts_are_found_as_a_reader_meets_them(tmp_path):
    (tmp_path / "other.md").write_text("# A `Heading`, here\n")
    page = tmp_path / "page.md"
    page.write_text(FAKE_PAGE)
    assert [(c.module, c.argv) for c in page_commands(page)] == [
        ("longt5_jax.train", ["--gin_file=configs/demo.gin", "--gin.MODEL_DIR='/tmp/x'"]),
        ("longt5_jax.ckpt", ["ls", "/tmp/x"]),
        ("longt5_jax.bench", ["data"]),
    ]
    assert broken_links(page) == ["missing.md", "other.md#nowhere"]
    assert scripts_run(page) == ["launch/slurm/train.sbatch"]


# What the checker must refuse: `python -m longt5_jax.<this>`.
BROKEN = {
    "an unknown flag": "predict --checkpoint=c --input=i --output=o --beams=4",
    "a missing required flag": "predict --checkpoint=c --input=i",
    "an unknown module": "nonesuch",
    "a module that is no command": "model",
    "an unknown benchmark": "bench sped",
    "a benchmark's flag abbreviated": "bench device --case base:4096:1:full",
    "an unknown ckpt command": "ckpt list /tmp/x",
    "a train flag misspelt": "train --gin_file=configs/demo.gin --printconfig",
    "a missing gin file": "train --gin_file=configs/dmeo.gin",
    "an unknown configurable": "train --gin_file=configs/demo.gin --gin.X.y=1",
    "an unknown field": "train --gin_file=configs/demo.gin --gin.RunConfig.steps=1",
    "an unknown macro": "train --gin_file=configs/demo.gin --gin.ZERO_STAGES=1",
    "an ill-typed value": "train --gin_file=configs/demo.gin --gin.MODEL_DIR=1",
    "no MODEL_DIR": "train --gin_file=configs/demo.gin",
    "beside a run's config": "evaluate --gin_file=/r/c.gin --checkpoint=/r --gin.DecodeConfig.b=4",
    "an ill-typed preview": "data_preview --gin_file=configs/demo.gin --gin.DataConfig.pack=1",
}


@pytest.mark.parametrize("case", BROKEN)
def test_the_checker_catches(case):
    module, *argv = shlex.split(BROKEN[case])
    assert check_command(f"longt5_jax.{module}", argv) is not None


def test_the_checker_passes_what_a_page_elides():
    argv = ["--gin_file=configs/runs/finetune.gin", "...", "--gin.INIT_FROM='/ckpt'"]
    assert check_command("longt5_jax.train", argv) is None
    assert check_command("longt5_jax.train", argv[:1] + argv[2:]) is not None  # MODEL_DIR


def test_a_command_is_stopped_before_its_work_in_any_case():
    real_from_args = configuration.from_args

    def past_from_args(argv):  # bound before the checker could patch it
        real_from_args(argv, configuration.Experiment)
        raise AssertionError("the work ran")

    argv = ["--gin_file=configs/demo.gin", "--gin.MODEL_DIR='/tmp/x'"]
    outcome = run_until_parsed(past_from_args, argv)
    assert isinstance(outcome, Parsed) and "outside configuration.from_args" in outcome.error
    assert run_until_parsed(lambda argv: 0, []) == "it ran without parsing"


def test_the_readme_measures_in_a_few_lines_and_points_to_the_results():
    readme = (ROOT / "README.md").read_text()
    measured = readme.split("## Measured\n", 1)[1].split("\n## ", 1)[0]
    assert len(measured.strip().splitlines()) <= 25
    assert "(docs/benchmarks.md)" in measured and "(docs/journal.md)" in measured
