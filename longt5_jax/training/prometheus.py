"""An opt-in Prometheus `/metrics` endpoint: each process serves its own latest figures.

Bound to 127.0.0.1 unless told otherwise (metrics are not for the whole network by default);
process i of a run listens on `port + i`, so several processes on one host do not collide.
Every logged figure becomes a gauge `longt5_<name>` ('eval/rouge1' -> longt5_eval_rouge1)
labelled with the process index.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Gauge, start_http_server

# Ports that grain's and orbax's own debug servers may take.
RESERVED = (9431,)


class PrometheusExporter:
    def __init__(self, port: int, host: str, process: int):
        if port + process in RESERVED:
            raise ValueError(f"RunConfig.prometheus_port={port}: port {port + process} is taken")
        # A registry per run: several runs in one Python process must not share gauges.
        self.registry = CollectorRegistry()
        self.process = str(process)
        self._gauges: dict[str, Gauge] = {}
        try:
            self._server, self._thread = start_http_server(
                port + process, addr=host, registry=self.registry
            )
        except OSError as e:
            raise ValueError(
                f"RunConfig.prometheus_port={port}: cannot listen on {host}:{port + process} ({e})"
            ) from None
        self.port = self._server.server_port

    def update(self, row: dict[str, float]) -> None:
        for key, value in row.items():
            name = "longt5_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            if name not in self._gauges:
                self._gauges[name] = Gauge(
                    name, f"the latest logged {key}", ["process"], registry=self.registry
                )
            self._gauges[name].labels(process=self.process).set(float(value))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
