"""The training loop: data -> sharded state -> resume -> steps (eval, logs, saves) -> stop.

Reads like its table of contents; `python -m longt5_jax.train` configures it and starts devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
from pathlib import Path

from longt5_jax.cli import RunFault
from longt5_jax.training.distributed import agree


def train(cfg: dict) -> dict:
    """Train per `cfg`; returns the last logged metrics."""
    import jax

    from longt5_jax import configuration
    from longt5_jax.data.pipeline import make_dataset
    from longt5_jax.infer.evaluation import PeriodicEval
    from longt5_jax.model import LongT5, count_params
    from longt5_jax.parallel.mesh import make_mesh
    from longt5_jax.training import identity
    from longt5_jax.training.checkpoint import Checkpoints
    from longt5_jax.training.optim import make_optimizer
    from longt5_jax.training.step import ShardedStep

    run, model_cfg, data_cfg = cfg["run"], cfg["model"], cfg["data"]
    model_dir = Path(run.model_dir)
    tokenizer, pinned = _tokenizer(cfg)
    # The data opens first: a bad file is reported before any state is built.
    batches = iter(make_dataset(data_cfg, tokenizer, "train"))
    mesh = make_mesh(cfg["mesh"])
    model = LongT5(model_cfg, runner=cfg["mesh"].pipeline_plan())
    step = ShardedStep(model, cfg["step"], make_optimizer(cfg["optim"]), mesh, cfg["mesh"])
    if jax.process_index() == 0:
        print(
            f"{count_params(step.abstract_state.params) / 1e6:.2f}M parameters, mesh "
            f"{dict(mesh.shape)}, ZeRO-{cfg['mesh'].zero_stage}, {jax.device_count()} devices",
            flush=True,
        )

    # Every start-up check before anything is written to MODEL_DIR: the metrics port, the eval
    # data, the checkpoints to resume (a run that cannot start leaves MODEL_DIR as it was).
    exporter = _exporter(cfg)
    evaluate = PeriodicEval(cfg["eval"], data_cfg, cfg["decode"], tokenizer, step).open(
        run.train_steps
    )
    checkpoints = Checkpoints(model_dir, cfg["ckpt"], tokenizer.proto)
    try:
        start, state, note = _first_state(cfg, step, checkpoints, batches)
        if agree(bool(stopped()), any):  # during start-up: nothing trained, nothing written
            print(f"{stopped()}: stopped before step {start + 1}; nothing new to save", flush=True)
            return {}
        if jax.process_index() == 0:
            (model_dir / "config.gin").write_text(configuration.operative_config())
            if not start or not identity.recorded(model_dir):
                identity.record(model_dir, pinned)
            if note:
                print(note, flush=True)
        writer = _metrics_writer(cfg, start, exporter)
        try:
            return _loop(cfg, step, state, batches, checkpoints, writer, start, evaluate)
        finally:
            writer.close()
    finally:
        checkpoints.close()


def _first_state(cfg: dict, step, checkpoints, batches) -> tuple:
    """(step, state, what to say of it): the newest checkpoint's, or a fresh state (with
    `init_from`'s parameters if set)."""
    import jax

    from longt5_jax.formats.native import resolve, restore_params

    # A resumed run never initialises: the restore fills the state's shapes in place.
    start, state = checkpoints.resume(step.abstract_state, batches)
    if start:
        return start, state, f"resumed from step {start} in {cfg['run'].model_dir}/checkpoints"
    state = step.init(jax.random.key(cfg["run"].seed))
    if not cfg["ckpt"].init_from:
        return 0, state, ""
    source = resolve(cfg["ckpt"].init_from)
    state = state.replace(params=restore_params(source, step.abstract_state.params))
    return 0, state, f"parameters from {source}; optimizer and step start anew"


def _tokenizer(cfg: dict) -> tuple:
    """The run's tokenizer, checked against the model, and the run's identity (tokenizer, model,
    objective), checked against the run it resumes."""
    from longt5_jax import configuration
    from longt5_jax.data.pipeline import load_tokenizer
    from longt5_jax.training import identity

    model_cfg, data_cfg = cfg["model"], cfg["data"]
    tokenizer = load_tokenizer(data_cfg)
    pinned = identity.of(tokenizer.proto, str(tokenizer.path), model_cfg, data_cfg.objective)
    identity.check(cfg["run"].model_dir, pinned)  # a resume is the run it resumes, or refused
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise configuration.ConfigError(
            f"LongT5Config.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ids (use {tokenizer.padded_vocab_size})"
        )
    return tokenizer, pinned


