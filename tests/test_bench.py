"""The benchmarks run end to end on tiny sizes and write their JSON (no timing is asserted)."""

import json

from longt5_jax.bench import data


def test_data_benchmark_writes_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGT5_JAX_CACHE", str(tmp_path / "cache"))
    rc = data.main(
        [
            "--input_lengths",
            "256",
            "--target_length",
            "32",
            "--workers",
            "0",
            "--batches",
            "2",
            "--step_repeats",
            "1",
            "--model",
            "tiny",
            "--out_dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "data.json").read_text())
    (row,) = report["rows"]
    assert row["input_length"] == 256 and row["workers"] == 0
    assert row["positions_per_s"] >= row["real_tokens_per_s"] > 0
    assert row["ratio"] == row["positions_per_s"] / row["step_positions_per_s"]
