"""ZeRO-Offload: device memory, host memory and PCIe bytes on the compiled GPU program, and
the step time offload costs on this machine's CPU.

Memory: the step of `--model` at `--input_length` (and at `--fit_length`, against 40 and 80 GB
cards) is compiled deviceless for the target cluster, data parallel over every device, for each
ZeRO stage and `ParallelConfig.offload`; device bytes come from XLA's GPU buffer assignment, host
bytes from its host fields, PCIe bytes from the compiled program's host <-> device copies, and
the planner's cost model turns those into seconds (`--host_gbps`, PCIe 4 by default).

Time: a smaller model trains on this process's CPU devices with each offload setting, the
settings taking turns step by step, so that all three see the same machine; the ratio to the
run without offload is the measured cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import optax

from longt5_jax import cli
from longt5_jax.bench import results as page
from longt5_jax.bench.report import pyplot, save_figure, write_json
from longt5_jax.errors import UsageError
from longt5_jax.estimate import compile_ahead, cost, flops, targets
from longt5_jax.estimate.candidates import cast_params_for
from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.parallel.devices import half_dtype
from longt5_jax.parallel.mesh import Offload, ParallelConfig, make_mesh
from longt5_jax.training.optim import Name, OptimizerConfig, make_optimizer
from longt5_jax.training.step import ShardedStep, StepConfig

MODES: tuple[Offload, ...] = ("none", "optimizer", "optimizer_and_params")


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m longt5_jax.bench offload", description=__doc__.splitlines()[0]
    )
    cli.add_cluster_arguments(p)
    p.add_argument("--host_gbps", type=cli.rate, help="GB/s per GPU to host memory")
    p.add_argument("--model", default="xl")
    p.add_argument("--attention", default="tglobal")
    p.add_argument("--input_length", type=cli.positive, default=8192)
    p.add_argument("--target_length", type=cli.positive, default=512)
    p.add_argument("--batch_size", type=cli.positive, default=128)
    p.add_argument("--remat", default="full")
    p.add_argument("--optimizer", default="adamw", choices=["adafactor", "adamw"])
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--fit_length", type=cli.nonnegative, default=16384, help="0: skip the fit rows")
    p.add_argument("--fit_batch", type=cli.positive, default=32)
    p.add_argument("--fit_zero", type=int, choices=[0, 1, 2, 3], nargs="+", default=[1, 3])
    p.add_argument("--cpu_model", default="small", help="the model timed on the CPU")
    p.add_argument("--cpu_devices", type=cli.positive, default=8)
    p.add_argument("--cpu_lengths", type=cli.positive, nargs=2, default=[256, 64])
    p.add_argument("--cpu_batch", type=cli.positive, default=8)
    p.add_argument(
        "--cpu_steps", type=cli.nonnegative, default=6, help="timed steps per setting (0: skip)"
    )
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    page.add_argument(p)
    return p


def _optimizer(name: Name) -> optax.GradientTransformation:
    return make_optimizer(OptimizerConfig(name=name))


def _compiled_rows(args, devices, cluster, length: int, batch: int, zeros: list[int]) -> list:
    dtype = half_dtype(devices[0])
    config = LongT5Config.preset(args.model, args.attention, dtype=dtype, remat=args.remat)
    executed = flops.executed_flops_per_step(config, batch, length, args.target_length, args.remat)
    compute = cost.compute_seconds(executed, cluster.devices, cluster)
    rows = []
    for zero in zeros:
        for mode in MODES:
            print(f"compiling {args.model}@{length} ZeRO-{zero} offload={mode}", file=sys.stderr)
            parallel = ParallelConfig(data=-1, zero_stage=zero, offload=mode)
            step = compile_ahead.compile_for(
                dataclasses.replace(config, cast_params=cast_params_for(parallel)),
                parallel,
                devices,
                args.gpus_per_node,
                (batch, length, args.target_length),
                optimizer=_optimizer(args.optimizer),
            )
            analysis = step.analyse(cluster)
            rows.append(
                dict(
                    input_length=length,
                    batch_size=batch,
                    zero_stage=zero,
                    offload=mode,
                    device_gib=analysis["memory"]["total"] / 2**30,
                    host_gib=analysis["memory"]["host"] / 2**30,
                    pcie_gb=step.host_transfers.total / 1e9,
                    host_s=analysis["host_s"],
                    compute_s=compute,
                    comm_s=analysis["comm_s"],
                )
            )
    return rows


def _print_memory(rows: list[dict], cluster) -> None:
    print(
        f"{'input':>6} {'B':>4} {'ZeRO':>4} {'offload':<21} {'device GiB':>10} {'host GiB':>8} "
        f"{'PCIe GB':>7} {'host s':>7} {'step s':>7} {'cost':>6} {'40GB':>5} {'80GB':>5}"
    )
    for r in rows:
        step = r["compute_s"] + r["comm_s"]
        print(
            f"{r['input_length']:>6} {r['batch_size']:>4} {r['zero_stage']:>4} "
            f"{r['offload']:<21} {r['device_gib']:>10.2f} {r['host_gib']:>8.2f} "
            f"{r['pcie_gb']:>7.2f} {r['host_s']:>7.3f} {step:>7.3f} "
            f"{r['host_s'] / step:>6.1%} {_fits(r, 40):>5} {_fits(r, 80):>5}"
        )
    print(
        f"device / host GiB: per device, XLA's GPU buffer assignment; PCIe GB: per device per "
        f"step, read from the compiled program; host s at {cluster.host_gbps:g} GB/s; step s: "
        f"compute at {cluster.mfu:.0%} MFU + collectives, none overlapped; cost: host s / step s"
    )


def markdown(rows: list[dict]) -> str:
    """The results page's table: a row per input, ZeRO stage and offload setting."""
    columns = ["input, batch", "ZeRO", "offload", "device GiB", "host GiB", "PCIe GB", "host s",
               "cost", "40 GB", "80 GB"]  # fmt: skip
    table = [
        [
            f"{r['input_length']}, {r['batch_size']}",
            r["zero_stage"],
            r["offload"],
            f"{r['device_gib']:.2f}",
            f"{r['host_gib']:.2f}",
            f"{r['pcie_gb']:.2f}",
            f"{r['host_s']:.3f}",
            f"{r['host_s'] / (r['compute_s'] + r['comm_s']):.1%}",
            _fits(r, 40),
            _fits(r, 80),
        ]  # fmt: skip
        for r in rows
    ]
    return page.markdown(columns, table)


