"""Record sources (JSONL, Parquet, ArrayRecord), the embedded ACLSum task and the convert CLI."""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
import pickle
import re
import statistics
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from array_record.python import array_record_module

from longt5_jax import data_convert as convert
from longt5_jax.data.aclsum import SPLITS, _load_split, aclsum_source
from longt5_jax.data.sources import (
    ArrayRecordSource,
    DataError,
    JsonlSource,
    ParquetSource,
    open_source,
)

RECORDS = [
    {"id": i, "article": f"document {i}: café ünïcode {'word ' * i}", "abstract": f"summary {i}"}
    for i in range(7)
]
EXPECTED = [{"inputs": r["article"], "targets": r["abstract"]} for r in RECORDS]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("LONGT5_JAX_CACHE", str(cache))
    return cache


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def _write(path: Path, records: list[dict]) -> Path:
    """Writes records in the format the file name says."""
    name = path.name
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=3)
    elif name.endswith(".gz"):
        path.write_bytes(gzip.compress(_jsonl(records)))
    elif name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(_jsonl(records)))
    elif name.endswith((".array_record", ".arrayrecord")):
        writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
        for record in records:
            writer.write(json.dumps(record).encode())
        writer.close()
    else:
        path.write_bytes(_jsonl(records))
    return path


def _read_all(source) -> list[dict[str, str]]:
    return [source[i] for i in range(len(source))]


FORMATS = [
    ".jsonl",
    ".json",
    ".jsonl.gz",
    ".jsonl.zst",
    ".parquet",
    ".array_record",
    ".arrayrecord",
]


@pytest.mark.parametrize("ext", FORMATS)
def test_each_format_reads_back_records_in_order(tmp_path: Path, ext: str) -> None:
    source = open_source(str(_write(tmp_path / f"data{ext}", RECORDS)))
    assert _read_all(source) == EXPECTED
    assert source[-1] == EXPECTED[-1]
    assert f"records={len(RECORDS)}" in repr(source)
    with pytest.raises(IndexError):
        source[len(RECORDS)]


@pytest.mark.parametrize("ext", [".jsonl", ".jsonl.zst", ".parquet", ".array_record"])
def test_multiple_files_index_across_files_in_order(tmp_path: Path, ext: str) -> None:
    # Written out of name order: the glob must come back sorted.
    for part, chunk in [(2, RECORDS[5:]), (0, RECORDS[:2]), (1, RECORDS[2:5])]:
        _write(tmp_path / f"part-{part}{ext}", chunk)
    source = open_source(str(tmp_path / f"part-*{ext}"))
    assert len(source) == len(RECORDS)
    assert _read_all(source) == EXPECTED
    assert source[4] == EXPECTED[4]  # the middle of the second file


def test_mixed_compression_and_explicit_paths(tmp_path: Path) -> None:
    paths = [
        _write(tmp_path / "a.jsonl.gz", RECORDS[:3]),
        _write(tmp_path / "b.jsonl", RECORDS[3:4]),
        _write(tmp_path / "c.jsonl.zst", RECORDS[4:]),
    ]
    source = JsonlSource([str(p) for p in paths])
    assert _read_all(source) == EXPECTED


@pytest.mark.parametrize("ext", [".jsonl", ".parquet", ".array_record"])
def test_field_names_are_configurable(tmp_path: Path, ext: str) -> None:
    records = [{"text": r["article"], "summary": r["abstract"]} for r in RECORDS]
    path = _write(tmp_path / f"data{ext}", records)
    source = open_source(str(path), input_field="text", target_field="summary")
    assert _read_all(source) == EXPECTED
    with pytest.raises(DataError, match=r"field 'article' missing|column 'article' missing"):
        _read_all(open_source(str(path)))


def test_compressed_files_are_decompressed_once_into_the_cache(tmp_path: Path, _cache) -> None:
    path = _write(tmp_path / "data.jsonl.gz", RECORDS)
    JsonlSource(str(path))
    JsonlSource(str(path))
    cached = list((_cache / "jsonl").iterdir())
    assert len(cached) == 1
    assert cached[0].read_bytes() == _jsonl(RECORDS)


@pytest.mark.parametrize(
    ("name", "data"),
    [
        # mtime=0: gzip stamps the time, and each test process must collect the same bytes.
        ("cut.jsonl.gz", gzip.compress(_jsonl(RECORDS), mtime=0)[:40]),
        ("cut.jsonl.zst", zstandard.ZstdCompressor().compress(_jsonl(RECORDS * 20))[:60]),
    ],
    ids=["gz", "zst"],
)
def test_truncated_compressed_file_is_named(tmp_path: Path, name: str, data: bytes) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(DataError, match=rf"{name}: cannot decompress"):
        open_source(str(tmp_path / name))


