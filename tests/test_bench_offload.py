"""`bench offload`: ZeRO-Offload's device memory, PCIe traffic and CPU cost reported for the
tiny model, and its one-line refusal of a target without a GPU compile."""

import json

import pytest

from longt5_jax.bench import offload as bench
from longt5_jax.estimate import targets
from longt5_jax.parallel import offload


@pytest.mark.slow
@pytest.mark.skipif(not targets.have_gpu_compiler(), reason="the gpu extra is not installed")
def test_bench_offload_reports_memory_pcie_and_the_cpu_cost(tmp_path, capsys):
    argv = ["--model", "tiny", "--input_length", "512", "--target_length", "64", "--zero", "0"]
    argv += ["--fit_length", "0", "--cpu_model", "tiny", "--cpu_steps", "2"]
    assert bench.main([*argv, "--out_dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "offload.json").read_text())
    none, opt, both = report["rows"]
    assert none["host_gib"] == 0 < opt["host_gib"] < both["host_gib"]
    assert opt["device_gib"] < none["device_gib"] and none["pcie_gb"] == 0 < opt["pcie_gb"]
    assert [t["offload"] for t in report["cpu"]] == list(offload.OFFLOADS)
    assert report["cpu"][0]["ratio"] == 1 and all(t["median_s"] > 0 for t in report["cpu"])
    assert (tmp_path / "offload.png").stat().st_size > 0
    assert "optimizer_and_params" in capsys.readouterr().out
    assert bench.main(["--target", "cpu", "--out_dir", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: --target: device memory is read from a GPU compile"
    )
