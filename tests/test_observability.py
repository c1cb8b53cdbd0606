"""Live metrics: a real HTTP scrape of the Prometheus endpoint during a run, the timing and MFU
figures in the logs, and a profiler trace of chosen steps."""

import contextlib
import json
import socket
import threading
import time
import urllib.request

import pytest
from helpers import TINY_RUN
from prometheus_client.parser import text_string_to_metric_families

from longt5_jax import train
from longt5_jax.training.metrics import peak_flops
from longt5_jax.training.prometheus import PrometheusExporter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    """Process 0's figures by sample name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("longt5_") and sample.labels.get("process", "0") == "0"
    }


@pytest.mark.slow
def test_prometheus_serves_the_logged_metrics_during_a_run(tmp_path):
    port = _free_port()
    argv = [
        *TINY_RUN,
        "--gin.RunConfig.train_steps=12",
        "--gin.OptimizerConfig.total_steps=12",
        f"--gin.RunConfig.prometheus_port={port}",
        "--gin.RunConfig.prometheus_grace_seconds=0",
        "--gin.RunConfig.peak_flops_per_device=1e12",
        "--gin.RunConfig.profile_start=3",
        "--gin.RunConfig.profile_steps=2",
        f"--gin.MODEL_DIR='{tmp_path}'",
    ]
    result = {}
    run = threading.Thread(target=lambda: result.setdefault("rc", train.main(argv)))
    run.start()
    scraped = {}
    while run.is_alive() and scraped.get("longt5_step", 0) < 3:
        with contextlib.suppress(OSError):  # not listening yet
            scraped = _scrape(port)
        time.sleep(0.2)
    run.join()
    assert result["rc"] == 0
    assert scraped.get("longt5_step", 0) >= 3, "no scrape caught the run"
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").open())}
    row = rows[int(scraped["longt5_step"])]
    for key in ("loss", "learning_rate", "grad_norm", "mfu_ratio"):
        assert scraped[f"longt5_{key}"] == pytest.approx(row[key.removesuffix("_ratio")], rel=1e-6)
    assert scraped["longt5_tokens_total"] > 0 and "longt5_tokens_per_second" not in scraped
    for key in ("step_seconds", "data_wait_seconds", "checkpoint_seconds"):
        assert key in row and row[key] >= 0
    assert row["mfu"] > 0 and row["step_seconds"] > row["data_wait_seconds"]
    assert any(tmp_path.glob("profile/**/*.xplane.pb")), "no trace of steps 3-4"
    with pytest.raises(OSError):  # with no grace period the endpoint closes with the run
        _scrape(port)


def test_the_endpoint_refuses_a_taken_port_in_one_line():
    port = _free_port()
    first = PrometheusExporter(port, "127.0.0.1", 0)
    try:
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            PrometheusExporter(port, "127.0.0.1", 0)
    finally:
        first.close()


def test_peak_flops_known_for_gpus_and_unknown_for_cpus():
    class Device:
        device_kind = "NVIDIA A100-SXM4-80GB"

    assert peak_flops([Device()] * 4) == 4 * 312e12
    assert peak_flops([object()]) == 0.0
    assert peak_flops([object()] * 2, 5e12) == 1e13


def test_a_torn_last_row_of_metrics_jsonl_is_dropped_on_resume(tmp_path):
    """A kill mid-write leaves a row cut short: resuming keeps the whole rows up to its step."""
    from longt5_jax.training.metrics import MetricsWriter

    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 4, "lo')
    writer = MetricsWriter(tmp_path, total_steps=6, resume_step=2)
    writer.write(3, {"loss": 0.25})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[:2] == rows[:2] and [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert json.loads(lines[2])["loss"] == 0.25
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
