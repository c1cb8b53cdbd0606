"""`bench cluster` (Table 1's strategies compiled for the A100 cluster) and `bench scaling`
(which shares its parser): their tables, JSON and plots, their precision by target, and their
one-line refusals."""

import json

import pytest
from helpers import NO_BF16, SMALL_PLAN

from longt5_jax import plan
from longt5_jax.bench import cluster, scaling
from longt5_jax.estimate import targets

GPU = pytest.mark.skipif(
    not targets.have_gpu_compiler(), reason="the gpu extra (jax[cuda12]) is not installed"
)


def test_commands_default_dtype_to_the_targets_half_precision(capsys):
    """The planner, `bench cluster` and `bench scaling` (which shares its parser) alike."""
    for parse in (plan._parser().parse_args, cluster.parser().parse_args,
                  scaling._parser().parse_args):  # fmt: skip
        assert parse(["--target", "v100-32gb"]).dtype == "float16"
        assert parse(["--target", "v100-32gb", "--dtype", "float32"]).dtype == "float32"
        assert parse(["--target", "cpu"]).dtype == "bfloat16"
        assert parse([]).dtype == "bfloat16"  # the default target: A100
    assert plan.main([*SMALL_PLAN, "--target", "v100-32gb", "--compile_top", "0"]) == 0
    assert "float16 128/16 attention_kernel=xla on 1 nodes x 8 GPUs, 32 GiB, 125 TFLOP/s" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("command", ["cluster", "scaling"])
def test_bench_refuses_bfloat16_on_a_v100_in_one_line(command, capsys):
    main = {"cluster": cluster.main, "scaling": scaling.main}[command]
    assert main(["--target", "v100-32gb", "--dtype", "bfloat16"]) == 2
    assert capsys.readouterr().err == f"error: {NO_BF16}\n"


@GPU
@pytest.mark.slow
def test_bench_cluster_writes_the_table_json_and_plot(tmp_path, capsys):
    """Table 1's three strategies for the tiny model on the A100 cluster: every row compiled,
    its bytes within 15% of the analytic model, its bounds ordered (no overlap <= as scheduled
    <= full overlap <= the ceiling), the paper's figures beside it."""
    argv = ["--rows", "tiny:512", "--batch_size", "128", "--target_length", "64"]
    assert cluster.main([*argv, "--pipeline_microbatches", "4", "--out_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "compiled for a100-80gb" in out and "/model" in out
    report = json.loads((tmp_path / "cluster.json").read_text())
    assert (tmp_path / "cluster.png").stat().st_size > 0
    assert [r["strategy"] for r in report["rows"]] == ["DP+ZeRO-2", "TP+DP", "TP+PP+DP"]
    for r in report["rows"]:
        got = sum(r["collectives"]["kind"].values())
        assert 1 / 1.15 <= got / sum(r["comm_model_bytes"].values()) <= 1.15, r["strategy"]
        s = r["samples_per_s"]
        assert s["roofline_no_overlap"] <= s["roofline_as_scheduled"] <= s["roofline_full_overlap"]
        assert (
            s["mfu_no_overlap"] <= s["mfu_full_overlap"]
            and s["roofline_full_overlap"] <= (s["ceiling"])
        )
        assert 0 < r["memory_fraction"] < 1 and r["paper"]["samples_per_s"] in (790, 1080, 1410)
    # 4 microbatches of 96 rows cannot each split over 32 GPUs: one line, before compiling.
    bad = ["--rows", "tiny:512", "--batch_size", "96", "--out_dir", str(tmp_path)]
    assert cluster.main(bad) == 2
    assert "batch_size=96 is not divisible by the data axis (32) x StepConfig.microbatches (4)" in (
        capsys.readouterr().err
    )


@GPU
@pytest.mark.slow
def test_bench_scaling_compiles_each_point_and_reports_efficiency(tmp_path, capsys):
    """Weak and strong scaling of one strategy from 1 to 2 nodes: three compiles (the first node
    count's batch is both scalings'), the weak batch growing with the GPUs, efficiency 1 at the
    first node count and samples/s per GPU against it elsewhere."""
    argv = ["--rows", "tiny:512", "--nodes", "2", "1", "--strategies", "DP+ZeRO-2"]
    argv += ["--batch_size", "64", "--target_length", "64", "--out_dir", str(tmp_path)]
    assert scaling.main(argv) == 0
    assert capsys.readouterr().err.count("compiling") == 3
    points = json.loads((tmp_path / "scaling.json").read_text())["points"]
    assert (tmp_path / "scaling.png").stat().st_size > 0
    got = [(p["scaling"], p["gpus"], p["batch_size"]) for p in points]
    assert got == [("weak", 4, 64), ("weak", 8, 128), ("strong", 4, 64), ("strong", 8, 64)]
    for p in points:
        first = next(q for q in points if q["scaling"] == p["scaling"] and q["gpus"] == 4)
        for bound, e in p["efficiency"].items():
            per_gpu = p["samples_per_s"][bound] / p["gpus"]
            assert e == pytest.approx(per_gpu / (first["samples_per_s"][bound] / 4))
        if p["gpus"] == 4:
            assert set(p["efficiency"].values()) == {1.0}
    assert scaling.main([*argv, "--nodes", "0"]) == 2
    assert "argument --nodes: expected an integer >= 1, got 0" in capsys.readouterr().err
