"""Gin, T5X-style: `--gin_file` (repeatable) and `--gin.NAME=VALUE` bind a few typed dataclasses.

Only the dataclasses registered here are configurable. Errors come back as one line naming the
file or binding; values are checked against the dataclass field types. A command builds exactly
the sections it needs: `from_args(argv, Experiment)` every one, `from_args(argv, Record)` the
fields of its own frozen record, each built by its annotated type.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import tokenize
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path

import gin

from longt5_jax.errors import ConfigError
from longt5_jax.training.experiment import Experiment, Sections, section_types

T = typing.TypeVar("T")
S = typing.TypeVar("S", bound=Sections)

SECTIONS = section_types(Experiment)
CONFIGURABLE = {
    cls.__name__: gin.external_configurable(cls, name=cls.__name__) for cls in SECTIONS.values()
}
# Gin names that were renamed, old -> new, kept working for one release: a binding to the old
# name still applies and says once what to write instead. On the command line it is the new
# name's (so it wins over a file's, as any binding given there does); in a file, the new name's
# own bindings win.
RENAMED = {"MeshConfig": "ParallelConfig"}
for _old, _new in RENAMED.items():
    gin.external_configurable(next(c for c in SECTIONS.values() if c.__name__ == _new), name=_old)
_WARNED: set[str] = set()


_SEARCH_PATHS: list[str] = []


def split_gin_args(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(gin files, bindings, other args) from `--gin_file=F`/`--gin_file F` and `--gin.X=Y`."""
    files, bindings, rest = [], [], []
    args = iter(argv)
    for arg in args:
        if arg.startswith("--gin_file="):
            files.append(arg.split("=", 1)[1])
        elif arg == "--gin_file":
            files.append(next(args, ""))
        elif arg.startswith("--gin."):
            if "=" not in arg:
                raise ConfigError(f"{arg}: expected --gin.NAME=VALUE")
            name, value = arg[len("--gin.") :].split("=", 1)
            bindings.append(f"{name} = {value}")
        else:
            rest.append(arg)
    return files, bindings, rest


def parse(files: Sequence[str], bindings: Sequence[str] = ()) -> None:
    """Clear gin's state and apply `files` then `bindings`."""
    gin.clear_config()
    # `include 'configs/...'` resolves from the checkout root as well as the working directory.
    if not _SEARCH_PATHS:
        _SEARCH_PATHS.append(str(Path(__file__).resolve().parents[1]))
        gin.add_config_file_search_path(_SEARCH_PATHS[0])
    for f in files:
        if not Path(f).is_file():
            raise ConfigError(f"{f}: gin file not found")
    bindings = [_renamed_binding(b) for b in bindings]
    try:
        with _gin_logs_quiet():
            gin.parse_config_files_and_bindings(list(files), bindings)
    except (SyntaxError, tokenize.TokenError) as e:
        raise ConfigError(_unparsable(files, bindings, e)) from None
    except (ValueError, KeyError, OSError) as e:
        required = re.match(r"(\S+?)(/macro\.value)? set to `%gin\.REQUIRED`", str(e))
        if required:
            name = required.group(1)
            raise ConfigError(
                f"{name} is required: set it in a gin file or with --gin.{name}=VALUE"
            ) from None
        where = " ".join(line.strip() for line in str(e).splitlines()[1:])
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{first} ({where})" if where else first) from None


@contextlib.contextmanager
def _gin_logs_quiet() -> Iterator[None]:
    """gin logs a missing include on the root logger ('ERROR:root:Path not found: ...') before it
    raises the error said here in one line: its records are dropped, and a placeholder handler
    keeps `logging.error` from installing a stderr handler of its own on the way."""
    root, placeholder = logging.getLogger(), logging.NullHandler()
    root.addHandler(placeholder)
    root.addFilter(_not_gin)
    try:
        yield
    finally:
        root.removeFilter(_not_gin)
        root.removeHandler(placeholder)


def _not_gin(record: logging.LogRecord) -> bool:
    return not record.pathname.startswith(_GIN_DIR)


_GIN_DIR = str(Path(gin.__file__).parent)


def _renamed_binding(binding: str) -> str:
    """A command-line binding to a renamed gin name, made to the new name (said once)."""
    name = binding.split("=", 1)[0].strip()
    scope, _, selector = name.rpartition("/")
    old, _, field = selector.partition(".")
    if old not in RENAMED or not field:
        return binding
    new = RENAMED[old]
    _deprecated(old, new, field)
    return f"{scope + '/' if scope else ''}{new}.{field} ={binding.split('=', 1)[1]}"


def _deprecated(old: str, new: str, field: str) -> None:
    if old not in _WARNED:
        _WARNED.add(old)
        print(
            f"warning: {old}.{field}: the gin name {old} is deprecated, write {new}.{field} "
            "(the old name works for this release only)",
            file=sys.stderr,
        )


