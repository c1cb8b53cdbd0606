"""Parallel strategies side by side: throughput, memory, collective bytes, communication share.

Each strategy (DP, ZeRO 1-3, TP+DP, TP+PP+DP) runs the same model and batch on the 8 devices
(fake CPU devices here). Throughput is measured by real steps, alternating strategies so drift
hits all alike; on fake devices every "device" shares the host's cores, so it ranks the
strategies' overheads, not a GPU's speed. Memory per device and collective bytes per step come
from the compiled program (`estimate/hlo.py`): with `--target a100-80gb` (the default) or
`h100-80gb`, the same strategy compiled deviceless for `--nodes x --gpus_per_node` GPUs (data
filling them); with `--target cpu`, the local devices' own program. The communication share is
estimated for the target: comm / (comm + compute), compute = model FLOPs / (peak x
efficiency), each collective at the intra- or inter-node bandwidth its groups need (`cost.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np

from longt5_jax import cli
from longt5_jax.bench.pipeline import random_batch
from longt5_jax.bench.report import pyplot, save_figure, write_json
from longt5_jax.data.pipeline import DataConfig
from longt5_jax.errors import UsageError
from longt5_jax.estimate import compile_ahead as aot
from longt5_jax.estimate import cost, flops, hlo, targets
from longt5_jax.model import LongT5Config
from longt5_jax.parallel.devices import cpu_devices
from longt5_jax.parallel.mesh import ParallelConfig
from longt5_jax.training.experiment import Sizing
from longt5_jax.training.step import StepConfig

# name -> (data, tensor, pipeline, zero stage); pipelines run 2 x stages microbatches.
STRATEGIES = {
    "DP": (8, 1, 1, 0),
    "ZeRO-1": (8, 1, 1, 1),
    "ZeRO-2": (8, 1, 1, 2),
    "ZeRO-3": (8, 1, 1, 3),
    "TP+DP": (4, 2, 1, 0),
    "TP+PP+DP": (2, 2, 2, 0),
}


def parse_overrides(pairs: list[str]) -> dict:
    """`--set d_model=64` pairs -> LongT5Config overrides, typed like the field's default."""
    defaults = LongT5Config()
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not hasattr(defaults, key):
            raise ValueError(f"--set {pair!r}: expected FIELD=VALUE with a LongT5Config field")
        kind = type(getattr(defaults, key))
        try:
            out[key] = kind(value)
        except ValueError:
            raise ValueError(f"--set {pair!r}: {value!r} is not a {kind.__name__}") from None
    return out


class _Run:
    """One strategy: state, compiled step, and its measurements."""

    def __init__(
        self,
        name: str,
        config: LongT5Config,
        batch: dict,
        args: argparse.Namespace,
        target_devices: list | None,
    ):
        data, tensor, pipe, zero = STRATEGIES[name]
        micro = 2 * pipe if pipe > 1 else 0
        self.parallel = ParallelConfig(data, tensor, pipe, zero, pipeline_microbatches=micro)
        sized = DataConfig(batch_size=args.batch_size)
        Sizing(model=config, data=sized, parallel=self.parallel, step=StepConfig()).check_fits(8)
        self.name = name
        # The 8 devices stand for nodes of --gpus_per_node: laid out, and charged, as such.
        self.step = aot.sharded_step(config, self.parallel, per_node=args.gpus_per_node)
        self.state = self.step.init(jax.random.key(0))
        self.batch = jax.device_put(batch, self.step.batch_sharding)
        lengths = (args.batch_size, args.input_length, args.target_length)
        self.compiled = aot.compile_step(self.step, *lengths)
        if target_devices:  # memory and collectives: the target's program (data fills it)
            parallel = dataclasses.replace(self.parallel, data=-1)
            program = aot.compile_for(config, parallel, target_devices, args.gpus_per_node, lengths)
        else:
            program = aot.CompiledStep(self.step, self.compiled, args.gpus_per_node)
        self.mesh = dict(program.step.mesh.shape)
        self.memory = program.memory()
        self.ops, self.placement = program.collectives, program.placement
        self.times: list[float] = []
        self()  # warm up
        self.times = []

    def __call__(self) -> None:
        start = time.perf_counter()
        self.state, metrics = self.compiled(self.state, self.batch, None)
        jax.block_until_ready(metrics["loss"])
        self.times.append(time.perf_counter() - start)


def _row(run: _Run, args: argparse.Namespace, cluster: cost.Cluster, model_flops: float) -> dict:
    seconds = float(np.median(run.times))
    comm = cost.comm_seconds(run.ops, run.placement, cluster)
    compute = cost.compute_seconds(model_flops, cluster.devices, cluster)
    return {
        "strategy": run.name,
        "mesh": run.mesh,
        "zero_stage": run.parallel.zero_stage,
        "step_s": seconds,
        "samples_per_s": args.batch_size / seconds,
        "tokens_per_s": args.batch_size * (args.input_length + args.target_length) / seconds,
        "memory": run.memory.as_dict(),
        "collective_bytes": hlo.bytes_by_kind(run.ops),
        "target_comm_s": comm,
        "target_compute_s": compute,
        "target_comm_share": comm / (comm + compute),
    }


