"""The main job: `python -m longt5_jax.train --gin_file=... [--gin.NAME=VALUE ...]`.

Multi-process: under `srun` it joins the SLURM step by itself; elsewhere give
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (see launch/README.md).

Configure -> devices (fake CPU ones without an accelerator, processes joined) -> check the layout
fits -> hold MODEL_DIR (one run at a time) -> `training.loop.train`.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from longt5_jax import cli

    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    from longt5_jax.training import loop

    with loop.stopping_on_signals():  # first: a signal during start-up is kept, not fatal
        return _train(argv)


def _train(argv: list[str]) -> int:
    from longt5_jax import cli, configuration
    from longt5_jax.training import distributed

    flags, argv = distributed.split_flags(argv)
    processes = distributed.detect(flags)
    cfg, given = configuration.from_args(argv, flags=("--print_config",))
    if "--print_config" in given:
        print(configuration.operative_config() or "\n".join(f"{k}: {v}" for k, v in cfg.items()))
        return 0
    model_dir = Path(cfg["run"].model_dir)
    if model_dir.exists() and not model_dir.is_dir():
        raise configuration.ConfigError(
            f"MODEL_DIR={str(model_dir)!r}: a file, expected a directory"
        )
    # A SLURM task without GPUs has as many devices as CPUs allocated; otherwise the config's.
    devices = (processes and processes.cpu_devices) or cfg["run"].cpu_devices
    cli.cpu_devices(devices)
    distributed.initialize(processes, devices)
    import jax

    from longt5_jax.parallel.mesh import check_fits

    model = cfg["model"]
    check_fits(
        cfg["mesh"],
        jax.device_count(),
        model.num_heads,
        model.d_ff,
        model.vocab_size,
        cfg["data"].batch_size,
        (model.num_encoder_layers, model.num_decoder_layers),
        cfg["step"].microbatches,
    )
    from longt5_jax.training import run_lock
    from longt5_jax.training.loop import train

    with run_lock.held(model_dir):  # before anything in MODEL_DIR is written
        train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
