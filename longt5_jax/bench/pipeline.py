"""Pipeline schedules: idle fraction against theory, step time and per-device memory.

For each stages p, microbatches m and repeats r, the full train step (pipelined encoder and
decoder stacks, AdamW) runs on data (8/p) x pipeline p fake devices; the reference is the
same step with the pipeline axis used as data (data 8), timed in the same run, alternating.
SPMD pipelining computes every stage in every iteration, bubbles included, so on a host whose
cores run all devices the pipelined step costs (r m + p - 1) / (r m) of the useful work and
the measured idle fraction is 1 - T(reference) / T(pipelined), next to (p - 1) / (r m + p - 1).
Memory per device comes from the compiled executable (XLA's buffer assignment).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np
import optax

from longt5_jax import cli
from longt5_jax.bench.report import write_json
from longt5_jax.data import batching
from longt5_jax.errors import UsageError
from longt5_jax.estimate import hlo
from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.parallel.devices import cpu_devices
from longt5_jax.parallel.mesh import ParallelConfig, make_mesh
from longt5_jax.training.step import ShardedStep, StepConfig


def random_batch(rows: int, length: int, target_length: int, vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    examples = [
        batching.padded_example(
            {
                "inputs": batching.trim_with_eos(rng.integers(2, vocab, length), length),
                "targets": batching.trim_with_eos(
                    rng.integers(2, vocab, target_length), target_length
                ),
            },
            length,
            target_length,
        )
        for _ in range(rows)
    ]
    return batching.to_features({k: np.stack([e[k] for e in examples]) for k in examples[0]})


class _Timed:
    """A compiled step with its state, for alternating timed calls."""

    def __init__(self, config: LongT5Config, parallel: ParallelConfig, batch: dict):
        model = LongT5(config, runner=parallel.pipeline_schedule())
        self.step = ShardedStep(
            model, StepConfig(), optax.adamw(1e-3), make_mesh(parallel), parallel
        )
        self.state = self.step.init(jax.random.key(0))
        self.batch = batch
        memory = hlo.memory(self.step.lower(self.state, batch).compile())
        self.memory = {"temp_bytes": memory.temporaries, "argument_bytes": memory.arguments}
        self.times: list[float] = []
        self()  # compile and warm up
        self.times = []

    def __call__(self) -> None:
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready(metrics["loss"])
        self.times.append(time.perf_counter() - start)

    @property
    def seconds(self) -> float:
        return float(np.median(self.times))


def _row(parallel: ParallelConfig, piped: _Timed, reference: _Timed) -> dict:
    """One layout's idle share (from the schedule and as measured against data parallelism),
    step time and memory; printed as it comes."""
    p, m, r = parallel.pipeline, parallel.pipeline_microbatches, parallel.pipeline_repeats
    schedule = parallel.pipeline_schedule()
    assert schedule is not None  # the layouts timed here are pipelined
    theory = schedule.bubble
    row = {
        "stages": p,
        "microbatches": m,
        "repeats": r,
        "theory_idle": theory,
        "measured_idle": 1 - reference.seconds / piped.seconds,
        "step_s": piped.seconds,
        "reference_step_s": reference.seconds,
        **piped.memory,
    }
    print(
        f"{p:>2} {m:>3} {r:>2} {theory:>11.1%} {row['measured_idle']:>9.1%} "
        f"{piped.seconds:>8.3f} {reference.seconds:>7.3f} "
        f"{piped.memory['temp_bytes'] / 2**20:>12.1f} "
        f"{piped.memory['argument_bytes'] / 2**20:>12.1f}",
        flush=True,
    )
    return row


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(
        prog="python -m longt5_jax.bench pipeline", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--stages", type=cli.positive, nargs="+", default=[2, 4])
    parser.add_argument("--microbatch_factors", type=cli.positive, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=cli.positive, nargs="+", default=[1, 2])
    parser.add_argument("--batch_size", type=cli.positive, default=32)
    parser.add_argument("--input_length", type=cli.positive, default=512)
    parser.add_argument("--target_length", type=cli.positive, default=64)
    parser.add_argument("--layers", type=cli.positive, default=8)
    parser.add_argument("--d_model", type=cli.positive, default=128)
    parser.add_argument(
        "--steps", type=cli.positive, default=4, help="timed steps per configuration"
    )
    parser.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parse(argv)
    cpu_devices(8)
    if jax.device_count() != 8:
        raise UsageError(f"the pipeline benchmark needs 8 devices, found {jax.device_count()}")

    config = LongT5Config.preset(
        "tiny",
        "transient-global",
        d_model=args.d_model,
        d_ff=2 * args.d_model,
        d_kv=args.d_model // 4,
        num_encoder_layers=args.layers,
        num_decoder_layers=args.layers,
        local_radius=127,
        global_block_size=16,
    )
    batch = random_batch(args.batch_size, args.input_length, args.target_length, 256)
    reference = _Timed(config, ParallelConfig(data=8, zero_stage=1), batch)
    rows = []
    print(
        f"{'p':>2} {'m':>3} {'r':>2} {'theory idle':>11} {'measured':>9} {'step s':>8} "
        f"{'ref s':>7} {'temp MiB/dev':>12} {'args MiB/dev':>12}"
    )
    for p in args.stages:
        for factor in args.microbatch_factors:
            for r in args.repeats:
                m = p * factor
                parallel = ParallelConfig(
                    data=8 // p,
                    pipeline=p,
                    zero_stage=1,
                    pipeline_microbatches=m,
                    pipeline_repeats=r,
                )
                piped = _Timed(config, parallel, batch)
                reference.times = []
                for _ in range(args.steps):  # alternate: drift hits both alike
                    piped()
                    reference()
                rows.append(_row(parallel, piped, reference))
    out = Path(args.out_dir)
    report = {
        "device": str(jax.devices()[0]),
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "reference": {"plan": "data 8", "step_s": reference.seconds, **reference.memory},
        "rows": rows,
    }
    write_json(out, "pipeline", report)
    return 0
