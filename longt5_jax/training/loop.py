"""The training loop: resume or start -> steps, each followed by the hooks due (log, eval, save,
profile, stop: hooks.py) -> stop.

It is given its parts (`Parts`: the sharded step, the data, the checkpoints, the periodic
evaluation, the metrics writer, more hooks if any) by the command, `python -m longt5_jax.train`,
which configures, starts devices and builds them; the loop reads its settings from the typed
`Experiment`.
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
from types import FrameType
from typing import Any, cast

import jax

from longt5_jax.data.pipeline import Batch, global_batch
from longt5_jax.errors import ConfigError, RunFault
from longt5_jax.formats.native import resolve, restore_params
from longt5_jax.training import identity, summary
from longt5_jax.training.checkpoint import Checkpoints
from longt5_jax.training.distributed import agree
from longt5_jax.training.experiment import Experiment
from longt5_jax.training.hooks import Cadence, Hook, Schedule, Tick
from longt5_jax.training.metrics import (
    LoggedStats,
    LogsUnwritable,
    MetricsWriter,
    StepProfiler,
)
from longt5_jax.training.optim import learning_rate_at
from longt5_jax.training.periodic_eval import PeriodicEval
from longt5_jax.training.step import ShardedStep, StepStats, TrainState


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parts:
    """What the loop runs with; the command builds each one, the loop makes none of them."""

    step: ShardedStep
    batches: Iterator[Batch]  # this process's rows of each training batch (a GlobalRows)
    checkpoints: Checkpoints
    evaluate: PeriodicEval
    # The metrics writer, opened at the step the run starts from (it trims a resumed log there).
    open_writer: Callable[[int], MetricsWriter]
    config_text: str  # the operative gin config: MODEL_DIR/config.gin and each checkpoint's
    identity: dict[str, Any]  # tokenizer, model and objective, recorded for resumes to match
    # More periodic actions, each with its cadence, run after the loop's own (hooks.py).
    hooks: tuple[Hook, ...] = ()


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run starts: the step and state, and what to say of them."""

    step: int  # the step the state has trained (0: a new run)
    state: TrainState
    note: str  # '' for a new run


def train(exp: Experiment, parts: Parts) -> dict[str, float]:
    """Train per `exp` with `parts`; returns the last logged metrics."""
    began = time.perf_counter()
    model_dir = Path(exp.run.model_dir)
    first = _first_state(exp, parts)
    start = first.step
    if start >= exp.run.train_steps:  # before anything is written: the run is as it was
        return _nothing_to_train(exp, start)
    if agree(bool(stopped()), any):  # during start-up: nothing trained, nothing written
        print(f"{stopped()}: stopped before step {start + 1}; nothing new to save", flush=True)
        return {}
    if jax.process_index() == 0:
        (model_dir / "config.gin").write_text(parts.config_text)
        if not start or not identity.recorded(model_dir):
            identity.record(model_dir, parts.identity)
        if first.note:
            print(first.note, flush=True)
    writer = parts.open_writer(start)
    try:
        end = _steps(exp, parts, first, writer)
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


def _nothing_to_train(exp: Experiment, saved: int) -> dict[str, float]:
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


def _first_state(exp: Experiment, parts: Parts) -> Start:
    """The newest checkpoint's step and state, or a fresh state (with `init_from`'s parameters
    if set)."""
    step = parts.step
    # A resumed run never initialises: the restore fills the state's shapes in place.
    start, state = parts.checkpoints.resume(step.abstract_state, parts.batches)
    if start:
        return Start(start, state, f"resumed from step {start} in {exp.run.model_dir}/checkpoints")
    state = step.init(jax.random.key(exp.run.seed))
    if not exp.ckpt.init_from:
        return Start(0, state, "")
    source = resolve(exp.ckpt.init_from)
    hint = f": CheckpointConfig.init_from={exp.ckpt.init_from!r} holds another model's parameters"
    params = restore_params(source, step.abstract_state.params, hint)
    state = dataclasses.replace(state, params=params)
    return Start(0, state, f"parameters from {source}; optimizer and step start anew")


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


def _steps(exp: Experiment, parts: Parts, first: Start, writer: MetricsWriter) -> int:
    """Steps from `first`, each followed by the hooks due (`_hooks`); saves on data running out
    (then raises DataExhausted). Returns the last step trained, saved."""
    run, step, batches, state = exp.run, parts.step, parts.batches, first.state
    rng = jax.random.key(run.seed + 1) if exp.model.dropout_rate > 0 else None
    flags = _Flags(exp.step.skip_nonfinite)
    config = {"gin": parts.config_text, "model": dataclasses.asdict(exp.model)}
    saves = _Saves(parts, config, first.step)
    schedule = Schedule(
        _hooks(exp, parts, writer, flags, saves),
        # Asked only where a log was written: every process knows where, so they all ask alike.
        logs_failed=lambda: agree(bool(writer.fault), any),
    )
    for i in range(first.step, run.train_steps):
        with writer.timing("data"):
            local = next(batches, None)
        if local is None:  # a finite number of epochs is over: keep what was trained
            if i > saves.saved:
                saves.save(i, state, flags)
            raise DataExhausted.after(i, exp)
        schedule.before(i + 1)
        # Counted on the host copy: reading the global arrays would stall the step pipeline.
        tokens = int((local["encoder_segment_ids"] > 0).sum())
        tokens += int((local["decoder_segment_ids"] > 0).sum())
        batch = global_batch(local, step.batch_sharding)
        state, stats = step(state, batch, None if rng is None else jax.random.fold_in(rng, i))
        flags.push(i + 1, stats["nonfinite"])
        if i == first.step:  # this step compiled: time the ones after it
            state.step.block_until_ready()
            writer.start(i + 1)
        else:
            writer.add_tokens(tokens * jax.process_count())
        # Read once: a signal between two reads must not skip the save. Every process stops
        # at the same step, or none does.
        stop = agree(bool(stopped()), any)
        tick = Tick(i + 1, state, stats, last=i + 1 == run.train_steps or stop, stop=stop)
        schedule.after(tick)
        if tick.ends:
            break
    return saves.saved


