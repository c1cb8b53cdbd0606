"""Prometheus export of a run: a `/metrics` endpoint per process and, opted in, Pushgateway pushes.

Named by Prometheus' conventions (docs/monitoring.md has the table): counters (`_total`) for what
adds up, gauges for the latest value, units in the names. A figure every process shares (loss,
step, tokens of the global batch) is exported by process 0 alone, so a `sum()` over processes
never counts it twice; a figure each process has its own of (step time, time waiting for data or
saving) is labelled `process`. `longt5_run_info` (value 1, on every process) names the run each
endpoint belongs to; dashboards select a run by joining it on (job, instance).

The endpoint binds 127.0.0.1 unless told otherwise (metrics are not for the whole network by
default); process i of a run listens on `port + i`, so processes on one host do not collide.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Info,
    push_to_gateway,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

# Ports that grain's and orbax's own debug servers may take.
RESERVED = (9431,)
JOB = "longt5"  # the Pushgateway job; the shipped scrape configs name theirs the same

# Logged figures each process has its own of: (row key, metric, help).
PER_PROCESS_GAUGES = (
    ("step_seconds", "longt5_step_seconds", "wall seconds per step over the last logged steps"),
)
# What each process adds up: (key of MetricsWriter's timings, metric, help).
PER_PROCESS_COUNTERS = (
    ("data", "longt5_data_wait_seconds", "seconds spent waiting for a training batch"),
    ("checkpoint", "longt5_checkpoint_seconds", "seconds spent saving checkpoints"),
)
# Logged figures of the whole run: (metric, help); any other key (eval/loss, ...) becomes a gauge
# named by `_name` ('eval/rouge1' -> longt5_eval_rouge1, 'eval/rougeLsum' -> ..._rouge_lsum).
GLOBAL_GAUGES = {
    "step": ("longt5_step", "the latest logged training step"),
    "loss": ("longt5_loss", "training loss per target token at the latest logged step"),
    "z_loss": ("longt5_z_loss", "z-loss per target token at the latest logged step"),
    "accuracy": ("longt5_accuracy", "target token accuracy at the latest logged step"),
    "tokens": ("longt5_target_tokens", "target tokens the latest logged step's loss was over"),
    "grad_norm": ("longt5_grad_norm", "global L2 norm of the latest logged step's gradients"),
    "learning_rate": ("longt5_learning_rate", "learning rate of the latest logged step"),
    "mfu": ("longt5_mfu_ratio", "model FLOPs utilisation over the last logged steps"),
    # float16 runs (dynamic loss scaling); the skipped count is the run's, restored on resume.
    "loss_scale": ("longt5_loss_scale", "the loss scale the latest logged step ran with"),
    "skipped_steps": ("longt5_skipped_steps", "steps skipped for overflowing gradients, all run"),
}
# Row figures Prometheus derives itself: rate() of the counters.
DERIVED = ("tokens_per_second", "steps_per_second", "data_wait_seconds", "checkpoint_seconds")


class PrometheusExporter:
    """One process's figures: served on `host:port + process` (port 0: no endpoint), pushed to
    `pushgateway` (a URL; '' none), and served `grace_seconds` more after the run for a last
    scrape. `info` names the run in `longt5_run_info`."""

    def __init__(
        self,
        port: int,
        host: str,
        process: int,
        info: dict[str, str] | None = None,
        grace_seconds: float = 0.0,
        pushgateway: str = "",
    ):
        if port and port + process in RESERVED:
            raise ValueError(f"RunConfig.prometheus_port={port}: port {port + process} is taken")
        # A registry per run: several runs in one Python process must not share series.
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self.process, self.grace_seconds = str(process), grace_seconds
        self._global = process == 0
        self._latest = _Latest()
        self.registry.register(self._latest)
        self._counters = self._make_counters()
        self._nonfinite = 0.0
        run = Info(
            "longt5_run", "the run this process belongs to", ["process"], registry=self.registry
        )
        run.labels(self.process).info(info or {})
        self._server = self._serve(port, host, process) if port else None
        self.port = self._server[0].server_port if self._server else 0
        self._pusher = None
        if pushgateway:  # pushed at once too: the run shows while it compiles
            self._pusher = _Pusher(pushgateway, self.registry, process, info)
            self._pusher.push()

    def _make_counters(self) -> dict[str, Counter]:
        """Counters start at 0 so that `rate()` sees their first increase."""
        counters = {}
        for key, name, doc in PER_PROCESS_COUNTERS:
            counters[key] = Counter(name, doc, ["process"], registry=self.registry)
            counters[key].labels(self.process)
        if self._global:
            for key, doc in (
                ("steps", "training steps run by this process since it started"),
                ("tokens", "non-padding input and target tokens trained on, all processes"),
                ("nonfinite_steps", "steps whose loss or gradients were not finite"),
            ):
                counters[key] = Counter(f"longt5_{key}", doc, registry=self.registry)
        return counters

    def _serve(self, port: int, host: str, process: int):
        try:
            return start_http_server(port + process, addr=host, registry=self.registry)
        except OSError as e:
            raise ValueError(
                f"RunConfig.prometheus_port={port}: cannot listen on {host}:{port + process} ({e})"
            ) from None

    def update(
        self,
        row: dict[str, float],
        steps: int = 0,
        tokens: float = 0.0,
        spent: dict[str, float] | None = None,
    ) -> None:
        """A logged row, and what the steps since the last one added up to: `steps`, `tokens`
        (of all processes) and the seconds `spent` per MetricsWriter timing ('data', ...)."""
        for key, _, _ in PER_PROCESS_COUNTERS:
            self._counters[key].labels(self.process).inc((spent or {}).get(key, 0.0))
        latest = {
            name: (doc, {"process": self.process}, row[key])
            for key, name, doc in PER_PROCESS_GAUGES
            if key in row
        }
        if self._global:
            latest |= self._update_global(row, steps, tokens)
        self._latest.update(latest)
        if self._pusher is not None and row:
            self._pusher.push()

    def _update_global(self, row: dict[str, float], steps: int, tokens: float) -> Gauges:
        """Counts the run-wide counters up; returns the run-wide gauges of `row`."""
        self._counters["steps"].inc(steps)
        self._counters["tokens"].inc(tokens)
        if "nonfinite_steps" in row:  # the loop's running count since this process started
            self._counters["nonfinite_steps"].inc(max(row["nonfinite_steps"] - self._nonfinite, 0))
            self._nonfinite = max(row["nonfinite_steps"], self._nonfinite)
        skipped = {key for key, _, _ in PER_PROCESS_GAUGES} | set(DERIVED) | {"nonfinite_steps"}
        latest: Gauges = {}
        for key, value in row.items():
            if key not in skipped:
                name, doc = GLOBAL_GAUGES.get(key) or (_name(key), f"the latest logged {key}")
                latest[name] = (doc, {}, float(value))
        return latest

    def close(self) -> None:
        """The last push; then, unless the run is failing (its launcher is stopping the other
        processes), the final figures stay served for a last scrape: without that a run's
        series ends at the scrape before its last logged step."""
        try:
            if self._pusher is not None:
                self._pusher.close()
            if self._server and self.grace_seconds and sys.exc_info()[0] is None:
                if self._global:
                    print(
                        f"metrics served {self.grace_seconds:g} s more for a last scrape "
                        "(RunConfig.prometheus_grace_seconds)",
                        flush=True,
                    )
                time.sleep(self.grace_seconds)
        finally:
            if self._server:
                server, thread = self._server
                server.shutdown()
                server.server_close()
                thread.join(timeout=5)


def _name(key: str) -> str:
    """A logged key as a metric name in Prometheus' snake_case, which `promtool check metrics`
    holds every name to: a capital starts a word ('rougeL' -> 'rouge_l'), any other character
    outside [a-z0-9_] separates one."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key).lower()
    return "longt5_" + re.sub(r"[^a-z0-9_]+", "_", snake).strip("_")


