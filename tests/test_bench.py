"""The benchmarks run end to end on tiny sizes and write their JSON (no timing is asserted)."""

import json
import math
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


@pytest.mark.slow
def test_pipeline_benchmark_writes_rows(tmp_path):
    from longt5_jax.bench import pipeline

    argv = ["--stages", "2", "--microbatch_factors", "1", "--repeats", "1", "--steps", "1"]
    small = ["--batch_size", "8", "--input_length", "64", "--target_length", "8", "--layers", "2"]
    assert pipeline.main([*argv, *small, "--d_model", "32", "--out_dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "pipeline.json").read_text())
    (row,) = report["rows"]
    assert (row["stages"], row["microbatches"], row["repeats"]) == (2, 2, 1)
    assert row["theory_idle"] == 1 / 3 and row["temp_bytes"] > 0 and row["step_s"] > 0


@pytest.mark.slow
def test_decode_benchmark_races_transformers_on_the_same_tokens(tmp_path):
    from longt5_jax.bench import decode

    argv = ["--preset", "tiny", "--input_length", "256", "--max_length", "8", "--beams", "1", "3"]
    assert decode.main([*argv, "--repeats", "1", "--out_dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert [r["beams"] for r in rows] == [1, 3]
    for row in rows:
        assert row["same_tokens"] and 0 < row["decoded_tokens"] <= 8
        assert row["summaries_per_s"] == 1 / row["seconds"] and row["speedup"] > 0
        # Where each side's time goes: the encoder alone, then the first token and each step
        # (differences of separate timings: at the tiny model's milliseconds, either sign).
        for parts in (row["ours_parts"], row["reference_parts"]):
            assert set(parts) == {"encoder_s", "first_token_s", "step_ms"}
            assert parts["encoder_s"] > 0 and all(map(math.isfinite, parts.values()))


def test_device_benchmark_refuses_bad_cases_and_a_machine_without_a_gpu(tmp_path, capsys):
    from longt5_jax.bench import device

    assert device.main(["--cases", "base:4096", "--out_dir", str(tmp_path)]) == 2
    assert "expected MODEL:INPUT_LENGTH:BATCH[:REMAT]" in capsys.readouterr().err
    assert device.main(["--cases", "base:4096:2:some", "--out_dir", str(tmp_path)]) == 2
    assert (
        "remat 'some' is not one of none, full, save_dots, save_attention"
        in capsys.readouterr().err
    )
    # The GPU run is a process of its own; on this CPU-only machine it reports no GPU.
    assert device.main(["--cases", "tiny:64:2:none", "--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"error: {device._NO_GPU}"
    assert not (tmp_path / "device.json").exists()


def test_device_rows_without_the_deviceless_compile_show_transformers_speedup(capsys):
    """`--no-deviceless --transformers` (as the GPU check runs it): the GPU's figures and the
    speed-up over transformers, the deviceless columns blank."""
    from longt5_jax.bench import device

    gpu = {"step_s": 0.1989, "tokens_per_s": 169895.4, "mfu": 0.1394, "hfu": 0.1857,
           "memory": {"total": 5414902760}, "allocator_peak": 5414908416}  # fmt: skip
    row = {"case": "base:16384:2:full", "deviceless": {"error": "not compiled (--no-deviceless)"},
           "gpu": gpu, "speedup_over_transformers": 4.9577}  # fmt: skip
    device._print([row])
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.split()[:5] == ["base:16384:2:full", "0.199", "169895", "13.9%", "18.6%"]
    assert "  4.96  (not compiled (--no-deviceless))" in line


def test_the_device_step_keeps_xlas_autotuning_where_asked_and_compiles_without_where_refused(
    tmp_path, monkeypatch
):
    from longt5_jax.bench import device

    x = jnp.arange(64.0).reshape(8, 8)
    lowered = jax.jit(lambda a: a @ a).lower(x)
    assert device._compile(lowered, None)[1] is None
    cache = tmp_path / "autotune"
    compiled, kept = device._compile(lowered, cache)
    assert kept == str(cache) and cache.is_dir()
    np.testing.assert_array_equal(compiled(x), x @ x)
    # A jaxlib that does not know the option: the step compiles without it, and says so.
    monkeypatch.setattr(device, "AUTOTUNE_CACHE_OPTION", "xla_gpu_no_such_option")
    compiled, kept = device._compile(lowered, cache)
    assert kept.startswith("not kept: ") and "xla_gpu_no_such_option" in kept
    np.testing.assert_array_equal(compiled(x), x @ x)
    # Each case's GPU process is given the directory.
    runs = []

    gpu = {"step_s": 0.5, "tokens_per_s": 10.0, "mfu": 0.3, "hfu": 0.4, "memory": {"total": 2**30},
           "allocator_peak": 2**30}  # fmt: skip

    def run(cmd, **kwargs):
        runs.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=device._RESULT + json.dumps(gpu))

    monkeypatch.setattr(device.subprocess, "run", run)
    args = device._parser().parse_args(["--autotune_cache", str(cache)])
    assert device._child(args, "gpu", "tiny:64:2:none") == gpu
    assert runs[0][runs[0].index("--autotune_cache") + 1] == str(cache)
    # The report keeps the option as its text (a path object once stopped it being written).
    argv = ["--no-deviceless", "--autotune_cache", str(cache), "--out_dir", str(tmp_path)]
    assert device.main([*argv, "--cases", "tiny:64:2:none"]) == 0
    report = json.loads((tmp_path / "device.json").read_text())
    assert report["config"]["autotune_cache"] == str(cache)
    assert report["rows"][0]["gpu"] == gpu


def test_transformers_step_beside_ours_trains_on_the_cpu(tmp_path):
    """`bench device --transformers`' reference step, run here so that a broken one is found
    before it spends GPU time: transformers' LongT5 of the case's size, on the case's batch."""
    import transformers

    from longt5_jax.bench import device

    args = device._parser().parse_args(["--target_length", "16", "--warmup", "1", "--steps", "2"])
    report = device._transformers(args, "tiny:64:2:full", device="cpu")
    assert report["version"] == transformers.__version__ and report["allocator_peak"] == 0
    assert report["step_s"] > 0
