"""The results page's blocks: a benchmark's table rewritten between its markers, said where from."""

import argparse
import re
import shlex
from pathlib import Path

import pytest

from longt5_jax.bench import __main__ as bench
from longt5_jax.bench import results
from longt5_jax.errors import UsageError

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"

PAGE = """# Results

Prose stays.

<!-- results: bench cluster --rows tiny:1024 -->
Measured by `python -m longt5_jax.bench cluster --rows tiny:1024` on 2026-01-01, x, commit abc123f.

| old | table |
|---|---|
| 1 | 2 |
<!-- /results -->

Between the blocks.

<!-- results: bench scaling --rows tiny:1024 -->
| another | table |
<!-- /results -->
"""


def test_a_block_is_rewritten_between_its_markers_and_the_rest_unchanged(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    argv = ["--rows", "tiny:1024", "--results", str(page), f"--out_dir={tmp_path / 'out'}"]
    args = argparse.Namespace(results=page, out_dir=tmp_path / "out")
    table = results.markdown(["strategy", "GiB"], [["DP+ZeRO-2", "0.1"], ["TP|DP", 2]])
    results.publish(args, "cluster", argv, table, where="Linux x86_64 with 8 x cpu (cpu)")
    text = page.read_text()
    before, block = text.split("<!-- results: bench cluster --rows tiny:1024 -->\n")
    block, after = block.split("<!-- /results -->\n", 1)
    assert before == PAGE.split("<!-- results: bench cluster")[0]
    assert after == PAGE.split("| 1 | 2 |\n<!-- /results -->\n")[1]  # the other block too
    source = results.SOURCE.search(block)
    assert source is not None and source.start() == 0, block
    assert source["command"] == "python -m longt5_jax.bench cluster --rows tiny:1024"
    assert source["machine"] == "Linux x86_64 with 8 x cpu (cpu)"
    assert source["commit"] == results.commit() != ""
    assert "| strategy | GiB |\n| --- | --- |\n| DP+ZeRO-2 | 0.1 |\n| TP\\|DP | 2 |" in block
    assert "old" not in block
    assert (tmp_path / "out" / "cluster.md").read_text() == block


def test_the_block_is_found_by_its_command_and_a_missing_one_is_refused_before_the_run(tmp_path):
    assert results.command("cluster", ["--results", "p.md", "--rows", "a:1", "--out_dir=o"]) == (
        "bench cluster --rows a:1"
    )
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    results.check(page, "scaling", ["--rows", "tiny:1024"])
    results.check(None, "cluster", ["--rows", "xl:8192"])  # no page: nothing to check
    for name, argv in (("cluster", ["--rows", "xl:8192"]), ("decode", [])):
        with pytest.raises(UsageError, match="no block <!-- results: bench"):
            results.check(page, name, argv)
    with pytest.raises(UsageError, match="2 blocks"):
        results.replace_block(PAGE + PAGE, "bench scaling --rows tiny:1024", "")
    with pytest.raises(UsageError, match="no <!-- /results -->"):
        results.replace_block(PAGE.rsplit("<!-- /results -->", 1)[0], "bench scaling "
                              "--rows tiny:1024", "")  # fmt: skip
    with pytest.raises(UsageError, match="--results"):
        results.check(tmp_path / "nonesuch.md", "cluster", [])


def test_the_source_line_says_command_date_machine_and_commit():
    line = results.source_line(
        "decode", ["--beams", "1", "--results", "x.md"], "a CPU", "2026-12-02"
    )
    found = results.SOURCE.fullmatch(line)
    assert found is not None, line
    assert found.groupdict() == {
        "command": "python -m longt5_jax.bench decode --beams 1",
        "date": "2026-12-02",
        "machine": "a CPU",
        "commit": results.commit(),
    }
    assert results.commit(Path("/")) == "unknown"  # not a checkout
    assert results.SOURCE.fullmatch(line.replace("2026-12-02", "yesterday")) is None


def test_report_rows_become_a_table_by_path_and_format():
    columns = {"case": ("case", ""), "GiB": ("gpu.memory", "GiB"), "MFU": ("gpu.mfu", ".1%")}
    columns |= {"GB": ("bytes", "GB"), "ms": ("seconds", "ms")}
    rows = [
        {"case": "a", "gpu": {"memory": 3 * 2**30, "mfu": 0.365}, "bytes": 2.5e9, "seconds": 0.1},
        {"case": "b", "gpu": {"mfu": None}},
    ]
    assert results.records(rows, columns).splitlines() == [
        "| case | GiB | MFU | GB | ms |",
        "| --- | --- | --- | --- | --- |",
        "| a | 3.00 | 36.5% | 2.5 | 100.0 |",
        "| b |  |  |  |  |",
    ]


@pytest.mark.parametrize(
    "name",
    [
        "cluster",
        "memory",
        "offload",
        "scaling",
        "decode",
        "roofline",
        "device",
        "kernels",
        "headroom",
    ],
)
def test_the_benchmarks_with_tables_on_the_page_take_results(name, capsys):
    with pytest.raises(SystemExit):
        bench.main([name, "--help"])
    assert "--results PAGE" in capsys.readouterr().out


def results_blocks(text: str) -> list[tuple[str, str]]:
    """(command, body) of each `<!-- results: COMMAND -->` ... `<!-- /results -->` block."""
    ends = [m.start() for m in re.finditer(re.escape(results.CLOSE), text)]
    return [
        (m["command"], text[m.end() : min(e for e in ends if e > m.end())])
        for m in results.OPEN.finditer(text)
    ]


def test_every_table_on_the_results_page_says_its_command_date_machine_and_commit():
    """Each table sits in a block whose `Measured by` line ends with the block's command (that
    line's command parsing is tests/test_docs.py's, with every command a page shows)."""
    text = RESULTS.read_text()
    assert len(text.splitlines()) <= 300, "the results page holds today's figures only"
    blocks = results_blocks(text)
    opened, closed = (len(re.findall(f"^{m}", text, re.M)) for m in ("<!-- results:", "<!-- /res"))
    assert opened == len(blocks) == closed >= 10
    for command, body in blocks:
        source = results.SOURCE.search(body)
        assert source, f"<!-- results: {command} -->: no 'Measured by `...` on DATE, ...' line"
        shown, marked = (shlex.join(shlex.split(c)) for c in (source["command"], command))
        assert shown.endswith(f".{marked}") or shown.endswith(f" {marked}"), (shown, marked)
    outside = re.sub(r"^<!-- results:.*?^<!-- /results -->", "", text, flags=re.S | re.M)
    assert [line for line in outside.splitlines() if line.startswith("|")] == []
