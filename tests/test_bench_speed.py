"""The speed benchmark: equal first losses (a fair race) and the JSON it writes (no timing)."""

import json

import numpy as np
import pytest

from longt5_jax.bench import speed
from longt5_jax.model import LongT5Config


def test_full_attention_estimate_exceeds_blocked():
    args = speed._parse(["--target_length", "8"])
    small = LongT5Config.preset("small", "transient-global")
    ratios = [
        speed.full_attention_flops(small, args, n) / speed._model_flops(small, args, n)
        for n in (1024, 16384)
    ]
    assert 1 < ratios[0] < ratios[1]


def _argv(tmp_path, *extra: str) -> list[str]:
    return [
        "--preset", "tiny", "--target_length", "8", "--race_steps", "1", "--mfu_length", "24",
        "--scaling_reference", "32", "--scaling_steps", "1", "--peak_size", "64",
        "--out_dir", str(tmp_path), *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_race_has_equal_first_losses_and_writes_rows(tmp_path):
    assert speed.main(_argv(tmp_path, "--race_lengths", "24", "--scaling_lengths")) == 0
    report = json.loads((tmp_path / "speed.json").read_text())
    assert report["peak"]["flops_per_s"] > 0
    (row,) = report["race"]
    assert row["input_length"] == 24 and row["speedup"]["median"] > 0
    # Same weights, batch and objective: the race is fair only if the first losses agree.
    np.testing.assert_allclose(row["first_loss"], row["reference_first_loss"], rtol=1e-4)
    assert report["mfu"][0]["mfu"] > 0 and report["scaling"] == []
    assert report["plot"] == "no scaling rows: no plot"


@pytest.mark.slow
def test_scaling_writes_rows(tmp_path):
    assert speed.main(_argv(tmp_path, "--race_lengths", "--scaling_lengths", "16")) == 0
    report = json.loads((tmp_path / "speed.json").read_text())
    assert report["race"] == [] and report["mfu"] == []
    assert [r["input_length"] for r in report["scaling"]] == [16, 32]
    assert report["scaling"][1]["ratio_to_reference"]["median"] == 1.0
    assert all(r["full_attention_estimate_s"] > 0 for r in report["scaling"])
    assert report["plot"] == "speed.png" and (tmp_path / "speed.png").stat().st_size > 0
