"""The training loop: resume or start -> steps (eval, logs, saves) -> stop.

It is given its parts (`Parts`: the sharded step, the data, the checkpoints, the periodic
evaluation, the metrics writer) by the command, `python -m longt5_jax.train`, which configures,
starts devices and builds them; the loop reads its settings from the typed `Experiment`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from longt5_jax.data.pipeline import global_batch
from longt5_jax.errors import ConfigError, RunFault
from longt5_jax.formats.native import resolve, restore_params
from longt5_jax.training import identity, summary
from longt5_jax.training.checkpoint import Checkpoints
from longt5_jax.training.distributed import agree
from longt5_jax.training.experiment import Experiment
from longt5_jax.training.metrics import LogsUnwritable, MetricsWriter, StepProfiler
from longt5_jax.training.optim import learning_rate_at
from longt5_jax.training.periodic_eval import PeriodicEval
from longt5_jax.training.step import ShardedStep, TrainState


@dataclasses.dataclass(frozen=True)
class Parts:
    """What the loop runs with; the command builds each one, the loop makes none of them."""

    step: ShardedStep
    batches: Iterator[dict[str, np.ndarray]]  # this process's rows of each training batch
    checkpoints: Checkpoints
    evaluate: PeriodicEval
    # The metrics writer, opened at the step the run starts from (it trims a resumed log there).
    open_writer: Callable[[int], MetricsWriter]
    config_text: str  # the operative gin config: MODEL_DIR/config.gin and each checkpoint's
    identity: dict[str, Any]  # tokenizer, model and objective, recorded for resumes to match


def train(exp: Experiment, parts: Parts) -> dict:
    """Train per `exp` with `parts`; returns the last logged metrics."""
    began = time.perf_counter()
    model_dir = Path(exp.run.model_dir)
    start, state, note = _first_state(exp, parts)
    if start >= exp.run.train_steps:  # before anything is written: the run is as it was
        return _nothing_to_train(exp, start)
    if agree(bool(stopped()), any):  # during start-up: nothing trained, nothing written
        print(f"{stopped()}: stopped before step {start + 1}; nothing new to save", flush=True)
        return {}
    if jax.process_index() == 0:
        (model_dir / "config.gin").write_text(parts.config_text)
        if not start or not identity.recorded(model_dir):
            identity.record(model_dir, parts.identity)
        if note:
            print(note, flush=True)
    writer = parts.open_writer(start)
    try:
        end = _steps(exp, parts, state, writer, start)
    finally:
        writer.close()  # a log it cannot close is kept in `writer.fault`, never raised
    if writer.fault:
        raise LogsUnwritable(
            f"{writer.fault}; step {end} is saved in {model_dir}/checkpoints: make room there "
            "and rerun the same command to resume"
        )
    if jax.process_index() == 0:
        wall = time.perf_counter() - began
        print(summary.text(exp, summary.Trained(start, end, wall, writer)), flush=True)
    return writer.last_train


def _nothing_to_train(exp: Experiment, saved: int) -> dict:
    """A rerun of a finished run says so; one asking for fewer steps than are saved is refused
    (training on would need the steps it already has undone)."""
    where = f"{exp.run.model_dir}/checkpoints"
    if saved > exp.run.train_steps:
        raise ConfigError(
            f"RunConfig.train_steps={exp.run.train_steps} is below step {saved} saved in "
            f"{where}: nothing was changed; set RunConfig.train_steps >= {saved} to train on, "
            "or another MODEL_DIR to start anew"
        )
    if jax.process_index() == 0:
        print(
            f"nothing left to train: step {saved} of RunConfig.train_steps={saved} is saved in "
            f"{where}; raise RunConfig.train_steps to train on",
            flush=True,
        )
        print(summary.files(exp, saved), flush=True)
    return {}


def _first_state(exp: Experiment, parts: Parts) -> tuple[int, TrainState, str]:
    """(step, state, what to say of it): the newest checkpoint's, or a fresh state (with
    `init_from`'s parameters if set)."""
    step = parts.step
    # A resumed run never initialises: the restore fills the state's shapes in place.
    start, state = parts.checkpoints.resume(step.abstract_state, parts.batches)
    if start:
        return start, state, f"resumed from step {start} in {exp.run.model_dir}/checkpoints"
    state = step.init(jax.random.key(exp.run.seed))
    if not exp.ckpt.init_from:
        return 0, state, ""
    source = resolve(exp.ckpt.init_from)
    hint = f": CheckpointConfig.init_from={exp.ckpt.init_from!r} holds another model's parameters"
    state = state.replace(params=restore_params(source, step.abstract_state.params, hint))
    return 0, state, f"parameters from {source}; optimizer and step start anew"


class NonFiniteError(RunFault):
    """A NaN or Inf loss or gradient, with updates not set to be skipped."""


class DataExhausted(RunFault):
    """The training data ran out (a finite number of epochs) before the last step."""

    @classmethod
    def after(cls, step: int, exp: Experiment) -> DataExhausted:
        kept = f"step {step} is saved" if step else "no step was trained"
        return cls(
            f"the training data ran out after step {step} of {exp.run.train_steps} "
            f"(DataConfig.num_epochs={exp.data.num_epochs}); {kept}: rerun with more data, "
            f"more epochs or RunConfig.train_steps <= {step}"
        )