GOOD = json.dumps({"article": "a", "abstract": "b"}).encode() + b"\n"
BAD_LINES = [
    (b'{"article": "a" "abstract": "b"}', r"not valid JSON \(Expecting ',' delimiter"),
    (b'{"id": 1, "text": "a"}', r"field 'article' missing \(fields: id, text\)"),
    (b'{"article": " \\n ", "abstract": "b"}', r"field 'article' is empty"),
    (b'{"article": "a", "abstract": null}', r"field 'abstract' is null, expected a string"),
    (b'{"article": "a", "abstract": 3}', r"field 'abstract' is int, expected a string"),
    (b'["a", "b"]', r"not a JSON object \(got list\)"),
    (b'{"article": "caf\xe9", "abstract": "b"}', r"not UTF-8 text \(byte 0xe9"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_bad_jsonl_line_names_file_line_and_field(tmp_path: Path, line: bytes, message: str):
    path = tmp_path / "train.jsonl"
    path.write_bytes(GOOD + b"\n" + line + b"\n" + GOOD)  # the blank line 2 is not a record
    with pytest.raises(DataError, match=re.escape(f"{path}:3: ") + message):
        JsonlSource(str(path))


def test_skip_bad_records_skips_warns_and_stops_past_the_cap(tmp_path: Path, caplog) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(GOOD + BAD_LINES[0][0] + b"\n" + GOOD + BAD_LINES[1][0] + b"\n" + GOOD)
    with caplog.at_level(logging.WARNING, logger="longt5_jax.data.sources"):
        source = JsonlSource(str(path), skip_bad_records=2)
    assert len(source) == 3
    assert all(source[i] == {"inputs": "a", "targets": "b"} for i in range(3))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert f"{path}:2: not valid JSON" in warnings[0]
    assert f"{path}:4: field 'article' missing" in warnings[1]
    with pytest.raises(DataError, match=rf"{path}:4: .*more than 1 bad records; stopping"):
        JsonlSource(str(path), skip_bad_records=1)


def test_parquet_bad_input_names_file_row_and_field(tmp_path: Path, caplog) -> None:
    rows = [{"article": "a", "abstract": "b"}] * 4
    rows[1] = {"article": "a", "abstract": None}
    rows[3] = {"article": "  ", "abstract": "b"}
    path = _write(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError, match=re.escape(f"{path}: row 1: field 'abstract' is null")):
        ParquetSource(str(path))
    with caplog.at_level(logging.WARNING):
        source = ParquetSource(str(path), skip_bad_records=2)
    assert _read_all(source) == [{"inputs": "a", "targets": "b"}] * 2
    assert f"{path}: row 3: field 'article' is empty" in caplog.text
    with pytest.raises(DataError, match=r"row 3: .*more than 1 bad records; stopping"):
        ParquetSource(str(path), skip_bad_records=1)


def test_parquet_bad_files_are_named(tmp_path: Path) -> None:
    missing = _write(tmp_path / "cols.parquet", [{"id": 1, "article": "a"}])
    with pytest.raises(
        DataError, match=rf"{missing}: column 'abstract' missing \(columns: id, art"
    ):
        ParquetSource(str(missing))
    numbers = _write(tmp_path / "nums.parquet", [{"article": "a", "abstract": 5}])
    with pytest.raises(DataError, match=rf"{numbers}: column 'abstract' holds int64, expected"):
        ParquetSource(str(numbers))
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=r"junk.parquet: not a readable Parquet file"):
        ParquetSource(str(tmp_path / "junk.parquet"))


def test_array_record_bad_files_and_records_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"gone.array_record: no such file"):
        ArrayRecordSource(str(tmp_path / "gone.array_record"))
    (tmp_path / "junk.array_record").write_bytes(b"\0" * 100)
    with pytest.raises(DataError, match=r"junk.array_record: not a readable ArrayRecord file"):
        ArrayRecordSource(str(tmp_path / "junk.array_record"))
    path = tmp_path / "mixed.array_record"
    writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    for raw in [GOOD.strip(), b"{oops", b'{"article": "a"}']:
        writer.write(raw)
    writer.close()
    source = ArrayRecordSource(str(path))
    assert source[0] == {"inputs": "a", "targets": "b"}
    with pytest.raises(DataError, match=rf"{path}: record 1: not valid JSON"):
        source[1]
    with pytest.raises(DataError, match=rf"{path}: record 2: field 'abstract' missing"):
        source[2]
    # A file cut short (a copy that did not finish): its reader says nothing; we say what it is.
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(
        DataError, match=r"not a readable ArrayRecord file \(truncated or corrupt\)"
    ):
        ArrayRecordSource(str(path))


