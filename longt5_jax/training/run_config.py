"""The run: where it writes, how long it trains, how it logs and on how many devices."""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model_dir: str = ""  # bound to the required MODEL_DIR macro in configs/runs/*.gin
    train_steps: int = 1000
    log_every: int = 10
    seed: int = 0
    # On a CPU-only machine, run on this many fake devices (0: use the real devices).
    cpu_devices: int = 0
    # Opt-in Prometheus /metrics on prometheus_host:(prometheus_port + process index); 0: off.
    prometheus_port: int = 0
    prometheus_host: str = "127.0.0.1"
    # How long the endpoint stays up after the last step, for a last scrape at a 15 s interval
    # (0: it closes at once, and the series ends at the scrape before the last logged step).
    prometheus_grace_seconds: float = 20.0
    # A Pushgateway ('http://host:9091') each process pushes to at every logged row and at the
    # end, for jobs too short to scrape or nodes Prometheus cannot reach ('': none).
    prometheus_pushgateway: str = ""
    # Per-device peak FLOP/s for MFU; 0 takes the known peak of A100/H100/H200 (bf16 dense).
    peak_flops_per_device: float = 0.0
    # A jax.profiler trace of steps profile_start .. + profile_steps - 1 (0: none).
    profile_start: int = 0
    profile_steps: int = 3

    def __post_init__(self):
        if not self.model_dir:
            raise ValueError(
                "RunConfig.model_dir is empty: set MODEL_DIR, e.g. "
                "--gin.MODEL_DIR=\\\"'/tmp/run'\\\""
            )
        for name in (
            "prometheus_port",
            "prometheus_grace_seconds",
            "profile_start",
            "peak_flops_per_device",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"RunConfig.{name}={getattr(self, name)}: expected >= 0")
        gateway = self.prometheus_pushgateway
        if gateway and not re.fullmatch(r"(https?://)?[\w.-]+(:\d+)?(/[\w./-]*)?", gateway):
            raise ValueError(
                f"RunConfig.prometheus_pushgateway={gateway!r}: expected a URL, "
                "e.g. 'http://host:9091'"
            )
        for name in ("train_steps", "log_every", "profile_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunConfig.{name}={getattr(self, name)}: expected >= 1")
