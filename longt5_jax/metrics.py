"""Training metrics: a progress line, TensorBoard scalars and MODEL_DIR/metrics.jsonl."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import jax


class MetricsWriter:
    """Writes each logged step; tokens/s and ETA come from wall time between calls."""

    def __init__(
        self,
        model_dir: str | Path,
        total_steps: int,
        enabled: bool | None = None,
        resume_step: int = 0,
    ):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.total_steps = total_steps
        self._last: tuple[int, float] | None = None
        self._tokens = 0.0
        if self.enabled:
            from tensorboardX import SummaryWriter

            Path(model_dir).mkdir(parents=True, exist_ok=True)
            path = Path(model_dir) / "metrics.jsonl"
            # A resumed run repeats the steps after its checkpoint: drop their earlier rows.
            kept = [
                line
                for line in (path.read_text().splitlines() if path.exists() else [])
                if json.loads(line)["step"] <= resume_step
            ]
            path.write_text("".join(line + "\n" for line in kept))
            self._jsonl = path.open("a")
            self._tb = SummaryWriter(str(Path(model_dir) / "tensorboard"))

    def start(self, step: int) -> None:
        """Begin timing at `step` (after compilation, so the first rate is not skewed)."""
        self._last, self._tokens = (step, time.perf_counter()), 0.0

    def add_tokens(self, tokens: float) -> None:
        self._tokens += tokens

    def write(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        now = time.perf_counter()
        last_step, last_time = self._last or (step, now)
        seconds = max(now - last_time, 1e-9)
        row = {
            "step": step,
            **{k: float(v) for k, v in metrics.items()},
            "tokens_per_second": self._tokens / seconds,
            "steps_per_second": (step - last_step) / seconds,
        }
        self.start(step)
        if not self.enabled:
            return row
        rate = row["steps_per_second"]
        eta = f"{(self.total_steps - step) / rate / 60:.1f} min" if rate > 0 else "n/a"
        print(
            f"step {step:>6}/{self.total_steps}  loss {row['loss']:.4f}  "
            f"lr {row.get('learning_rate', 0):.2e}  grad_norm {row.get('grad_norm', 0):.3f}  "
            f"{row['tokens_per_second']:,.0f} tokens/s  ETA {eta}",
            flush=True,
        )
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        for k, v in row.items():
            if k != "step":
                self._tb.add_scalar(k, v, step)
        self._tb.flush()
        return row

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (evaluation) does not count against the training rate."""
        began = time.perf_counter()
        try:
            yield
        finally:
            if self._last is not None:
                self._last = (self._last[0], self._last[1] + time.perf_counter() - began)

    def write_eval(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """An evaluation row ('eval/...' metrics) in the same logs as the training rows."""
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if not self.enabled or not metrics:
            return row
        shown = "  ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in metrics.items())
        print(f"eval {step:>6}/{self.total_steps}  {shown}", flush=True)
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        for k, v in metrics.items():
            self._tb.add_scalar(k, v, step)
        self._tb.flush()
        return row

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