def test_open_source_rejects_bad_paths_and_formats(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=re.escape(f"no files match '{tmp_path}/x/*.jsonl'")):
        open_source(f"{tmp_path}/x/*.jsonl")
    (tmp_path / "data.csv").write_text("article,abstract\n")
    with pytest.raises(DataError, match=r"data.csv: unknown extension"):
        open_source(str(tmp_path / "data.csv"))
    _write(tmp_path / "a.jsonl", RECORDS)
    _write(tmp_path / "b.parquet", RECORDS)
    with pytest.raises(DataError, match=r"mixed formats"):
        open_source([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")])
    with pytest.raises(DataError, match=r"unknown format 'csv'"):
        open_source(str(tmp_path / "a.jsonl"), format="csv")
    # An explicit format overrides the extension; compression is detected from the content.
    (tmp_path / "data.txt").write_bytes(gzip.compress(_jsonl(RECORDS)))
    assert _read_all(open_source(str(tmp_path / "data.txt"), format="jsonl")) == EXPECTED


@pytest.mark.parametrize("ext", [".jsonl", ".jsonl.gz", ".parquet", ".array_record"])
def test_sources_pickle_and_read_after_unpickling(tmp_path: Path, ext: str) -> None:
    source = open_source([str(_write(tmp_path / f"{i}{ext}", RECORDS)) for i in range(2)])
    assert source[0] == EXPECTED[0]  # opens per-process state, which must not be pickled
    copy = pickle.loads(pickle.dumps(source))
    assert _read_all(copy) == EXPECTED * 2
    assert repr(copy) == repr(source)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 3)


def _rewrite(path: Path) -> None:
    time.sleep(0.05)  # past the file system's timestamp granularity, as any later rewrite is
    data = path.read_bytes()
    path.write_bytes(data.replace(b"summary", b"SUMMARY"))  # same size, other text


def _replace(path: Path) -> None:
    other = path.with_name("new.jsonl")
    other.write_bytes(path.read_bytes())
    other.replace(path)


CHANGES = {
    "truncated": (_truncate, r"changed during the run \(\d+ bytes, \d+ when indexed\)"),
    "rewritten": (_rewrite, r"changed during the run \(rewritten in place\)"),
    "replaced": (_replace, r"changed during the run \(another file replaced it\)"),
    "removed": (Path.unlink, r"changed during the run \(it is gone\)"),
}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("ext", [".jsonl", ".jsonl.gz"])
def test_a_jsonl_file_changed_under_its_source_is_one_error_naming_it(tmp_path, change, ext):
    """No memory map, so no SIGBUS: a file truncated, rewritten, replaced or removed after its
    records were indexed is a DataError naming it, wherever the read happens."""
    path = _write(tmp_path / f"data{ext}", RECORDS)
    source = open_source(str(path))
    if change in ("truncated", "rewritten"):
        assert source[0] == EXPECTED[0]  # this process has the file open: it changes under it
    plain = path if ext == ".jsonl" else Path(source._plain[0])  # what is read: the cache's copy
    CHANGES[change][0](plain)
    with pytest.raises(DataError, match=CHANGES[change][1]) as e:
        _read_all(source)
    assert str(e.value).startswith(str(path))


def test_a_jsonl_file_removed_after_it_was_opened_is_still_read(tmp_path: Path) -> None:
    """The open handle keeps the data the run indexed: nothing changed under the reader."""
    path = _write(tmp_path / "data.jsonl", RECORDS)
    source = open_source(str(path))
    assert source[0] == EXPECTED[0]
    path.unlink()
    assert _read_all(source) == EXPECTED


def _count_papers(split: str) -> int:
    """Papers in a split with a non-empty body and abstract, counted from the package files."""
    root = Path(next(iter(importlib.util.find_spec("aclsum").submodule_search_locations)))
    count = 0
    for line in (root / "dataset" / f"{split}.jsonl").read_text().splitlines():
        if line.strip():
            paper_file = root / "dataset" / "paper_jsons" / f"{json.loads(line)['id']}.json"
            parse = json.loads(paper_file.read_text())["pdf_parse"]
            texts = [[p["text"].strip() for p in parse[k]] for k in ("body_text", "abstract")]
            count += all(any(t) for t in texts)
    return count


def test_aclsum_task() -> None:
    words = []
    for split in SPLITS:
        source = aclsum_source(split)
        assert len(source) == _count_papers(split) > 0
        for example in _read_all(source):
            assert example["inputs"].strip() and example["targets"].strip()
            assert example["targets"] not in example["inputs"]
            assert example["targets"].split("\n")[0] not in example["inputs"]
            words.append(len(example["inputs"].split()))
    assert max(words) > 10_000
    assert statistics.median(words) > 2_000
    assert "aclsum" not in sys.modules  # read from its files; importing it needs another package
    copy = pickle.loads(pickle.dumps(aclsum_source("val")))
    assert copy[3] == aclsum_source("val")[3]
    with pytest.raises(DataError, match=r"no split 'validation' \(splits: train, val, test\)"):
        aclsum_source("validation")


def _paper(body: list[tuple[str, str]], abstract: list[str]) -> str:
    paragraphs = [{"section": section, "text": text} for section, text in body]
    abstract_paragraphs = [{"text": text} for text in abstract]
    return json.dumps({"pdf_parse": {"body_text": paragraphs, "abstract": abstract_paragraphs}})


def test_aclsum_builds_examples_and_skips_empty_papers(tmp_path: Path, caplog) -> None:
    (tmp_path / "paper_jsons").mkdir()
    body = [("Intro", "p1"), ("", "a caption"), ("Intro", "p2"), ("Method", "p3"), ("Method", " ")]
    papers = {"full": _paper(body, ["a1", "a2"]), "nobody": _paper([], ["a"])}
    papers["noabstract"] = _paper([("Intro", "p")], [" "])
    for name, text in papers.items():
        (tmp_path / "paper_jsons" / f"{name}.json").write_text(text)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"id": n}) + "\n" for n in papers))
    with caplog.at_level(logging.INFO):
        examples = _load_split(tmp_path, "train")
    # A heading is a line of its own when the section changes, not after a heading-less paragraph.
    assert examples == (("Intro\np1\na caption\np2\nMethod\np3", "a1\na2"),)
    assert "1 papers, 2 skipped for an empty body or abstract" in caplog.text
    (tmp_path / "val.jsonl").write_text('{"id": "lost"}\n')
    with pytest.raises(DataError, match=r"paper_jsons/lost.json: no such file"):
        _load_split(tmp_path, "val")


