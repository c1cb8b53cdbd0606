"""`python -m longt5_jax.doctor --gin_file=... [--gin.NAME=VALUE ...] [--json] [--check_kernels]`:
will this run work here? The arguments are the run's own (`train`'s, distributed flags too:
under `srun` or `launch.local` every process checks, and process 0 prints every failure, named
by process and host). Exit 0 when nothing fails, 1 otherwise."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax

from longt5_jax import cli, configuration, environment
from longt5_jax.doctor import processes as multi
from longt5_jax.doctor import report, run_checks, software, storage
from longt5_jax.doctor.report import Row, fail, ok
from longt5_jax.errors import UsageError
from longt5_jax.parallel.devices import cpu_devices
from longt5_jax.training import distributed
from longt5_jax.training.experiment import Experiment

FLAGS = ("--json", "--check_kernels")


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv, preflight=False)  # it reports what the start-up would refuse


def _main(argv: list[str]) -> int:
    flags, argv = distributed.split_flags(argv)
    processes = distributed.detect(flags)
    rows = environment_rows()
    exp, given, problem = _config(argv)
    if problem:
        rows.append(fail("config", "gin", problem, "fix the gin file or binding named"))
    devices = (processes and processes.cpu_devices) or (exp.run.cpu_devices if exp else 0)
    cpu_devices(devices)
    try:
        distributed.initialize(processes, devices)
    except UsageError as e:
        rows.append(
            fail(
                "processes",
                "join",
                str(e),
                "start every process of the run, with one coordinator address all of them reach",
            )
        )
        return _finish(rows, "--json" in given)
    rows += software.rows() + software.device_rows()
    if exp is not None:
        rows.append(
            ok(
                "config",
                "gin",
                f"parses and builds: {exp.model.name}, batch "
                f"{exp.data.batch_size} x {exp.data.input_length}+"
                f"{exp.data.target_length} tokens, {exp.run.train_steps} steps",
            )
        )
        rows += _run_rows(exp, "--check_kernels" in given)
    rows += _port_rows(exp)
    if jax.process_count() > 1:
        model_dir = Path(exp.run.model_dir).absolute() if exp else None
        rows += [multi.shared_storage_row(model_dir), multi.all_reduce_row()]
        rows = multi.gather(rows)
    return _finish(rows, "--json" in given)


def _finish(rows: list[Row], as_json: bool) -> int:
    if jax.process_index() == 0:
        print(report.to_json(rows) if as_json else report.table(rows), flush=True)
    return 1 if report.failed(rows) else 0


def _config(argv: list[str]):
    """(the experiment, the flags given, why it cannot be built or '')."""
    given = {a for a in argv if a in FLAGS}
    try:
        exp, _ = configuration.from_args(argv, Experiment, flags=FLAGS)
    except UsageError as e:
        return None, given, " ".join(str(e).split())
    return exp, given, ""


def environment_rows() -> list[Row]:
    """XLA_FLAGS and JAX_PLATFORMS, before jax starts its backends; what would stop jax from
    starting is reported, then left out of this process so the other checks still run."""
    rows = []
    unknown = environment.unknown_xla_flags()
    if unknown:
        rows.append(
            fail(
                "environment",
                "XLA_FLAGS",
                f"XLA does not know {unknown}",
                "remove it from XLA_FLAGS (a run is refused: XLA would abort)",
            )
        )
        os.environ["XLA_FLAGS"] = environment.without_flags(os.environ["XLA_FLAGS"], unknown)
    elif os.environ.get("XLA_FLAGS", "").strip():
        rows.append(ok("environment", "XLA_FLAGS", "XLA knows every flag"))
    else:
        rows.append(ok("environment", "XLA_FLAGS", "unset"))
    requested = environment.requested_platforms()
    if requested:
        # The CPU is always there: the probe (a process starting every backend) only otherwise.
        present = ["cpu"] if set(requested) == {"cpu"} else environment.platforms_present()
        if environment.absent_platforms(present):
            rows.append(
                fail(
                    "environment",
                    "JAX_PLATFORMS",
                    environment.platforms_line(present),
                    f"export JAX_PLATFORMS={','.join(present) or 'cpu'}, or unset it",
                )
            )
            jax.config.update("jax_platforms", None)
        else:
            rows.append(ok("environment", "JAX_PLATFORMS", os.environ["JAX_PLATFORMS"]))
    return rows


def _run_rows(exp, check_kernels: bool) -> list[Row]:
    rows = [run_checks.mesh_row(exp)]
    shapes = run_checks.shapes_of(exp)
    if rows[0].status == "ok":
        rows.append(run_checks.memory_row(exp, shapes))
    rows += run_checks.kernel_rows(exp, check_kernels)
    model_dir = Path(exp.run.model_dir).absolute()
    rows += [storage.model_dir_row(model_dir), storage.space_row(model_dir, shapes, exp.ckpt.keep)]
    return rows + storage.cache_rows() + storage.data_rows(exp)


def _port_rows(exp) -> list[Row]:
    if exp is None or not exp.run.prometheus_port:
        return (
            [ok("environment", "metrics port", "off (RunConfig.prometheus_port=0)")] if exp else []
        )
    port = exp.run.prometheus_port + jax.process_index()  # each process serves its own
    problem = environment.port_problem(port, exp.run.prometheus_host)
    if problem:
        return [
            fail(
                "environment",
                "metrics port",
                problem,
                "choose a free RunConfig.prometheus_port in 1-65535",
            )
        ]
    return [ok("environment", "metrics port", f"{exp.run.prometheus_host}:{port} is free")]


if __name__ == "__main__":
    sys.exit(main())