def _unparsable(files: Sequence[str], bindings: Sequence[str], error: Exception) -> str:
    """The binding or file (and line) that is not gin. gin's error names the file and line where
    one is given; where not, each is parsed alone (a binding's unclosed bracket reads as the end
    of a multi-line statement, and an unclosed bracket at a file's end names neither)."""
    where = getattr(error, "filename", None)
    if isinstance(error, SyntaxError) and where and Path(where).is_file():
        return f"{where}, line {error.lineno}: not valid gin ({error.msg})"
    delegate = gin.config.ParserDelegate(skip_unknown=True)
    texts = [(f"--gin.{b.replace(' = ', '=', 1)}", b, False) for b in bindings]
    texts += [(f, Path(f).read_text(), True) for f in files]
    for name, text, is_file in texts:
        try:
            list(gin.config_parser.ConfigParser(text, delegate))
        except (SyntaxError, tokenize.TokenError) as e:
            reason, line = (e.msg, e.lineno) if isinstance(e, SyntaxError) else e.args
            if isinstance(line, tuple):  # tokenize's (line, column)
                line = line[0]
            return f"{name}{f', line {line}' if is_file else ''}: not valid gin ({reason})"
    return f"not valid gin ({error})"


def from_args(
    argv: Sequence[str],
    sections: type[S],
    *,
    flags: Sequence[str] = (),
    preset: Sequence[str] = (),
    file_required: str = "",
) -> tuple[S, set[str]]:
    """The gin front end of every command: `--gin_file`s and `--gin.NAME=VALUE`s from `argv`
    (besides the bare `flags` it allows), parsed with the `preset` bindings first (a command's
    own values, which the user's bindings still override), and each field of the `sections`
    record built by its type. Returns the record and the flags given; `file_required` is the
    error when no gin file is given."""
    files, bindings, rest = split_gin_args(argv)
    unknown = [a for a in rest if a not in flags]
    if unknown:
        allowed = ", ".join(["--gin_file", "--gin.NAME=VALUE", *flags])
        raise ConfigError(f"unknown arguments {unknown}: expected {allowed}")
    if file_required and not files:
        raise ConfigError(file_required)
    parse(files, [*preset, *bindings])
    built: dict[str, object] = {name: build(cls) for name, cls in section_types(sections).items()}
    return sections(**built), set(rest)


def build(cls: type[T]) -> T:
    """An instance of a registered dataclass from the parsed bindings, each checked by type."""
    hints = typing.get_type_hints(cls)
    own = gin.get_bindings(cls.__name__)
    old = _renamed_bindings(cls.__name__, set(own))
    for field, value in {**own, **old}.items():
        hint = hints.get(field)
        if hint is not None and not _matches(value, hint):
            raise ConfigError(
                f"{cls.__name__}.{field} = {value!r}: expected {_expected(hint, value)}"
            )
    try:
        built = CONFIGURABLE[cls.__name__](**old)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(" ".join(str(e).split())) from None
    if not isinstance(built, cls):
        raise TypeError(f"{cls.__name__} is not a configurable section")
    return built


def _renamed_bindings(name: str, bound: set[str]) -> dict[str, typing.Any]:
    """The bindings still made to `name`'s old gin name (those the new name leaves unset), each
    old name said once on stderr with what to write instead."""
    found: dict[str, typing.Any] = {}
    for old in (o for o, new in RENAMED.items() if new == name):
        legacy = gin.get_bindings(old)
        if legacy:
            _deprecated(old, name, next(iter(legacy)))
        found |= {k: v for k, v in legacy.items() if k not in bound}
    return found


def _matches(value: typing.Any, hint: typing.Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    # `tuple[X, ...]`: a gin list, ['a', 'b'], or one value alone (the dataclass makes either
    # its tuple).
    if origin is tuple:
        if isinstance(value, str) and "," in value:  # the comma-joined string files once were
            return False
        items = value if isinstance(value, list | tuple) else [value]
        return all(_matches(item, typing.get_args(hint)[0]) for item in items)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _expected(hint: typing.Any, value: typing.Any) -> str:
    """What a field takes; for a list given as one comma-joined string, the list to write."""
    if typing.get_origin(hint) is tuple and isinstance(value, str) and "," in value:
        return f"{_describe(hint)}: write {[v.strip() for v in value.split(',')]!r}"
    return _describe(hint)


def _describe(hint: typing.Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    return "None" if hint is type(None) else hint.__name__


def bound(name: str) -> dict[str, typing.Any]:
    """The values the parsed gin files and bindings give the fields of the configurable `name`
    (macros resolved), whether or not the command builds it."""
    try:
        found: dict[str, typing.Any] = gin.get_bindings(name)
        return found
    except (ValueError, KeyError) as e:  # an unresolvable reference: said where it is built
        raise ConfigError(" ".join(str(e).split())) from None


def operative_config() -> str:
    return str(gin.operative_config_str())