def test_convert_round_trips_jsonl_to_array_record(tmp_path: Path, capsys) -> None:
    _write(tmp_path / "in-0.jsonl", RECORDS[:4])
    _write(tmp_path / "in-1.jsonl.gz", RECORDS[4:])
    out = tmp_path / "out"
    argv = ["--input", f"{tmp_path}/in-*", "--output_dir", str(out), "--num_shards", "3"]
    assert convert.main([*argv, "--format", "jsonl"]) == 0
    shards = sorted(p.name for p in out.iterdir())
    assert shards == [f"train-{i:05d}-of-00003.array_record" for i in range(3)]
    assert f"wrote {len(RECORDS)} records to 3 shards" in capsys.readouterr().out
    assert _read_all(open_source(f"{out}/train-*.array_record")) == EXPECTED
    renamed = [{"text": r["article"], "summary": r["abstract"]} for r in RECORDS]
    _write(tmp_path / "renamed.jsonl", renamed)
    fields = ["--input_field", "text", "--target_field", "summary", "--name", "val"]
    argv = ["--input", str(tmp_path / "renamed.jsonl"), "--output_dir", str(out), *fields]
    assert convert.main(argv) == 0
    val = ArrayRecordSource(str(out / "val-00000-of-00001.array_record"), "text", "summary")
    assert _read_all(val) == EXPECTED


def test_convert_refuses_to_overwrite_and_drops_stale_shards(tmp_path: Path, capsys) -> None:
    source = _write(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out"
    argv = ["--input", str(source), "--output_dir", str(out)]
    assert convert.main([*argv, "--num_shards", "2"]) == 0
    before = {p: p.read_bytes() for p in out.iterdir()}
    assert convert.main([*argv, "--num_shards", "2"]) == 2
    existing = out / "train-00000-of-00002.array_record"
    assert f"{existing} already exists" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.iterdir()} == before
    assert convert.main([*argv, "--num_shards", "1", "--overwrite"]) == 0
    assert [p.name for p in out.iterdir()] == ["train-00000-of-00001.array_record"]
    missing = ["--input", str(tmp_path / "none.jsonl"), "--output_dir", str(tmp_path / "new")]
    assert convert.main(missing) == 2
    assert "no files match" in capsys.readouterr().err


class _FailingSource:
    """Serves RECORDS but fails at one index, like a run interrupted mid-shard."""

    def __init__(self, fail_at: int):
        self.fail_at = fail_at

    def __len__(self) -> int:
        return len(EXPECTED)

    def __getitem__(self, index: int) -> dict[str, str]:
        if index == self.fail_at:
            raise KeyboardInterrupt
        return EXPECTED[index]


def test_convert_leaves_no_partial_shard(tmp_path: Path) -> None:
    # 7 records in 3 shards: [0, 2), [2, 4), [4, 7); failing at 5 interrupts the last shard.
    with pytest.raises(KeyboardInterrupt):
        convert.write_shards(_FailingSource(fail_at=5), tmp_path, num_shards=3)
    complete = [f"train-0000{i}-of-00003.array_record" for i in range(2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == complete
    assert _read_all(open_source(f"{tmp_path}/*.array_record")) == EXPECTED[:4]
