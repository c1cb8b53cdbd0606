"""Record sources: random-access {"inputs", "targets"} examples from JSONL, Parquet and ArrayRecord.

A source is a grain random-access data source (`__len__`, `__getitem__`, `__repr__`). Grain worker
processes receive it pickled, so file handles and tables are opened lazily in each process and
never pickled. Bad input becomes one `DataError` line naming the file and the place in it: a
1-based line for JSONL, a 0-based row for Parquet, a 0-based record for ArrayRecord.
"""

from __future__ import annotations

import array
import bisect
import glob
import itertools
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from array_record.python import array_record_module
from grain.sources import ArrayRecordDataSource

from longt5_jax.data import DataError
from longt5_jax.data.compressed import plain_jsonl

log = logging.getLogger(__name__)

Example = dict[str, str]
Paths = str | os.PathLike | Sequence[str | os.PathLike]
FORMATS = ("jsonl", "parquet", "array_record")
_EXTENSIONS = dict.fromkeys([".jsonl", ".jsonl.gz", ".jsonl.zst", ".json"], "jsonl") | {
    ".parquet": "parquet",
    ".array_record": "array_record",
    ".arrayrecord": "array_record",
}


class _Problem(Exception):
    """What is wrong with one record, before the file and line are known."""


def _describe(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _parse_record(raw: bytes, fields: tuple[str, str]) -> Example:
    """Decodes one UTF-8 JSON record into an example, raising _Problem if it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Problem(f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})") from e
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Problem(f"not valid JSON ({e.msg} at column {e.pos + 1})") from e
    if not isinstance(record, dict):
        raise _Problem(f"not a JSON object (got {_describe(record)})")
    for field in fields:
        if field not in record:
            raise _Problem(f"field {field!r} missing (fields: {', '.join(record) or 'none'})")
        if not isinstance(record[field], str):
            raise _Problem(f"field {field!r} is {_describe(record[field])}, expected a string")
        if not record[field].strip():
            raise _Problem(f"field {field!r} is empty")
    return {"inputs": record[fields[0]], "targets": record[fields[1]]}


class _BadRecords:
    """Skips bad records up to a cap, warning about each; raises on the first one past the cap."""

    def __init__(self, cap: int):
        if cap < 0:
            raise DataError(f"skip_bad_records must be >= 0, got {cap}")
        self.cap = cap
        self.count = 0

    def report(self, where: str, problem: str) -> None:
        message = f"{where}: {problem}"
        if self.cap == 0:
            raise DataError(message)
        self.count += 1
        if self.count > self.cap:
            raise DataError(f"{message}; more than {self.cap} bad records; stopping")
        log.warning("skipping bad record: %s", message)


def _as_list(paths: Paths) -> list[str]:
    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not paths:
        raise DataError("no input files given")
    return [os.fspath(p) for p in paths]


def _require_file(path: str) -> None:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")


class _MultiFileSource:
    """Indexing across files in order, a short repr, and pickling without per-process state."""

    _paths: list[str]
    _fields: tuple[str, str]
    _ends: list[int]  # cumulative record counts, one per file
    _open: dict[int, Any]  # per-process handles by file number; rebuilt lazily after unpickling

    def _start(self, paths: Paths, input_field: str, target_field: str) -> None:
        """The state every source shares: its files, its two fields, no handles yet."""
        self._paths = _as_list(paths)
        self._fields = (input_field, target_field)
        self._open = {}

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _locate(self, index: int) -> tuple[int, int]:
        """Returns (file number, record number within that file) for a global index."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"{type(self).__name__}: index {index} out of range ({n} records)")
        index %= n
        file = bisect.bisect_right(self._ends, index)
        return file, index - (self._ends[file - 1] if file else 0)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": {}}

    def __repr__(self) -> str:
        shown = self._paths if len(self._paths) <= 2 else [self._paths[0], "...", self._paths[-1]]
        return (
            f"{type(self).__name__}(paths=[{', '.join(shown)}] ({len(self._paths)} files), "
            f"fields={self._fields}, records={len(self)})"
        )


Stamp = tuple[int, int, int]  # (inode, size, modification time in ns) of a file as scanned


def _stamp(f: Any) -> Stamp:
    st = os.fstat(f.fileno())
    return st.st_ino, st.st_size, st.st_mtime_ns


def _scan_jsonl(
    plain: str, shown: str, fields: tuple[str, str], bad: _BadRecords
) -> tuple[np.ndarray, Stamp]:
    """Validates every line; returns the [start, end) byte span of each good one, shape [N, 2],
    and the file's stamp, which every later read checks."""
    spans = array.array("q")  # compact while scanning millions of lines
    end = 0
    with open(plain, "rb") as f:
        stamp = _stamp(f)
        for number, line in enumerate(f, start=1):
            start, end = end, end + len(line)
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are layout, not records
            try:
                _parse_record(line, fields)
            except _Problem as e:
                bad.report(f"{shown}:{number}", str(e))
            else:
                spans.extend((start, end))
        if _stamp(f) != stamp:
            raise DataError(_changed(shown, stamp, _stamp(f), "while it was scanned"))
    return np.frombuffer(spans, dtype=np.int64).reshape(-1, 2), stamp


def _changed(shown: str, was: Stamp, now: Stamp | None, when: str) -> str:
    """The one line for a data file that is no longer the one whose records were indexed."""
    if now is None:
        what = "it is gone"
    elif now[0] != was[0]:
        what = "another file replaced it"
    elif now[1] != was[1]:
        what = f"{now[1]:,} bytes, {was[1]:,} when indexed"
    else:
        what = "rewritten in place"
    return (
        f"{shown}: changed {when} ({what}); a data file must stay as it is while it is read: "
        "restore it and rerun (a training run resumes from its last checkpoint)"
    )


class JsonlSource(_MultiFileSource):
    """JSON-lines files (plain, .gz or .zst), validated once and read by byte offset."""

    def __init__(
        self,
        paths: Paths,
        input_field: str = "article",
        target_field: str = "abstract",
        skip_bad_records: int = 0,
    ):
        self._start(paths, input_field, target_field)
        bad = _BadRecords(skip_bad_records)
        self._plain, self._spans, self._stamps = [], [], []
        for path in self._paths:
            _require_file(path)
            self._plain.append(plain_jsonl(path))
            spans, stamp = _scan_jsonl(self._plain[-1], path, self._fields, bad)
            self._spans.append(spans)
            self._stamps.append(stamp)
        self._ends = list(itertools.accumulate(len(s) for s in self._spans))

    def __getitem__(self, index: int) -> Example:
        file, local = self._locate(index)
        f = self._file(file)
        start, end = (int(x) for x in self._spans[file][local])
        # pread, not a memory map: a mapped file that shrinks kills the reader with SIGBUS at
        # the first page past its new end, with nothing said. pread takes no file position, so
        # a handle a forked worker inherits stays correct. The stamp, checked after the read,
        # catches a file truncated, rewritten or replaced since it was scanned.
        raw = os.pread(f.fileno(), end - start, start)
        now = _stamp(f)
        if len(raw) != end - start or now != self._stamps[file]:
            raise self._changed(file, now)
        return _parse_record(raw, self._fields)

    def _file(self, file: int) -> Any:
        """This process's handle on a file, opened on first use, held while the source lives."""
        if file not in self._open:
            try:
                self._open[file] = open(self._plain[file], "rb", buffering=0)  # noqa: SIM115
            except FileNotFoundError:
                raise self._changed(file, None) from None
        return self._open[file]

    def _changed(self, file: int, now: Stamp | None) -> DataError:
        path, plain = self._paths[file], self._plain[file]
        shown = path if plain == path else f"{path} (decompressed as {plain})"
        return DataError(_changed(shown, self._stamps[file], now, "during the run"))


def _read_parquet(path: str, fields: tuple[str, str]) -> pa.Table:
    """Reads only the two text columns of one Parquet file, checking they exist and hold strings."""
    _require_file(path)
    try:
        with pq.ParquetFile(path) as parquet:
            names = parquet.schema_arrow.names
            for field in fields:
                if field not in names:
                    raise DataError(
                        f"{path}: column {field!r} missing (columns: {', '.join(names)})"
                    )
            table = parquet.read(columns=list(dict.fromkeys(fields)))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    for field in fields:
        kind = table.schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{path}: column {field!r} holds {kind}, expected strings")
    return table


def _good_rows(
    table: pa.Table, path: str, fields: tuple[str, str], bad: _BadRecords
) -> np.ndarray | None:
    """Reports null or blank rows; returns the indices of the good rows, or None if all are good."""
    null, blank = {}, {}
    for field in fields:
        column = table.column(field)
        null[field] = pc.is_null(column).to_numpy(zero_copy_only=False)
        stripped_length = pc.utf8_length(pc.utf8_trim_whitespace(column))
        blank[field] = pc.fill_null(pc.equal(stripped_length, 0), False).to_numpy(
            zero_copy_only=False
        )
    is_bad = np.logical_or.reduce([null[f] | blank[f] for f in fields])
    bad_rows = np.flatnonzero(is_bad)
    for row in bad_rows:
        field = next(f for f in fields if null[f][row] or blank[f][row])
        bad.report(
            f"{path}: row {row}", f"field {field!r} is {'null' if null[field][row] else 'empty'}"
        )
    return np.flatnonzero(~is_bad) if len(bad_rows) else None


class ParquetSource(_MultiFileSource):
    """Parquet files, of which only the two text columns are read.

    Each process holds those columns as Arrow tables: the text at about its own size, off the
    Python heap, with O(1) lookup. A corpus larger than memory should be converted to ArrayRecord
    (convert.py), which reads each record from disk on demand.
    """

    def __init__(
        self,
        paths: Paths,
        input_field: str = "article",
        target_field: str = "abstract",
        skip_bad_records: int = 0,
    ):
        self._start(paths, input_field, target_field)
        bad = _BadRecords(skip_bad_records)
        self._rows, counts = [], []
        for file, path in enumerate(self._paths):
            table = self._open[file] = _read_parquet(path, self._fields)
            self._rows.append(_good_rows(table, path, self._fields, bad))
            counts.append(table.num_rows if self._rows[-1] is None else len(self._rows[-1]))
        self._ends = list(itertools.accumulate(counts))

    def __getitem__(self, index: int) -> Example:
        file, local = self._locate(index)
        if file not in self._open:
            self._open[file] = _read_parquet(self._paths[file], self._fields)
        rows = self._rows[file]
        row = local if rows is None else int(rows[local])
        table = self._open[file]
        inputs, targets = (table.column(field)[row].as_py() for field in self._fields)
        return {"inputs": inputs, "targets": targets}


def _count_array_records(path: str) -> int:
    _require_file(path)
    try:
        reader = array_record_module.ArrayRecordReader(path)
        try:
            return reader.num_records()
        finally:
            reader.close()
    except RuntimeError as e:  # a truncated file's reader fails with an empty message
        why = str(e).strip().splitlines()[0] if str(e).strip() else "truncated or corrupt"
        raise DataError(f"{path}: not a readable ArrayRecord file ({why})") from None


class ArrayRecordSource(_MultiFileSource):
    """ArrayRecord files (from convert.py) whose records are UTF-8 JSON objects with both fields."""

    def __init__(self, paths: Paths, input_field: str = "article", target_field: str = "abstract"):
        self._start(paths, input_field, target_field)
        # Counting opens each file once here, so a missing or corrupt one is named up front.
        self._ends = list(itertools.accumulate(_count_array_records(p) for p in self._paths))
        self._records = ArrayRecordDataSource(self._paths)  # opens readers lazily, pickles cleanly

    def __getitem__(self, index: int) -> Example:
        file, local = self._locate(index)
        where = f"{self._paths[file]}: record {local}"
        try:
            raw = self._records[index % len(self)]
        except RuntimeError as e:
            raise DataError(f"{where}: cannot read ({e or 'corrupt data'})") from e
        try:
            return _parse_record(raw, self._fields)
        except _Problem as e:
            raise DataError(f"{where}: {e}") from None


def expand(paths: Paths) -> list[str]:
    """Expands each glob pattern (sorted), keeping the patterns' order."""
    files = []
    for pattern in _as_list(paths):
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            raise DataError(f"no files match {pattern!r}")
        files.extend(matches)
    return files


def _infer_format(files: Sequence[str]) -> str:
    formats: dict[str, str] = {}  # format -> its first file
    for path in files:
        name = path.lower()
        ext = next((e for e in _EXTENSIONS if name.endswith(e)), None)
        if ext is None:
            known = ", ".join(_EXTENSIONS)
            raise DataError(f"{path}: unknown extension (expected one of {known}, or a format)")
        formats.setdefault(_EXTENSIONS[ext], path)
    if len(formats) > 1:
        mixed = ", ".join(f"{p} is {f}" for f, p in formats.items())
        raise DataError(f"mixed formats ({mixed}); open each format separately")
    return next(iter(formats))


def open_source(
    paths: Paths,
    input_field: str = "article",
    target_field: str = "abstract",
    skip_bad_records: int = 0,
    format: str | None = None,
) -> JsonlSource | ParquetSource | ArrayRecordSource:
    """Opens files (glob patterns allowed) as one source, inferring the format from extensions."""
    files = expand(paths)
    fmt = format or _infer_format(files)
    source: JsonlSource | ParquetSource | ArrayRecordSource
    if fmt == "jsonl":
        source = JsonlSource(files, input_field, target_field, skip_bad_records)
    elif fmt == "parquet":
        source = ParquetSource(files, input_field, target_field, skip_bad_records)
    elif fmt == "array_record":  # no skip_bad_records: convert.py wrote only valid records
        source = ArrayRecordSource(files, input_field, target_field)
    else:
        raise DataError(f"unknown format {fmt!r} (formats: {', '.join(FORMATS)})")
    if not len(source):  # a stream over no records would end before its first batch
        shown = files[0] if len(files) == 1 else f"{files[0]} ... ({len(files)} files)"
        raise DataError(f"{shown}: no records")
    return source
