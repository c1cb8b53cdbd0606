"""Training metrics: a progress line, TensorBoard scalars, MODEL_DIR/metrics.jsonl and, opted in,
a Prometheus endpoint; and a profiler trace of chosen steps."""

from __future__ import annotations

import contextlib
import errno
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

import jax

from longt5_jax.errors import RunFault
from longt5_jax.formats.atomic import write_atomic
from longt5_jax.training.tensorboard import TensorBoard


class LoggedStats(TypedDict):
    """A training step's logged figures: its statistics (training/step.py's StepStats) as
    floats, less the flag, with the non-finite steps so far and the learning rate."""

    accuracy: float
    grad_norm: float
    loss: float
    loss_scale: NotRequired[float]  # where the loss is scaled (float16): the step's scale
    skipped_steps: NotRequired[float]  # where the loss is scaled: updates skipped so far
    tokens: float
    z_loss: float
    nonfinite_steps: float
    learning_rate: float


class LogsUnwritable(RunFault):
    """metrics.jsonl or TensorBoard's events could not be written (a full disk): the loop saves
    the step and stops with this."""


class MetricsWriter:
    """Writes each logged step; tokens/s and ETA come from wall time between calls.

    A log that cannot be written (a full disk) never interrupts a step: writing stops, `fault`
    says which file and why, and the loop saves the step and stops on it."""

    def __init__(
        self,
        model_dir: str | Path,
        total_steps: int,
        enabled: bool | None = None,
        resume_step: int = 0,
        exporter: Any = None,
        flops_per_step: float = 0.0,
        peak_flops: float = 0.0,
        eval_split: str = "eval",
        config_text: str = "",
        hparams: dict[str, Any] | None = None,
    ):
        """`exporter` (a PrometheusExporter) serves every row on this process; MFU is logged
        when both the model FLOPs of a step and the devices' total peak FLOP/s are known.
        TensorBoard gets training and the `eval_split`'s evaluations as two runs, the operative
        `config_text` and the `hparams` (tensorboard.py)."""
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.total_steps = total_steps
        self.exporter, self.flops_per_step, self.peak_flops = exporter, flops_per_step, peak_flops
        self._last: tuple[int, float] | None = None
        self._tokens = 0.0
        self._spent: dict[str, float] = {}
        self.fault = ""  # 'PATH: why' of the first log that could not be written
        # The whole run's rate, for the summary: (first timed step, its time), tokens, pauses.
        self._began: float | None = None
        self._all_tokens, self._paused, self._timed = 0.0, 0.0, (0.0, 0.0)
        self.last_train: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self.eval_split = eval_split
        if self.enabled:
            Path(model_dir).mkdir(parents=True, exist_ok=True)
            path = self._jsonl_path = Path(model_dir) / "metrics.jsonl"
            try:
                kept = _rows_until(path, resume_step)
                write_atomic(path, "".join(line + "\n" for line in kept))
                self._jsonl = path.open("a")
                self._tb = TensorBoard(model_dir, resume_step, config_text, hparams)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise  # a path that is not writable: bad input, said as such
                raise LogsUnwritable(f"{_where(e, path)}; no step was trained") from None

    def start(self, step: int) -> None:
        """Begin timing at `step` (after compilation, so the first rate is not skewed)."""
        self._last, self._tokens, self._spent = (step, time.perf_counter()), 0.0, {}
        if self._began is None:
            self._began = self._last[1]

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        """Count the time inside as `kind` ('data' waiting for a batch, 'checkpoint' saving)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._spent[kind] = self._spent.get(kind, 0.0) + time.perf_counter() - began

    def add_tokens(self, tokens: float) -> None:
        self._tokens += tokens
        self._all_tokens += tokens

    def write(self, step: int, metrics: LoggedStats) -> dict[str, float]:
        """Logs `step`'s figures with the rates since the last call."""
        now = time.perf_counter()
        last_step, last_time = self._last or (step, now)
        seconds = max(now - last_time, 1e-9)
        steps = step - last_step
        figures = cast(Mapping[str, float], metrics)  # every value of LoggedStats is a float
        row = {
            "step": step,
            **{k: float(v) for k, v in figures.items()},
            "tokens_per_second": self._tokens / seconds,
            "steps_per_second": steps / seconds,
            "step_seconds": seconds / max(steps, 1),
            "data_wait_seconds": self._spent.get("data", 0.0) / max(steps, 1),
            "checkpoint_seconds": self._spent.get("checkpoint", 0.0),
        }
        if self.flops_per_step and self.peak_flops and steps:
            row["mfu"] = self.flops_per_step * row["steps_per_second"] / self.peak_flops
        if self.exporter is not None:  # before start(): its counters take this interval's sums
            self.exporter.update(row, steps=steps, tokens=self._tokens, spent=self._spent)
        self.start(step)
        self.last_train = row
        self._timed = (self._all_tokens, now - (self._began or now) - self._paused)
        if not self.enabled:
            return row
        rate = row["steps_per_second"]
        eta = f"{(self.total_steps - step) / rate / 60:.1f} min" if rate > 0 else "n/a"
        mfu = f"  MFU {row['mfu']:.1%}" if "mfu" in row else ""
        scaled = ""
        if "loss_scale" in row:  # float16: the scale and how many steps overflowed so far
            scaled = f"  loss scale {row['loss_scale']:g} ({row['skipped_steps']:g} skipped)"
        print(
            f"step {step:>6}/{self.total_steps}  loss {row['loss']:.4f}  "
            f"lr {row.get('learning_rate', 0):.2e}  grad_norm {row.get('grad_norm', 0):.3f}"
            f"{scaled}  {row['tokens_per_second']:,.0f} tokens/s{mfu}  ETA {eta}",
            flush=True,
        )
        self._log(row, lambda: self._tb.train(step, row))
        return row

    def _log(self, row: dict[str, float], tensorboard: Any) -> None:
        """`row` to metrics.jsonl and `tensorboard()`; an error stops the logs (`fault`)."""
        try:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        except OSError as e:
            self._stop_logs(e, self._jsonl_path)
            return
        try:
            tensorboard()
        except OSError as e:
            self._stop_logs(e, self._tb.root)

    def _stop_logs(self, error: OSError, path: Path) -> None:
        self.fault, self.enabled = self.fault or _where(error, path), False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (evaluation) does not count against the training rate."""
        began = time.perf_counter()
        try:
            yield
        finally:
            if self._last is not None:
                self._last = (self._last[0], self._last[1] + time.perf_counter() - began)
                self._paused += time.perf_counter() - began

    def write_eval(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """An evaluation row ('eval/...' metrics) in the same logs as the training rows."""
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if self.exporter is not None:
            self.exporter.update(metrics)
        if metrics:
            self.last_eval = row
        if not self.enabled or not metrics:
            return row
        shown = "  ".join(
            f"{k.removeprefix('eval/')} {v:,.0f}"
            if k == "eval/tokens"
            else f"{k.removeprefix('eval/')} {v:.4f}"
            for k, v in metrics.items()
        )
        print(f"eval {step:>6}/{self.total_steps}  {shown}", flush=True)
        self._log(row, lambda: self._tb.eval(step, self.eval_split, metrics))
        return row

    def tokens_per_second(self) -> float:
        """The mean rate of the run's timed steps (the first, compiled, and evaluations out)."""
        tokens, seconds = self._timed
        return tokens / seconds if seconds > 0 else 0.0

    def close(self) -> None:
        if self.exporter is not None:  # the last save came after the last row: counted here
            self.exporter.update({}, spent=self._spent)
            self.exporter.close()
        if not hasattr(self, "_tb"):  # not process 0
            return
        for close, path in ((self._jsonl.close, self._jsonl_path), (self._tb.close, self._tb.root)):
            try:
                close()
            except OSError as e:
                self._stop_logs(e, path)