def _exporter(cfg: dict):
    """The opt-in Prometheus endpoint, its port taken now (a port in use is a start-up error)."""
    import jax

    from longt5_jax.configuration import ConfigError

    run = cfg["run"]
    if not run.prometheus_port:
        return None
    from longt5_jax.training.prometheus import PrometheusExporter

    try:
        return PrometheusExporter(run.prometheus_port, run.prometheus_host, jax.process_index())
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _metrics_writer(cfg: dict, start: int, exporter):
    """Logs, TensorBoard, the Prometheus endpoint if any, and MFU where the peak is known."""
    import jax

    from longt5_jax.plan.flops import train_flops_per_step
    from longt5_jax.training.metrics import MetricsWriter, peak_flops

    run, data = cfg["run"], cfg["data"]
    return MetricsWriter(
        run.model_dir,
        run.train_steps,
        resume_step=start,
        exporter=exporter,
        flops_per_step=train_flops_per_step(
            cfg["model"], data.batch_size, data.input_length, data.target_length
        ),
        peak_flops=peak_flops(jax.devices(), run.peak_flops_per_device),
    )


class NonFiniteError(RunFault):
    """A NaN or Inf loss or gradient, with updates not set to be skipped."""


class DataExhausted(RunFault):
    """The training data ran out (a finite number of epochs) before the last step."""

    @classmethod
    def after(cls, step: int, cfg: dict) -> DataExhausted:
        kept = f"step {step} is saved" if step else "no step was trained"
        return cls(
            f"the training data ran out after step {step} of {cfg['run'].train_steps} "
            f"(DataConfig.num_epochs={cfg['data'].num_epochs}); {kept}: rerun with more data, "
            f"more epochs or RunConfig.train_steps <= {step}"
        )


def _loop(cfg: dict, step, state, batches, checkpoints, writer, start: int, evaluate) -> dict:
    """Steps from `start`; saves when due, on the last step and on SIGTERM (then returns)."""
    import jax

    from longt5_jax import configuration
    from longt5_jax.data.pipeline import global_batch
    from longt5_jax.training.metrics import StepProfiler
    from longt5_jax.training.optim import learning_rate_at

    run, skip = cfg["run"], cfg["step"].skip_nonfinite
    rng = jax.random.key(run.seed + 1) if cfg["model"].dropout_rate > 0 else None
    config = {"gin": configuration.operative_config(), "model": dataclasses.asdict(cfg["model"])}
    profiler = StepProfiler(run.model_dir, run.profile_start, run.profile_steps)
    row, bad_steps, pending, saved = {}, 0, [], start
    for i in range(start, run.train_steps):
        with writer.timing("data"):
            local = next(batches, None)
        if local is None:  # a finite number of epochs is over: keep what was trained
            if i > saved:
                _nonfinite(pending, skip)
                checkpoints.save(i, state, batches, config, force=True)
            raise DataExhausted.after(i, cfg)
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
        if (i + 1) % run.log_every == 0 or last:
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
            values["nonfinite_steps"] = bad_steps + values.pop("nonfinite")
            row = writer.write(
                i + 1, {**values, "learning_rate": learning_rate_at(cfg["optim"], i)}
            )
        if evaluate.due(i + 1):
            with writer.paused():
                writer.write_eval(i + 1, evaluate(i + 1, state.params))
        if last or checkpoints.due(i + 1):
            bad_steps += _nonfinite(pending, skip)  # never save a state that went non-finite
            pending = []
            with writer.timing("checkpoint"):
                checkpoints.save(i + 1, state, batches, config, force=True)
            saved = i + 1
        if stop:
            name = stopped() or "another process's signal"
            print(f"{name}: saved step {i + 1}; rerun the same command to resume", flush=True)
            break
    return row


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
    """SIGTERM (what SLURM sends before a time limit or preemption) and a first SIGINT (Ctrl-C)
    ask the run to stop after the step in flight, saving it; a second SIGINT stops at once.
    The command enters this first thing, so that a signal during start-up or the first compile
    is kept rather than killing the process mid-write; the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOP.clear()
    previous = {sig: signal.signal(sig, _ask_to_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stopped() -> str:
    """The name of the signal that asked the run to stop ('' while none has)."""
    return _STOP.get("name", "")
