"""The run: where it writes, how long it trains, how it logs and on how many devices."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model_dir: str = ""  # bound to the required MODEL_DIR macro in configs/runs/*.gin
    train_steps: int = 1000
    log_every: int = 10
    seed: int = 0
    # On a CPU-only machine, run on this many fake devices (0: use the real devices).
    cpu_devices: int = 0

    def __post_init__(self):
        if not self.model_dir:
            raise ValueError(
                "RunConfig.model_dir is empty: set MODEL_DIR, e.g. "
                "--gin.MODEL_DIR=\\\"'/tmp/run'\\\""
            )
        for name in ("train_steps", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunConfig.{name}={getattr(self, name)}: expected >= 1")
