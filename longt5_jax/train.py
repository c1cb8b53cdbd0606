"""The main job: `python -m longt5_jax.train --gin_file=... [--gin.NAME=VALUE ...]`.

Multi-process: under `srun` it joins the SLURM step by itself; elsewhere give
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (see launch/README.md).

Configure -> devices (fake CPU ones without an accelerator, processes joined) -> check the layout
fits and the devices compute in its dtype -> hold MODEL_DIR (one run at a time) -> build the
loop's parts -> `training.loop.train`.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from longt5_jax import cli, configuration, environment
from longt5_jax.data.pipeline import load_tokenizer, make_dataset
from longt5_jax.data.tokenizer import Tokenizer
from longt5_jax.errors import ConfigError
from longt5_jax.estimate.flops import train_flops_per_step
from longt5_jax.model import LongT5, count_params
from longt5_jax.parallel.devices import check_dtype, cpu_devices
from longt5_jax.parallel.mesh import make_mesh
from longt5_jax.training import distributed, experiment, identity, loop, run_lock
from longt5_jax.training.checkpoint import Checkpoints
from longt5_jax.training.experiment import Experiment
from longt5_jax.training.metrics import MetricsWriter, peak_flops
from longt5_jax.training.optim import make_optimizer
from longt5_jax.training.periodic_eval import PeriodicEval
from longt5_jax.training.prometheus import PrometheusExporter
from longt5_jax.training.step import ShardedStep


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    with loop.stopping_on_signals():  # first: a signal during start-up is kept, not fatal
        return _train(argv)


def _train(argv: list[str]) -> int:
    flags, argv = distributed.split_flags(argv)
    processes = distributed.detect(flags)
    exp, given = configuration.from_args(argv, Experiment, flags=("--print_config",))
    if "--print_config" in given:
        print(configuration.operative_config() or experiment.summary(exp))
        return 0
    environment.check_port_range(exp.run.prometheus_port)  # before any work, not at the end
    model_dir = Path(exp.run.model_dir)
    if model_dir.exists() and not model_dir.is_dir():
        raise ConfigError(f"MODEL_DIR={str(model_dir)!r}: a file, expected a directory")
    # A SLURM task without GPUs has as many devices as CPUs allocated; otherwise the config's.
    devices = (processes and processes.cpu_devices) or exp.run.cpu_devices
    cpu_devices(devices)
    distributed.initialize(processes, devices)
    exp.check_fits(jax.device_count())
    check_dtype(exp.model.dtype, jax.local_devices()[0])  # a V100 would run bf16 dots in f32
    with run_lock.held(model_dir):  # before anything in MODEL_DIR is written
        parts = _parts(exp)
        try:
            loop.train(exp, parts)
        finally:
            parts.checkpoints.close()
    return 0


def _parts(exp: Experiment) -> loop.Parts:
    """The loop's parts, with every start-up check done before anything is written to MODEL_DIR:
    the tokenizer and the run's identity, the training data (a bad file is reported before any
    state is built), the metrics port, the eval data and the checkpoints to resume."""
    tokenizer, pinned = _tokenizer(exp)
    batches = iter(make_dataset(exp.data, tokenizer, "train"))
    mesh = make_mesh(exp.parallel)
    model = LongT5(exp.model, runner=exp.parallel.pipeline_schedule())
    step = ShardedStep(model, exp.step, make_optimizer(exp.optim), mesh, exp.parallel)
    if jax.process_index() == 0:
        print(
            f"{count_params(step.abstract_state.params) / 1e6:.2f}M parameters, mesh "
            f"{dict(mesh.shape)}, ZeRO-{exp.parallel.zero_stage}, {jax.device_count()} devices, "
            f"attention_kernel={step.model.config.attention_kernel}",
            flush=True,
        )
    config_text = configuration.operative_config()
    open_writer = _metrics_writer(exp, _exporter(exp), config_text)
    evaluate = PeriodicEval(exp.eval, exp.data, exp.decode, tokenizer, step)
    evaluate.open(exp.run.train_steps)
    checkpoints = Checkpoints(Path(exp.run.model_dir), exp.ckpt, tokenizer.proto)
    return loop.Parts(
        step=step,
        batches=batches,
        checkpoints=checkpoints,
        evaluate=evaluate,
        open_writer=open_writer,
        config_text=config_text,
        identity=pinned,
    )


def _tokenizer(exp: Experiment) -> tuple[Tokenizer, dict[str, Any]]:
    """The run's tokenizer, checked against the model, and the run's identity (tokenizer, model,
    objective), checked against the run it resumes."""
    tokenizer = load_tokenizer(exp.data)
    pinned = identity.of(tokenizer.proto, str(tokenizer.path), exp.model, exp.data.objective)
    identity.check(exp.run.model_dir, pinned)  # a resume is the run it resumes, or refused
    if tokenizer.vocab_size > exp.model.vocab_size:
        raise ConfigError(
            f"LongT5Config.vocab_size={exp.model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ids (use {tokenizer.padded_vocab_size})"
        )
    return tokenizer, pinned


def _exporter(exp: Experiment) -> PrometheusExporter | None:
    """The opt-in Prometheus endpoint and Pushgateway pushes, the port taken now (a port in use
    is a start-up error)."""
    run = exp.run
    if not (run.prometheus_port or run.prometheus_pushgateway):
        return None
    try:
        return PrometheusExporter(
            run.prometheus_port,
            run.prometheus_host,
            jax.process_index(),
            info=_run_info(exp),
            grace_seconds=run.prometheus_grace_seconds,
            pushgateway=run.prometheus_pushgateway,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _run_info(exp: Experiment) -> dict[str, str]:
    """The labels of `longt5_run_info`: the run's directory, model, mesh and a hash of its
    operative config (runs that differ only in flags tell apart by it)."""
    data, tensor, pipeline = exp.parallel.shape(jax.device_count())
    config = configuration.operative_config().encode()
    return {
        "model_dir": exp.run.model_dir,
        "model": exp.model.name,
        "mesh": f"data={data},tensor={tensor},pipeline={pipeline}",
        "config_hash": hashlib.sha256(config).hexdigest()[:12],
    }


def _metrics_writer(
    exp: Experiment, exporter: PrometheusExporter | None, config_text: str
) -> Callable[[int], MetricsWriter]:
    """Opens, at the step the run starts from, the logs, TensorBoard (with the operative config
    and the hyperparameters), the Prometheus endpoint if any, and MFU where the devices' peak is
    known (from the model FLOPs of a step)."""
    run, data = exp.run, exp.data
    flops = train_flops_per_step(exp.model, data.batch_size, data.input_length, data.target_length)
    return lambda start: MetricsWriter(
        run.model_dir,
        run.train_steps,
        resume_step=start,
        exporter=exporter,
        flops_per_step=flops,
        peak_flops=peak_flops(jax.devices(), run.peak_flops_per_device),
        eval_split=exp.eval.split,
        config_text=config_text,
        hparams=experiment.hparams(exp),
    )


if __name__ == "__main__":
    sys.exit(main())