def _steps(exp: Experiment, parts: Parts, state: TrainState, writer: MetricsWriter, start: int):
    """Steps from `start`; saves when due, on the last step, on SIGTERM and on a log that cannot
    be written (then returns). Returns the last step trained, saved."""
    run, skip, step, batches = exp.run, exp.step.skip_nonfinite, parts.step, parts.batches
    checkpoints, evaluate = parts.checkpoints, parts.evaluate
    rng = jax.random.key(run.seed + 1) if exp.model.dropout_rate > 0 else None
    config = {"gin": parts.config_text, "model": dataclasses.asdict(exp.model)}
    profiler = StepProfiler(run.model_dir, run.profile_start, run.profile_steps)
    bad_steps, pending, saved = 0, [], start
    for i in range(start, run.train_steps):
        with writer.timing("data"):
            local = next(batches, None)
        if local is None:  # a finite number of epochs is over: keep what was trained
            if i > saved:
                _nonfinite(pending, skip)
                checkpoints.save(i, state, batches, config, force=True)
            raise DataExhausted.after(i, exp)
        profiler.before(i + 1)
        # Counted on the host copy: reading the global arrays would stall the step pipeline.
        tokens = sum(int((local[f"{p}_segment_ids"] > 0).sum()) for p in ("encoder", "decoder"))
        batch = global_batch(local, step.batch_sharding)
        state, metrics = step(state, batch, None if rng is None else jax.random.fold_in(rng, i))
        profiler.after(i + 1, state)
        # The previous step's flag is ready by now: reading it does not stall the pipeline.
        bad_steps += _nonfinite(pending, skip)
        pending = [(i + 1, metrics["nonfinite"])]
        if i == start:  # this step compiled: time the ones after it
            jax.block_until_ready(state.step)
            writer.start(i + 1)
        else:
            writer.add_tokens(tokens * jax.process_count())
        # Read once: a signal between two reads must not skip the save. Every process stops
        # at the same step, or none does.
        stop = agree(bool(stopped()), any)
        last = i + 1 == run.train_steps or stop
        logged = (i + 1) % run.log_every == 0 or last
        if logged:
            writer.write(i + 1, _row(exp, metrics, bad_steps, i))
        if evaluate.due(i + 1):
            logged = True
            with writer.paused():
                writer.write_eval(i + 1, evaluate(i + 1, state.params))
        # A log that could not be written (a full disk) stops the run at this step, saved; asked
        # only where one was written (every process knows where: the other steps pay nothing).
        failed = logged and agree(bool(writer.fault), any)
        if last or failed or checkpoints.due(i + 1):
            bad_steps += _nonfinite(pending, skip)  # never save a state that went non-finite
            pending = []
            with writer.timing("checkpoint"):
                checkpoints.save(i + 1, state, batches, config, force=True)
            saved = i + 1
        if stop and not failed:  # else the command says why it stopped, in one line
            name = stopped() or "another process's signal"
            print(f"{name}: saved step {i + 1}; rerun the same command to resume", flush=True)
        if stop or failed:
            break
    return saved


def _row(exp: Experiment, metrics: dict, bad_steps: int, i: int) -> dict[str, float]:
    """The logged row of step i + 1: its metrics, the non-finite count and learning rate."""
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    values["nonfinite_steps"] = bad_steps + values.pop("nonfinite")
    # A skipped step (float16 overflow) leaves the optimizer's count, so its schedule.
    updates = i - int(values.get("skipped_steps", 0))
    return {**values, "learning_rate": learning_rate_at(exp.optim, max(updates, 0))}


def _nonfinite(pending: list, skip: bool) -> int:
    """1 if the pending step went non-finite (and updates are skipped), else 0; or raise."""
    if not pending or not int(pending[0][1]):
        return 0
    if not skip:
        raise NonFiniteError(
            f"step {pending[0][0]}: the loss or gradient is NaN/Inf; stopping "
            "(StepConfig.skip_nonfinite = True skips such updates)"
        )
    return 1


_STOP: dict[str, str] = {}  # the signal that asked this process to stop, by name


def _ask_to_stop(signum: int, _frame) -> None:
    name = signal.Signals(signum).name
    if name == "SIGINT" and _STOP.get("name") == "SIGINT":
        raise KeyboardInterrupt
    if name == "SIGINT" and "name" not in _STOP:  # someone at a terminal: say it was heard
        print(f"{name}: stopping after the step in flight, saving it", file=sys.stderr, flush=True)
    _STOP.setdefault("name", name)


@contextlib.contextmanager
def stopping_on_signals():
    """SIGTERM (what SLURM sends before a time limit or preemption), SIGHUP (the terminal closed,
    an ssh session dropped) and a first SIGINT (Ctrl-C) ask the run to stop after the step in
    flight, saving it; a second SIGINT stops at once.
    The command enters this first thing, so that a signal during start-up or the first compile
    is kept rather than killing the process mid-write; the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOP.clear()
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, _ask_to_stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stopped() -> str:
    """The name of the signal that asked the run to stop ('' while none has)."""
    return _STOP.get("name", "")