def _hooks(
    exp: Experiment, parts: Parts, writer: MetricsWriter, flags: _Flags, saves: _Saves
) -> list[Hook]:
    """The loop's own hooks: log, eval, save, profile, then `parts.hooks`, then stop."""
    run, evaluate = exp.run, parts.evaluate
    profiler = StepProfiler(run.model_dir, run.profile_start, run.profile_steps)

    def log(tick: Tick) -> None:
        writer.write(tick.step, _row(exp, tick.stats, flags.count, tick.step - 1))

    def evaluation(tick: Tick) -> None:
        with writer.paused():
            writer.write_eval(tick.step, evaluate(tick.step, tick.state.params))

    def save(tick: Tick) -> None:
        saves.save(tick.step, tick.state, flags, writer.timing("checkpoint"))

    def say_stopped(tick: Tick) -> None:
        if not tick.failed:  # else the command says why it stopped, in one line
            name = stopped() or "another process's signal"
            print(f"{name}: saved step {tick.step}; rerun the same command to resume", flush=True)

    return [
        Hook("log", Cadence(every=run.log_every, last=True), log, writes_logs=True),
        Hook("eval", Cadence(due=evaluate.due), evaluation, writes_logs=True),
        # A log that could not be written (a full disk) stops the run at this step, saved.
        Hook("save", Cadence(last=True, failed=True, due=parts.checkpoints.due), save),
        Hook(
            "profile",
            Cadence(due=profiler.stops_at),
            lambda tick: profiler.stop(tick.state),
            before=profiler.before,
        ),
        *parts.hooks,
        Hook("stop", Cadence(stop=True), say_stopped),
    ]


class _Flags:
    """The non-finite flags of the steps, each read one step late (by then it is ready, so
    reading it does not stall the step pipeline), or before a save."""

    def __init__(self, skip: bool):
        self.skip, self.count = skip, 0  # steps that went non-finite, their updates skipped
        self.pending: tuple[int, jax.Array] | None = None  # (step, its flag) not yet read

    def push(self, step: int, flag: jax.Array) -> None:
        """Read the pending flag, and keep `step`'s for later."""
        self.settle()
        self.pending = (step, flag)

    def settle(self) -> None:
        """Read the pending flag: count it (updates skipped) or raise NonFiniteError."""
        pending, self.pending = self.pending, None
        if pending is None or not int(pending[1]):
            return
        if not self.skip:
            raise NonFiniteError(
                f"step {pending[0]}: the loss or gradient is NaN/Inf; stopping "
                "(StepConfig.skip_nonfinite = True skips such updates)"
            )
        self.count += 1


class _Saves:
    """The run's saves, each forced, with the data stream's position and the config."""

    def __init__(self, parts: Parts, config: dict[str, Any], saved: int):
        self.checkpoints, self.batches, self.config = parts.checkpoints, parts.batches, config
        self.saved = saved  # the last step saved (or resumed from)

    def save(
        self,
        step: int,
        state: TrainState,
        flags: _Flags,
        timing: contextlib.AbstractContextManager[None] | None = None,
    ) -> None:
        flags.settle()  # never save a state that went non-finite
        with timing or contextlib.nullcontext():
            self.checkpoints.save(step, state, self.batches, self.config, force=True)
        self.saved = step


def _row(exp: Experiment, stats: StepStats, bad_steps: int, i: int) -> LoggedStats:
    """The logged row of step i + 1: its statistics, the non-finite count and learning rate."""
    values = {k: float(v) for k, v in jax.device_get(stats).items()}
    values["nonfinite_steps"] = bad_steps + values.pop("nonfinite")
    # A skipped step (float16 overflow) leaves the optimizer's count, so its schedule.
    updates = i - int(values.get("skipped_steps", 0))
    # In the step's key order (sorted, as jax returns a dict), then these two.
    row = {**values, "learning_rate": learning_rate_at(exp.optim, max(updates, 0))}
    return cast(LoggedStats, row)


_STOP: dict[str, str] = {}  # the signal that asked this process to stop, by name


def _ask_to_stop(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if name == "SIGINT" and _STOP.get("name") == "SIGINT":
        raise KeyboardInterrupt
    if name == "SIGINT" and "name" not in _STOP:  # someone at a terminal: say it was heard
        print(f"{name}: stopping after the step in flight, saving it", file=sys.stderr, flush=True)
    _STOP.setdefault("name", name)


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
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