def _fits(row: dict, card_gb: int) -> str:
    # A card's GB are decimal; a few GiB go to the CUDA context and NCCL's buffers.
    return "yes" if row["device_gib"] * 2**30 <= card_gb * 1e9 - 2 * 2**30 else "no"


def _cpu_timing(args, devices) -> list[dict]:
    """Median step seconds of each offload setting, the settings interleaved step by step."""
    config = LongT5Config.preset(args.cpu_model, args.attention)
    steps, states = {}, {}
    for mode in MODES:
        parallel = ParallelConfig(data=-1, zero_stage=1, offload=mode)
        model = LongT5(config)
        mesh = make_mesh(parallel, devices)
        steps[mode] = ShardedStep(model, StepConfig(), _optimizer(args.optimizer), mesh, parallel)
        states[mode] = steps[mode].init(jax.random.key(0))
    abstract = compile_ahead.abstract_batch(steps["none"], args.cpu_batch, *args.cpu_lengths)
    batch = {k: jax.numpy.ones(v.shape, v.dtype) for k, v in abstract.items()}
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(args.cpu_steps + 1):  # the first round compiles
        for mode in MODES:
            start = time.perf_counter()
            states[mode], metrics = steps[mode](states[mode], batch)
            jax.block_until_ready((states[mode], metrics))
            if i:
                seconds[mode].append(time.perf_counter() - start)
        print(f"cpu round {i}/{args.cpu_steps}", file=sys.stderr, flush=True)
    base = statistics.median(seconds["none"])
    return [
        dict(
            offload=mode,
            median_s=statistics.median(seconds[mode]),
            seconds=seconds[mode],
            ratio=statistics.median(seconds[mode]) / base,
        )
        for mode in MODES
    ]


