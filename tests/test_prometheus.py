"""Prometheus export: the naming rules (counters, gauges, run info, global figures once), promtool's
lint of the endpoint, the grace period, Pushgateway pushes, the shipped configs and dashboard,
and a real Prometheus scraping a two-process run for every query of that dashboard."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers import TINY_RUN, child_env, free_ports, http_get, promtool_lint
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from longt5_jax.infer.rouge import KEYS as ROUGE_KEYS
from longt5_jax.model import LongT5Config
from longt5_jax.training.prometheus import PrometheusExporter
from longt5_jax.training.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "longt5.json"
INFO = {"model_dir": "/runs/a", "model": "tiny-tglobal", "mesh": "data=8", "config_hash": "abc"}
# A training row as the loop and MetricsWriter log it.
ROW = {
    "step": 12,
    "loss": 2.5,
    "z_loss": 0.01,
    "accuracy": 0.25,
    "tokens": 96.0,
    "grad_norm": 1.5,
    "nonfinite_steps": 1.0,
    "learning_rate": 1e-3,
    "tokens_per_second": 400.0,
    "steps_per_second": 2.0,
    "step_seconds": 0.5,
    "data_wait_seconds": 0.1,
    "checkpoint_seconds": 0.0,
    "mfu": 0.3,
}


def _families(exporter: PrometheusExporter) -> dict:
    """{family name: (type, {(sample name, labels): value})} of our own metrics."""
    text = generate_latest(exporter.registry).decode()
    return {
        f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
        for f in text_string_to_metric_families(text)
        if f.name.startswith("longt5_") and not f.name.endswith("_created")  # counters' birth
    }


def _exported(process: int) -> dict:
    exporter = PrometheusExporter(0, "127.0.0.1", process, info=INFO)
    exporter.update(ROW, steps=2, tokens=200.0, spent={"data": 0.2})
    exporter.update({**ROW, "step": 14, "nonfinite_steps": 3.0}, steps=2, tokens=300.0)
    exporter.update({"eval/loss": 2.0, "eval/rouge1": 0.1, "eval/rougeL": 0.1})
    exporter.update({}, spent={"checkpoint": 1.5})  # the last save, after the last row
    exporter.close()
    return _families(exporter)


def test_counters_add_up_gauges_hold_the_latest_and_process_0_exports_the_run_wide_figures():
    families = _exported(0)
    types = {name: kind for name, (kind, _) in families.items()}
    counters = {n for n, k in types.items() if k == "counter"}
    assert counters == {
        "longt5_steps",
        "longt5_tokens",
        "longt5_nonfinite_steps",
        "longt5_data_wait_seconds",
        "longt5_checkpoint_seconds",
    }
    assert {n for n, k in types.items() if k == "gauge"} >= {
        "longt5_step",
        "longt5_loss",
        "longt5_learning_rate",
        "longt5_grad_norm",
        "longt5_mfu_ratio",
        "longt5_target_tokens",
        "longt5_step_seconds",
        "longt5_eval_loss",
        "longt5_eval_rouge1",
        "longt5_eval_rouge_l",
    }
    assert not [n for n, k in types.items() if k == "gauge" and n.endswith("_total")]
    # Rates are Prometheus' to derive from the counters.
    assert not {"longt5_tokens_per_second", "longt5_steps_per_second"} & set(types)

    def value(name, **labels):
        kind, samples = families[name]
        return samples[(name + "_total" if kind == "counter" else name, tuple(labels.items()))]

    assert value("longt5_steps") == 4 and value("longt5_tokens") == 500
    assert value("longt5_nonfinite_steps") == 3  # the loop's running count, not summed
    assert value("longt5_data_wait_seconds", process="0") == pytest.approx(0.2)
    assert value("longt5_checkpoint_seconds", process="0") == pytest.approx(1.5)
    assert value("longt5_step") == 14 and value("longt5_loss") == 2.5
    assert value("longt5_step_seconds", process="0") == 0.5
    (info,) = families["longt5_run_info"][1].items()
    assert info == (("longt5_run_info", tuple(sorted({**INFO, "process": "0"}.items()))), 1.0)


def test_other_processes_export_only_their_own_figures_so_sums_count_each_once():
    families = _exported(1)
    assert set(families) == {
        "longt5_data_wait_seconds",
        "longt5_checkpoint_seconds",
        "longt5_step_seconds",
        "longt5_run_info",
    }
    for _, samples in families.values():
        assert all(dict(labels)["process"] == "1" for _, labels in samples)


def test_the_endpoint_serves_the_default_collectors_and_passes_promtool_at_every_row():
    """Before any row, after a training row, after an eval with loss and every ROUGE key the
    evaluation logs (rougeL and rougeLsum are camelCase there, snake_case here)."""
    exporter = PrometheusExporter(free_ports(1), "127.0.0.1", 0, info=INFO)
    rouge = {f"eval/{key}": 20.0 for key in ROUGE_KEYS}
    texts = []
    try:
        for row in (
            {},
            ROW,
            {"eval/loss": 2.0, "eval/accuracy": 0.5, "eval/tokens": 64.0, **rouge},
        ):
            exporter.update(row, steps=2, tokens=200.0, spent={"data": 0.2})
            texts.append(http_get(f"http://127.0.0.1:{exporter.port}/metrics"))
    finally:
        exporter.close()
    for name in ("process_cpu_seconds_total", "python_info", "python_gc_collections_total"):
        assert f"\n{name}" in texts[-1], name
    for name in ("rouge1", "rouge2", "rouge_l", "rouge_lsum"):
        assert f"\nlongt5_eval_{name} 20.0" in texts[-1], name
    for text in texts:
        assert promtool_lint(text) == ""


def test_the_final_figures_stay_served_for_the_grace_period_unless_the_run_fails():
    exporter = PrometheusExporter(free_ports(1), "127.0.0.1", 0, info=INFO, grace_seconds=1.0)
    url = f"http://127.0.0.1:{exporter.port}/metrics"
    exporter.update(ROW, steps=1)
    closing = threading.Thread(target=exporter.close)
    closing.start()
    assert "longt5_step 12.0" in http_get(url)  # after the last row, while closing
    closing.join()
    with pytest.raises(OSError):
        http_get(url)
    failing = PrometheusExporter(free_ports(1), "127.0.0.1", 0, grace_seconds=30.0)
    began = time.monotonic()
    with pytest.raises(ZeroDivisionError):
        try:
            raise ZeroDivisionError
        finally:
            failing.close()
    assert time.monotonic() - began < 5


def test_an_absent_pushgateway_is_one_warning_and_training_goes_on(capsys):
    gateway = f"http://127.0.0.1:{free_ports(1)}"  # nothing listens there
    exporter = PrometheusExporter(0, "127.0.0.1", 0, info=INFO, pushgateway=gateway)
    for step in (1, 2, 3):
        exporter.update({**ROW, "step": step}, steps=1)
    exporter.close()
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: Pushgateway {gateway}: ")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("prometheus_grace_seconds", -1.0, "expected >= 0"),
        ("prometheus_pushgateway", "http://host:9091/x y", "expected a URL"),
    ],
)
def test_bad_prometheus_settings_are_one_line_errors(field, value, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(model_dir="/tmp/x", **{field: value})
    assert RunConfig(model_dir="/tmp/x", prometheus_pushgateway="gateway.local:9091")


def test_the_run_is_named_by_its_preset_or_its_sizes():
    assert LongT5Config.preset("base").name == "base-tglobal"
    assert LongT5Config.preset("small", attention="local").name == "small-local"
    custom = LongT5Config(d_model=64, d_ff=128, num_encoder_layers=2, num_decoder_layers=3)
    assert custom.name == "d64-2+3layers-tglobal"


def test_the_shipped_prometheus_configs_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    for config in sorted((MONITORING / "prometheus").glob("*.yml")):
        check = subprocess.run([promtool, "check", "config", config], capture_output=True)
        assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()


def test_the_dashboard_has_a_run_selector_and_each_panel_a_datasource_and_queries():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["run"]["definition"] == "label_values(longt5_run_info, model_dir)"
    assert variables["run"]["datasource"]["uid"] == "${datasource}"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    # The provider serves the directory the compose file mounts the dashboards at.
    provider = yaml.safe_load(
        (MONITORING / "grafana/provisioning/dashboards/longt5.yml").read_text()
    )
    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in mounts


def test_slurm_targets_list_each_process_on_its_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu07\\ngpu08\\ngpu09\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu[07-09]",
        "SLURM_TASKS_PER_NODE": "2(x2),1",
        "SLURM_JOB_ID": "4242",
    }
    script = MONITORING / "slurm_targets.sh"
    out = subprocess.run(
        ["bash", script, "9400", tmp_path / "targets"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    (group,) = json.loads((tmp_path / "targets" / "longt5-4242.json").read_text())
    assert group == {
        "targets": ["gpu07:9400", "gpu07:9401", "gpu08:9402", "gpu08:9403", "gpu09:9404"],
        "labels": {"slurm_job": "4242"},
    }


@contextlib.contextmanager
def _serving(argv: list, address: str, log: Path):
    """A server process listening on `address`, once it says it is ready; stopped after."""
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                http_get(f"http://{address}/-/ready")
                break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


# The run the real servers watch: 6 steps logged each, on two processes of 4 fake devices, with an
# evaluation at the end (for the eval loss panel) and MFU against a made-up peak.
STEPS = 6
RUN = [
    *TINY_RUN[:1],
    *TINY_RUN[2:],
    f"--gin.RunConfig.train_steps={STEPS}",
    f"--gin.EvalConfig.loss_every={STEPS}",
    "--gin.EvalConfig.loss_examples=2",
    f"--gin.EvalConfig.rouge_every={STEPS}",  # the dashboard's ROUGE panel
    "--gin.EvalConfig.rouge_examples=2",
    "--gin.DecodeConfig.max_length=8",
    "--gin.RunConfig.peak_flops_per_device=1e12",
    "--gin.RunConfig.prometheus_grace_seconds=3",
]


@pytest.mark.slow
def test_prometheus_and_a_pushgateway_answer_every_dashboard_query_for_a_two_process_run(tmp_path):
    """Prometheus scrapes the two processes' endpoints each second; a second Prometheus scrapes
    only the Pushgateway they push to. Both answer every query of the shipped dashboard for the
    run with its final figures, after the run has ended."""
    prometheus, gateway = shutil.which("prometheus"), shutil.which("prometheus-pushgateway")
    if not (prometheus and gateway):
        pytest.skip("prometheus or prometheus-pushgateway not installed (Debian packages)")
    first = free_ports(5)  # the run's two endpoints, two Prometheus servers, the gateway
    jobs = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in jobs["scrape_configs"]}
    model_dir = tmp_path / "run"
    with contextlib.ExitStack() as stack:
        address = f"127.0.0.1:{first + 4}"
        # In memory: Debian's build keeps its groups in /var/lib/prometheus by default.
        argv = [gateway, f"--web.listen-address={address}", "--persistence.file="]
        stack.enter_context(_serving(argv, address, tmp_path / "gateway.log"))
        for port, job, targets in (
            (first + 2, jobs["longt5"], [first, first + 1]),
            (first + 3, jobs["pushgateway"], [first + 4]),
        ):
            stack.enter_context(_prometheus(prometheus, port, job, targets, tmp_path / str(port)))
        launched = subprocess.run(
            [
                *(sys.executable, "-m", "longt5_jax.launch.local", "--num_processes=2", "--"),
                *RUN,
                f"--gin.RunConfig.prometheus_port={first}",
                f"--gin.RunConfig.prometheus_pushgateway='http://{address}'",
                f"--gin.MODEL_DIR='{model_dir}'",
            ],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=300,
        )
        assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
        rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").open()]
        config_hash = hashlib.sha256((model_dir / "config.gin").read_bytes()).hexdigest()[:12]
        want = {
            "step": STEPS,
            "loss": [r["loss"] for r in rows if "loss" in r][-1],
            "eval_loss": [r["eval/loss"] for r in rows if "eval/loss" in r][-1],
            "eval_rouge_lsum": [r["eval/rougeLsum"] for r in rows if "eval/rougeLsum" in r][-1],
            "config_hash": config_hash,
        }
        # Scraped: the figures of the last scrape while the endpoints served them (the grace
        # period), after the run; without it the series would end before the last step.
        scraped = first + 2
        (series,) = _query(scraped, "longt5_step[5m]")
        last_time, last_step = series["values"][-1]
        assert float(last_step) == STEPS, "the last step was never scraped"
        at = float(last_time) - 1.0  # both processes still served then
        _check_dashboard(scraped, str(model_dir), at, want)
        # Pushed: held by the gateway after the run.
        pushed = first + 3
        deadline = time.monotonic() + 10
        while not _query(pushed, f"longt5_step == {STEPS}") and time.monotonic() < deadline:
            time.sleep(0.2)
        _check_dashboard(pushed, str(model_dir), time.time(), want)
        instances = {r["metric"]["instance"] for r in _query(pushed, "longt5_run_info")}
        assert instances == {f"{model_dir}#0", f"{model_dir}#1"}


def _prometheus(binary: str, port: int, job: dict, targets: list[int], home: Path):
    """A Prometheus on `port` scraping `targets` each second as the shipped `job` does."""
    home.mkdir()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {**job, "static_configs": [{"targets": [f"127.0.0.1:{t}" for t in targets]}]}
        ],
    }
    (home / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    argv = [
        binary,
        f"--config.file={home / 'prometheus.yml'}",
        f"--storage.tsdb.path={home / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    return _serving(argv, f"127.0.0.1:{port}", home / "log")


def _query(port: int, expr: str, at: float | None = None) -> list[dict]:
    params = {"query": expr, **({"time": f"{at:.3f}"} if at else {})}
    url = f"http://127.0.0.1:{port}/api/v1/query?{urllib.parse.urlencode(params)}"
    answer = json.loads(http_get(url))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _check_dashboard(port: int, model_dir: str, at: float, want: dict) -> None:
    """Every query of the dashboard, its variables set as Grafana sets them for this run
    ($__rate_interval: 4 x the shipped 15 s scrape interval), has data at `at`: per process where
    its legend says so, and the step, losses and config hash the run logged."""
    selector = f"/api/v1/label/model_dir/values?match[]=longt5_run_info&end={at:.3f}"
    assert model_dir in json.loads(http_get(f"http://127.0.0.1:{port}{selector}"))["data"]
    run = model_dir.replace("\\", "\\\\").replace('"', '\\"')
    answers = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$run", run)
            assert "$" not in expr, expr
            result = _query(port, expr, at)
            assert result, f"{panel['title']}: no data for {expr}"
            assert all(math.isfinite(float(r["value"][1])) for r in result), (expr, result)
            if "{{process}}" in target["legendFormat"]:
                assert sorted(r["metric"]["process"] for r in result) == ["0", "1"], expr
            answers[panel["title"], target["legendFormat"]] = result
    assert float(answers["Step", "step"][0]["value"][1]) == want["step"]
    assert float(answers["Processes", "processes"][0]["value"][1]) == 2
    for panel, legend, key in (
        ("Loss", "train", "loss"),
        ("Loss", "eval", "eval_loss"),
        ("ROUGE (eval)", "rougeLsum", "eval_rouge_lsum"),
    ):
        value = float(answers[panel, legend][0]["value"][1])
        assert value == pytest.approx(want[key], rel=1e-6, abs=1e-9)
    assert float(answers["Tokens per second", "tokens/s"][0]["value"][1]) > 0
    ((info,),) = [r for key, r in answers.items() if key[0] == "Run"]
    assert info["metric"]["config_hash"] == want["config_hash"]
    assert info["metric"]["model"] == "d64-2+2layers-tglobal"
    assert info["metric"]["mesh"] == "data=4,tensor=2,pipeline=1"
