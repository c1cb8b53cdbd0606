"""The one boundary every command crosses.

Bad input the user can fix (a `UsageError`, a `ValueError` raised by this package, a file that is
missing, is a directory or cannot be read) ends as one line on stderr, `error: ...` naming the
file, field or value, and exit 2. A run that stops on a fault of its own (a `RunFault`: a full
disk, a loss gone NaN, the data run out) says so in one line and exits 1. Anything else is a bug:
its traceback is kept and the exit is 1.
Third-party noise that would follow a one-line error (orbax's and absl's log lines, asyncio's
"Task exception was never retrieved", jax's CUDA-plugin traceback on a machine without a GPU) is
cut down or silenced before any of it starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import traceback
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from longt5_jax import environment
from longt5_jax.errors import RunFault, UsageError
from longt5_jax.estimate import targets

_PACKAGE = str(Path(__file__).resolve().parent)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`prog: message`, exit 2 through `run`) instead of a
    usage block; `--help` is unchanged. `settle(args)`, where given, completes or refuses what
    one flag means given another (a dtype the target decides), once parsed."""

    def __init__(self, *args: Any, settle: Callable[[argparse.Namespace], None] | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.settle = settle

    def parse_known_args(self, *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
        parsed, rest = super().parse_known_args(*args, **kwargs)
        if self.settle is not None:
            self.settle(parsed)
        return parsed, rest

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"{self.prog}: {message} (see --help)")


N = typing.TypeVar("N", int, float)


def _number(convert: Callable[[str], N], holds: Callable[[N], bool],
            expected: str) -> Callable[[str], N]:  # fmt: skip
    """An argparse type: `convert(text)` where `holds` of it; else one line, 'expected ...'."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not holds(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


positive = _number(int, lambda v: v >= 1, "an integer >= 1")
nonnegative = _number(int, lambda v: v >= 0, "an integer >= 0")  # a flag whose 0 means none
rate = _number(float, lambda v: v > 0, "a number > 0")  # a FLOP rate, a bandwidth
fraction = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")  # an MFU


def add_cluster_arguments(
    parser: argparse.ArgumentParser, cpu: bool = False, nodes: int | list[int] = 8, help: str = ""
) -> None:
    """--target, --nodes and --gpus_per_node, as every command that compiles ahead takes them
    (--nodes a list of node counts where `nodes` is one)."""
    parser.add_argument("--target", default="a100-80gb", help=help or targets.names_help(cpu))
    many: dict[str, Any] = {"nargs": "+"} if isinstance(nodes, list) else {}
    parser.add_argument("--nodes", type=positive, default=nodes, **many)
    parser.add_argument("--gpus_per_node", type=positive, default=4)


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--dtype, whose default the target decides (`settle_dtype` settles it once parsed)."""
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"],
        help="activation/matmul dtype (default: the target's half precision: bfloat16, float16 "
        "on a GPU without bfloat16)",
    )  # fmt: skip


def settle_dtype(args: argparse.Namespace) -> None:
    """An unset --dtype becomes the target's half precision; bfloat16 on a GPU without it is a
    one-line error. Every command compiling for a target parses with it (`ArgumentParser`'s
    `settle`), so commands sharing a parser (`bench cluster`, `bench scaling`) settle alike."""
    try:
        args.dtype = targets.load(args.target).dtype(args.dtype)
    except ValueError as e:
        raise UsageError(str(e)) from None


def out_dir(text: str) -> str:
    """An output directory that is one or can be made, checked before any work (a benchmark
    would find out after minutes of it)."""
    path = Path(text).absolute()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    ancestor = next(p for p in (path, *path.parents) if p.exists())
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"{text} cannot be made: {ancestor} is not a writable directory"
        )
    return text


