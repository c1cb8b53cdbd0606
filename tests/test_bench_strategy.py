"""The strategy table runs end to end on tiny sizes and writes its JSON (no timing asserted)."""

import json

import pytest

from longt5_jax.bench import strategy


def test_strategy_bad_input_is_one_line(capsys):
    assert strategy.main(["--set", "d_modle=64"]) == 2
    assert strategy.main(["--model", "tiny", "--set", "d_model=sixty"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: --set 'd_modle=64': expected FIELD=VALUE with a LongT5Config field",
        "error: --set 'd_model=sixty': 'sixty' is not a int",
    ]


@pytest.mark.slow
def test_strategy_table_writes_rows(tmp_path, capsys):
    argv = ["--strategies", "DP", "TP+PP+DP", "--steps", "1", "--batch_size", "8"]
    argv += ["--input_length", "64", "--target_length", "16", "--out_dir", str(tmp_path)]
    assert strategy.main(argv) == 0
    report = json.loads((tmp_path / "strategy.json").read_text())
    rows = {r["strategy"]: r for r in report["rows"]}
    assert set(rows) == {"DP", "TP+PP+DP"}
    assert rows["TP+PP+DP"]["collective_bytes"]["collective-permute"] > 0
    assert rows["DP"]["collective_bytes"]["all-reduce"] > 0
    # Tensor and pipeline split the parameters; data parallelism replicates them.
    assert rows["TP+PP+DP"]["memory"]["arguments"] < rows["DP"]["memory"]["arguments"]
    assert all(0 < r["target_comm_share"] < 1 and r["samples_per_s"] > 0 for r in rows.values())
    assert "samples/s" in capsys.readouterr().out
    assert (tmp_path / "strategy.png").stat().st_size > 0