# {name: (help, labels, value)} of the latest logged gauges.
Gauges = dict[str, tuple[str, dict[str, str], float]]


class _Latest:
    """The latest logged gauges, {name: (help, labels, value)}, replaced whole at each row: a
    scrape sees one row's loss, step and learning rate, never the step of one and the loss of
    the row before."""

    def __init__(self):
        self._values: Gauges = {}

    def update(self, values: Gauges) -> None:
        self._values = {**self._values, **values}  # one assignment: what a scrape reads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, (doc, labels, value) in self._values.items():
            family = GaugeMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            yield family


class _Pusher:
    """Pushes the registry to a Pushgateway from a thread of its own, so that a slow or absent
    gateway never holds up a step; a failure is said once, on stderr, and training goes on. The
    group is (job, instance=MODEL_DIR#process): a resumed run replaces its own groups."""

    def __init__(self, url: str, registry: CollectorRegistry, process: int, info: dict | None):
        self.url, self._registry = url, registry
        run = (info or {}).get("model_dir", "")
        self._grouping = {"instance": f"{run}#{process}"}
        self._wanted, self._closing, self._failed = threading.Event(), False, False
        self._thread = threading.Thread(target=self._run, name="pushgateway", daemon=True)
        self._thread.start()

    def push(self) -> None:
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            last = self._closing  # read before pushing: what was set before close() goes out
            try:
                push_to_gateway(
                    self.url, JOB, self._registry, grouping_key=self._grouping, timeout=10
                )
            except OSError as e:
                if not self._failed:
                    print(f"warning: Pushgateway {self.url}: {e}", file=sys.stderr, flush=True)
                self._failed = True
            if last:
                return

    def close(self) -> None:
        self._closing = True
        self._wanted.set()
        self._thread.join(timeout=15)