# Dense half-precision peak FLOP/s per device (bf16; fp16 on a V100, which has no bf16), by a
# piece of the device kind's name.
PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "V100": 125e12, "TPU v4": 275e12}


def peak_flops(devices: list, per_device_override: float = 0.0) -> float:
    """Total peak FLOP/s of `devices` (0 when unknown, e.g. CPUs: then no MFU is logged)."""
    if per_device_override:
        return per_device_override * len(devices)
    kind = getattr(devices[0], "device_kind", "")
    return next((v * len(devices) for k, v in PEAK_FLOPS.items() if k in kind), 0.0)


def _where(error: OSError, path: Path) -> str:
    """'PATH: why' of a failed write (a file object's error names no file)."""
    return f"{error.filename or path}: {error.strerror or error}"


def _rows_until(path: Path, step: int) -> list[str]:
    """The rows of metrics.jsonl up to `step`: a resumed run repeats the steps after its
    checkpoint. A row a kill cut short (only ever the last) is not JSON and goes too."""
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row["step"] <= step:
            kept.append(line)
    return kept


class StepProfiler:
    """A jax.profiler trace of steps first .. first + count - 1 into MODEL_DIR/profile."""

    def __init__(self, model_dir: str | Path, first: int, count: int):
        self.dir, self.first, self.last = Path(model_dir) / "profile", first, first + count - 1

    def before(self, step: int) -> None:
        """Start the trace ahead of dispatching the first traced step."""
        if self.first and step == self.first:
            jax.profiler.start_trace(str(self.dir))

    def stops_at(self, step: int) -> bool:
        return bool(self.first) and step == self.last

    def stop(self, state: Any) -> None:
        """End the trace after the last traced step (`state`: what it computed)."""
        jax.block_until_ready(state)  # the traced steps' device work, not just dispatch
        jax.profiler.stop_trace()
        if jax.process_index() == 0:
            print(f"profile of steps {self.first}-{self.last} in {self.dir}", flush=True)