def _plot(rows: list[dict], timing: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, (mem, cpu) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=[2, 1])
    width = 0.8 / len(MODES)
    lengths = sorted({(r["input_length"], r["zero_stage"]) for r in rows})
    for i, mode in enumerate(MODES):
        got = {(r["input_length"], r["zero_stage"]): r for r in rows if r["offload"] == mode}
        xs = [k + (i - 1) * width for k in range(len(lengths))]
        mem.bar(xs, [got[key]["device_gib"] for key in lengths], width, label=f"device, {mode}")
        mem.bar(
            xs,
            [got[key]["host_gib"] for key in lengths],
            width,
            bottom=[got[key]["device_gib"] for key in lengths],
            fill=False,
            hatch="//",
            edgecolor="grey",
        )
    for card in (40, 80):
        mem.axhline(card * 1e9 / 2**30, color="k", lw=0.8, ls=":")
    mem.set_xticks(range(len(lengths)), [f"{n} ZeRO-{z}" for n, z in lengths], fontsize=8)
    mem.set_ylabel("GiB per device (hatched: in host memory)")
    mem.legend(fontsize=8)
    # Beside the CPU's measured ratio, the cost model's for the cluster at each ZeRO stage of
    # the first input length: (step + host copies) / step.
    first = rows[0]["input_length"]
    series = [("CPU, measured", {t["offload"]: t["ratio"] for t in timing})] if timing else []
    for zero in sorted({r["zero_stage"] for r in rows if r["input_length"] == first}):
        at = [r for r in rows if r["input_length"] == first and r["zero_stage"] == zero]
        ratio = {r["offload"]: 1 + r["host_s"] / (r["compute_s"] + r["comm_s"]) for r in at}
        series.append((f"{first} ZeRO-{zero}, estimate", ratio))
    step = 0.8 / max(len(series), 1)
    for i, (label, ratio) in enumerate(series):
        xs = [k + (i - (len(series) - 1) / 2) * step for k in range(len(MODES))]
        cpu.bar(xs, [ratio[m] for m in MODES], step, label=label)
    cpu.set_xticks(range(len(MODES)), MODES, fontsize=8)
    cpu.set_ylabel("step time / without offload")
    cpu.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    page.check(args.results, "offload", argv)
    try:
        target = targets.load(args.target)
        if not target.is_gpu:
            raise ValueError("--target: device memory is read from a GPU compile")
        # This process's CPU devices first (their number is fixed when the CPU backend starts),
        # then the target's compile-only GPUs.
        targets.prepare_environment()
        cpu_devices = targets.devices(targets.load("cpu"), 1, args.cpu_devices)
        _, devices = targets.open_target(args.target, args.nodes, args.gpus_per_node)
        cluster = cost.Cluster.from_args(target, args)
        rows = _compiled_rows(args, devices, cluster, args.input_length, args.batch_size, args.zero)
        if args.fit_length:
            rows += _compiled_rows(
                args, devices, cluster, args.fit_length, args.fit_batch, args.fit_zero
            )
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
    print(
        f"{args.model} {args.attention}, {args.target_length} targets, {args.optimizer}, remat "
        f"{args.remat}, data parallel on {target.name} {args.nodes} x {args.gpus_per_node}"
    )
    _print_memory(rows, cluster)
    timing = _cpu_timing(args, cpu_devices) if args.cpu_steps else []
    for t in timing:
        print(
            f"CPU {args.cpu_model} {args.cpu_devices} devices, offload={t['offload']:<21} "
            f"median step {t['median_s']:.3f} s  x{t['ratio']:.2f}"
        )
    out = Path(args.out_dir)
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    report = {"config": config, "cluster": cluster.describe(), "rows": rows, "cpu": timing}
    write_json(out, "offload", report)
    _plot(rows, timing, out / "offload.png")
    where = page.machine(f"{args.nodes} x {args.gpus_per_node} {target.name}")
    page.publish(args, "offload", argv, markdown(rows), where=where)
    return 0