def _print_table(rows: list[dict], target: str) -> None:
    kinds = ("AR", "AG", "RS", "CP", "A2A")
    print(
        f"{'strategy':<9} {'d/t/p':>6} {'samples/s':>9} {'tokens/s':>9} {'MiB/dev':>8} "
        f"{'temp MiB':>8} " + " ".join(f"{k + ' MiB':>7}" for k in kinds) + f" {'comm %':>6}"
    )
    for r in rows:
        mesh = "/".join(str(v) for v in r["mesh"].values())
        moved = " ".join(f"{v / 2**20:>7.2f}" for v in r["collective_bytes"].values())
        print(
            f"{r['strategy']:<9} {mesh:>6} {r['samples_per_s']:>9.2f} {r['tokens_per_s']:>9.0f} "
            f"{r['memory']['total'] / 2**20:>8.1f} {r['memory']['temporaries'] / 2**20:>8.1f} "
            f"{moved} {r['target_comm_share']:>6.1%}"
        )
    whose = (
        "the CPU compiler's: CPU GSPMD emits a reduce-scatter as all-reduce + dynamic-slice, so "
        "ZeRO-2/3 gradients show as AR here"
        if target == "cpu"
        else f"the {target} program's, compiled deviceless (d/t/p: its mesh)"
    )
    print(
        "samples/s, tokens/s: measured on the local devices. AR all-reduce, AG all-gather, RS "
        "reduce-scatter, CP collective-permute, A2A all-to-all: bytes per device per step (ring "
        f"model). Memory and bytes are {whose}."
    )


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    names = [r["strategy"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    panels = [
        ("samples/s (fake CPU devices)", [r["samples_per_s"] for r in rows]),
        ("memory MiB/device", [r["memory"]["total"] / 2**20 for r in rows]),
        ("collective MiB/device/step", [sum(r["collective_bytes"].values()) / 2**20 for r in rows]),
        ("target comm share", [r["target_comm_share"] for r in rows]),
    ]
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, values)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    save_figure(fig, path)


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m longt5_jax.bench strategy", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="tiny", help="preset: tiny, small, base, large, xl")
    p.add_argument("--attention", default="tglobal", help="local or tglobal")
    p.add_argument("--set", nargs="*", default=[], help="LongT5Config overrides, FIELD=VALUE")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--batch_size", type=cli.positive, default=16)
    p.add_argument("--input_length", type=cli.positive, default=512)
    p.add_argument("--target_length", type=cli.positive, default=64)
    p.add_argument("--steps", type=cli.positive, default=5, help="timed steps per strategy")
    cli.add_cluster_arguments(
        p,
        nodes=2,
        help="whose program the memory and collectives are: a100-80gb, h100-80gb (compiled "
        "deviceless for --nodes x --gpus_per_node, data filling them), or cpu (the 8 local "
        "devices' program, as nodes of --gpus_per_node)",
    )
    p.add_argument("--intra_node_gbps", type=cli.rate, help="GB/s (default: the target's NVLink)")
    p.add_argument("--inter_node_gbps", type=cli.rate, help="GB/s (default: the target's NIC)")
    p.add_argument("--peak_tflops", type=cli.rate, help="per GPU (default: the target's)")
    p.add_argument(
        "--efficiency", dest="mfu", type=cli.fraction, default=0.4, help="assumed fraction of peak"
    )
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    return p


def _setup(args: argparse.Namespace):
    """The model, the cluster the table stands for and its compile-only devices (GPU targets)."""
    config = LongT5Config.preset(args.model, args.attention, **parse_overrides(args.set))
    target = targets.load(args.target)
    if target.is_gpu and not targets.have_gpu_compiler():
        raise ValueError(targets.GPU_EXTRA_MISSING)
    if not target.is_gpu:  # the local devices stand for the cluster
        args.nodes = max(1, 8 // args.gpus_per_node)
    cluster = cost.Cluster.from_args(target, args)
    if args.steps < 1 or min(args.batch_size, args.input_length, args.target_length) < 1:
        raise ValueError("--steps, --batch_size and the lengths must be >= 1")
    target_devices = (
        targets.devices(target, args.nodes, args.gpus_per_node) if target.is_gpu else None
    )
    return config, cluster, target_devices


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        config, cluster, target_devices = _setup(args)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    cpu_devices(8)
    if jax.device_count() != 8:
        raise UsageError(f"the strategy table needs 8 devices, found {jax.device_count()}")
    batch = random_batch(args.batch_size, args.input_length, args.target_length, config.vocab_size)
    model_flops = flops.train_flops_per_step(
        config, args.batch_size, args.input_length, args.target_length
    )
    runs = []
    for name in args.strategies:
        try:
            runs.append(_Run(name, config, batch, args, target_devices))
        except ValueError as e:
            raise UsageError(f"{name}: {e}") from None
        print(f"compiled {name}", file=sys.stderr, flush=True)
    for _ in range(args.steps):  # alternate: drift hits every strategy alike
        for run in runs:
            run()
    rows = [_row(run, args, cluster, model_flops) for run in runs]
    print(
        f"{args.model} {config.attention}, batch {args.batch_size} x {args.input_length}/"
        f"{args.target_length}, {model_flops / 1e12:.4f} TFLOP/step; target {cluster.describe()}"
    )
    _print_table(rows, args.target)
    out = Path(args.out_dir)
    report = {
        "device": str(jax.devices()[0]),
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "model_flops_per_step": model_flops,
        "rows": rows,
    }
    write_json(out, "strategy", report)
    _plot(rows, out / "strategy.png")
    return 0