def new_file(text: str) -> Path:
    """An argparse type: a file to write, whose directory exists; an existing directory is
    refused before any work starts."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, expected a file path")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path.parent} is not an existing directory")
    return path


# What `train` writes at the top of a MODEL_DIR (training/: checkpoint, metrics, run_lock,
# identity); no command's output may replace one of them or land inside one.
RUN_FILES = (
    "checkpoints",
    "config.gin",
    "metrics.jsonl",
    "tensorboard",
    "profile",
    "train.lock",
    "run.json",
)
_RUN_MARKS = ("checkpoints", "train.lock", "run.json")  # a directory holding one is a MODEL_DIR
# (what the user called it: '--input', a path)
Named = tuple[str, "str | os.PathLike[str] | None"]


def _real(path: str | os.PathLike[str]) -> Path:
    """The path with `~`, `..` and every symlink resolved, absolute: two names of one file
    compare equal."""
    return Path(path).expanduser().resolve()


def _same(a: Path, b: Path) -> bool:
    """One file, also under two hard links."""
    try:
        return a == b or os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def _run_file(path: Path) -> tuple[Path, str] | None:
    """(MODEL_DIR, the run's file) where `path` replaces or lies inside a training run's file."""
    for parent in path.parents:
        first = path.relative_to(parent).parts[0]
        if first in RUN_FILES and any((parent / mark).exists() for mark in _RUN_MARKS):
            return parent, first
    return None


def check_outputs(
    outputs: Sequence[Named], inputs: Sequence[Named], checkpoints: Sequence[Named] = ()
) -> None:
    """Refuse, before any work, an output that is (or resolves to) one of the command's
    `inputs`, is or lies inside one of the `checkpoints` it reads (a checkpoint's directory is
    orbax's: a clean-up removes it whole, with whatever else was put in it), or would write
    over a file of a training run (a MODEL_DIR's checkpoints, config, metrics, lock or
    identity)."""
    for out_name, out in outputs:
        if out is None:
            continue
        target = _real(out)
        for in_name, source in [*inputs, *checkpoints]:
            if source is None:
                continue
            read = _real(source)
            inside = (in_name, source) in checkpoints and read in target.parents
            if _same(target, read) or inside:
                raise UsageError(
                    f"{out_name} {out} {'lies inside' if inside else 'is'} {in_name} {source}, "
                    "which this command reads: an output never replaces an input; choose "
                    "another path"
                )
        run = _run_file(target)
        if run is not None:
            how = "over" if target == run[0] / run[1] else "inside"
            raise UsageError(
                f"{out_name} {out} would write {how} {run[1]} of the training run in "
                f"MODEL_DIR={run[0]}; choose a path outside it"
            )


def _raised_here(e: BaseException) -> bool:
    """Whether `e` was raised by this package's own code (its innermost frame is ours)."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PACKAGE)


def one_line(e: BaseException) -> str | None:
    """The one line a known error is said in, or None for a bug (keep its traceback)."""
    if isinstance(e, OSError):  # a path that is missing, not a directory, not writable
        return f"{e.filename}: {e.strerror or e}" if e.filename is not None else str(e)
    # Third-party readers' errors for a bad file (Parquet, SentencePiece, gin) are turned into
    # ours where they are read, naming the file or binding.
    if isinstance(e, UsageError) or (isinstance(e, ValueError) and _raised_here(e)):
        return " ".join(str(e).split()) or type(e).__name__
    return environment.platform_failure(e)  # JAX_PLATFORMS naming a platform that is absent


class _PluginTraceback(logging.Filter):
    """jax logs a GPU plugin that cannot start with a traceback. Where no GPU driver answers at
    all (the `gpu` extra, which compiles GPU programs deviceless, on a CPU-only machine) there is
    nothing to fix and nothing is said; any other failure is said in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.exc_info and "plugin" in record.getMessage().lower()):
            return True
        reason = str(record.exc_info[1]).strip().splitlines()[0][:200]
        if "cuInit(0) failed" in reason:
            return False
        record.msg, record.args, record.exc_info = f"{record.getMessage()}: {reason}", (), None
        return True


def quiet_third_party() -> None:
    """Silence what other libraries print around a run's own output; call before jax starts."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's C++ INFO/WARNING lines
    logging.getLogger("jax._src.xla_bridge").addFilter(_PluginTraceback())
    for name in ("absl", "orbax", "asyncio"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # orbax logs each failure of its background threads (with tracebacks, through absl, each
    # line starting "[process=N]") and then raises it in the thread that waits for them, where
    # it is said in one line.
    logging.getLogger("absl").addFilter(lambda r: not str(r.msg).startswith("[process="))


def xla_flags_for_child(count: int = 0) -> str:
    """This process's XLA_FLAGS for a process it starts: the fake CPU device count is the
    child's own (`count`, 0: none set here), every other flag (dumps, compiler options)
    carries over."""
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    if count:
        flags += f" --xla_force_host_platform_device_count={count}"
    return " ".join(flags.split())


def run(
    main: Callable[[list[str]], int], argv: list[str] | None = None, *, preflight: bool = True
) -> int:
    """`main(argv)` behind the boundary; returns the exit status. `preflight`: the
    environment's start-up checks first (`environment.startup`: an XLA flag XLA would abort
    on is refused, an unwritable cache variable dropped with a warning); the doctor, which
    reports them instead, goes without."""
    quiet_third_party()
    try:
        if preflight:
            environment.startup()
        return main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RunFault as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        line = one_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
