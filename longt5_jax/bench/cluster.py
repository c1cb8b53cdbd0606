"""The paper's Table 1 on the compiled GPU program: its three strategies on 8 x 4 A100-80GB.

Each row compiles the full train step (global batch 512 in 4 accumulation microbatches, in the
target's half precision: bf16, fp16 on a V100; full remat, as the paper trains) for the target
cluster with XLA's GPU compiler, deviceless (`estimate/targets.py`), and reads off the program:
per-device memory from the GPU buffer assignment, collective bytes per step by kind and by link
(NVLink inside a node, InfiniBand across), a roofline over its kernels, and the communication its
schedule leaves exposed. Compute time comes two ways (analytic FLOPs at an assumed MFU, plus the
pipeline bubble; the roofline of the compiled kernels), communication with no overlap and with full
overlap, so each gives a range of step times; between them, the roofline plus the communication
XLA's schedule leaves exposed. Beside them: the paper's figures, and the physical ceiling (model
FLOPs at 100% of peak), so a reader sees which of the paper's numbers are possible. Every assumption
is a flag and printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from longt5_jax import cli
from longt5_jax.bench import results as page
from longt5_jax.bench.report import pyplot, save_figure, write_json
from longt5_jax.data.pipeline import DataConfig
from longt5_jax.errors import UsageError
from longt5_jax.estimate import comm_model, compile_ahead, cost, flops, targets
from longt5_jax.estimate.candidates import cast_params_for
from longt5_jax.estimate.shapes import ModelShapes
from longt5_jax.model import LongT5Config
from longt5_jax.parallel.mesh import ParallelConfig
from longt5_jax.training.experiment import Sizing
from longt5_jax.training.optim import OptimizerConfig, make_optimizer
from longt5_jax.training.step import StepConfig

# name -> (tensor, pipeline, ZeRO stage); data takes the remaining devices.
STRATEGIES = {"DP+ZeRO-2": (1, 1, 2), "TP+DP": (4, 1, 1), "TP+PP+DP": (4, 2, 1)}
# The paper's Table 1, per strategy: samples/s, memory % of 80 GB, % of the step waiting on
# communication.
PAPER = {
    "DP+ZeRO-2": (790, 96.2, 27.4),
    "TP+DP": (1080, 89.5, 19.2),
    "TP+PP+DP": (1410, 91.1, 12.6),
}
ROWS = ["base:4096", "large:4096", "xl:4096", "xl:8192"]
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")


def parser(
    prog: str = "python -m longt5_jax.bench cluster",
    description: str = __doc__.splitlines()[0],
    nodes: int | list[int] = 8,
) -> argparse.ArgumentParser:
    """Table 1's settings (the step, the cluster, the bounds' assumptions, rows and strategies);
    `bench scaling` takes them with a list of node counts."""
    p = cli.ArgumentParser(prog=prog, description=description, settle=cli.settle_dtype)
    cli.add_cluster_arguments(p, cpu=True, nodes=nodes)
    p.add_argument("--rows", nargs="+", default=ROWS, help="MODEL:INPUT_LENGTH (tiny .. xxl)")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--attention", default="tglobal")
    p.add_argument("--attention_kernel", default="xla", choices=["xla", "pallas"])
    p.add_argument("--target_length", type=cli.positive, default=512)
    p.add_argument("--batch_size", type=cli.positive, default=512, help="global batch")
    p.add_argument(
        "--accumulation", type=cli.positive, default=4, help="gradient accumulation microbatches"
    )
    p.add_argument("--pipeline_microbatches", type=cli.positive, default=16)
    p.add_argument("--remat", default="full")
    cli.add_dtype_argument(p)
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adafactor"])
    p.add_argument(
        "--grad_dtype", default="float32", choices=["float32", "bfloat16"],
        help="the gradient reduction's dtype (bfloat16: the paper's half-precision gradients)",
    )  # fmt: skip
    p.add_argument(
        "--mfu", type=cli.fraction, default=0.4, help="assumed MFU of the pessimistic bound"
    )
    p.add_argument(
        "--peak_tflops", type=cli.rate, help="per GPU, dense, in --dtype (default: the target's)"
    )
    p.add_argument("--hbm_gbps", type=cli.rate, help="per GPU (default: the target's)")
    p.add_argument(
        "--intra_node_gbps", type=cli.rate, help="per GPU (default: the target's NVLink)"
    )
    p.add_argument("--inter_node_gbps", type=cli.rate, help="per GPU (default: the target's NIC)")
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    page.add_argument(p)
    return p


def rows(args: argparse.Namespace) -> list[tuple[str, int]]:
    out = []
    for row in args.rows:
        model, sep, length = row.partition(":")
        if not sep or not length.isdigit() or int(length) < 1:
            raise ValueError(f"--rows {row!r}: expected MODEL:INPUT_LENGTH, e.g. xl:8192")
        out.append((model, int(length)))
    return out


def _throughputs(b: int, a: dict, mfu_time, ceiling_s: float) -> dict:
    """Samples per second under each bound: compute at MFU or at the roofline, communication
    not overlapped, as scheduled, or fully overlapped; the ceiling at peak FLOP/s."""
    roof = a["roofline"]["seconds"]
    return {
        "mfu_no_overlap": b / mfu_time.total,
        "mfu_full_overlap": b / mfu_time.overlapped,
        "roofline_no_overlap": b / (roof + a["comm_s"]),
        "roofline_as_scheduled": b / (roof + a["exposed_comm_s"]),
        "roofline_full_overlap": b / max(roof, a["comm_s"]),
        "ceiling": b / ceiling_s,
    }


def measure(args, cluster, devices, model: str, length: int, strategy: str) -> dict:
    """Compile one row and read its memory, communication and time bounds."""
    tensor, pipe, zero = STRATEGIES[strategy]
    kernel = args.attention_kernel
    config = LongT5Config.preset(model, args.attention, dtype=args.dtype, remat=args.remat,
                                 attention_kernel=kernel)  # fmt: skip
    micro = args.pipeline_microbatches if pipe > 1 else 0
    parallel = ParallelConfig(-1, tensor, pipe, zero, pipeline_microbatches=micro)
    config = dataclasses.replace(config, cast_params=cast_params_for(parallel))
    if args.batch_size % args.accumulation:
        raise ValueError(f"--batch_size {args.batch_size} is not divisible by --accumulation")
    step = StepConfig(microbatches=args.accumulation, grad_dtype=args.grad_dtype)
    data = DataConfig(batch_size=args.batch_size)
    Sizing(model=config, data=data, parallel=parallel, step=step).check_fits(len(devices))
    start = time.perf_counter()
    optimizer = make_optimizer(OptimizerConfig(name=args.optimizer))
    b, n = args.batch_size, cluster.devices
    shape = (b, length, args.target_length)
    compiled = compile_ahead.compile_for(
        config, parallel, devices, args.gpus_per_node, shape, step, optimizer
    )
    a = compiled.analyse(cluster)
    shapes = ModelShapes.of(config, optimizer)
    expected = comm_model.volumes(shapes, comm_model.Layout.of(parallel, n, step, shape))
    lengths = (length, args.target_length)
    remat = "full" if pipe > 1 else args.remat
    # The step's own config: `auto` made concrete for the target (float32 on an A100: XLA's).
    executed = flops.executed_flops_per_step(compiled.step.model.config, b, *lengths, remat)
    idle = cost.bubble(pipe, micro, 1)
    mfu_time = cost.step_time(cost.compute_seconds(executed, n, cluster), a["comm_s"], idle)
    roof = a["roofline"]["seconds"]
    model_flops = flops.train_flops_per_step(config, b, *lengths)
    return {
        "strategy": strategy,
        "model": model,
        "input_length": length,
        "mesh": dict(compiled.step.mesh.shape),
        "zero_stage": zero,
        "compile_s": time.perf_counter() - start,
        **a,
        "memory_fraction": a["memory"]["total"] / (cluster.memory_gib * 2**30),
        "compute_mfu_s": mfu_time.busy,
        "compute_roofline_s": roof,
        "samples_per_s": _throughputs(
            b, a, mfu_time, model_flops / (n * cluster.peak_tflops * 1e12)
        ),
        "comm_share": mfu_time.comm_share,
        "exposed_share": a["exposed_comm_s"] / (roof + a["exposed_comm_s"]),
        "model_tflops_per_step": model_flops / 1e12,
        "comm_model_bytes": comm_model.by_kind(expected),
        "paper": dict(
            zip(("samples_per_s", "memory_pct", "comm_pct"), PAPER[strategy], strict=True)
        ),
    }


def _print(rows: list[dict], cluster) -> None:
    print(
        f"{'strategy':<10} {'model':<10} {'d/t/p':>7} {'GiB':>6} {'mem%':>5} {'AR GB':>6} "
        f"{'AG GB':>6} {'RS GB':>6} {'CP GB':>6} {'NVL GB':>6} {'IB GB':>6} {'MFU s':>6} "
        f"{'roof s':>6} {'comm s':>6} {'expo s':>6} {'samples/s: MFU':>15} "
        f"{'roofline':>20} {'ceil':>6} {'comm%':>5} {'expo%':>5} {'/model':>6}   "
        "paper: samples/s mem% comm%"
    )
    for r in rows:
        kind, link, s = r["collectives"]["kind"], r["collectives"]["link"], r["samples_per_s"]
        mesh = "/".join(str(v) for v in r["mesh"].values())
        paper = r["paper"]
        mfu = f"{s['mfu_no_overlap']:.0f}-{s['mfu_full_overlap']:.0f}"
        roof = (
            f"{s['roofline_no_overlap']:.0f}/{s['roofline_as_scheduled']:.0f}/"
            f"{s['roofline_full_overlap']:.0f}"
        )
        print(
            f"{r['strategy']:<10} {r['model'] + '@' + str(r['input_length']):<10} {mesh:>7} "
            f"{r['memory']['total'] / 2**30:>6.1f} {100 * r['memory_fraction']:>5.1f} "
            f"{kind['all-reduce'] / 1e9:>6.2f} {kind['all-gather'] / 1e9:>6.2f} "
            f"{kind['reduce-scatter'] / 1e9:>6.2f} {kind['collective-permute'] / 1e9:>6.2f} "
            f"{link['nvlink'] / 1e9:>6.2f} {link['ib'] / 1e9:>6.2f} {r['compute_mfu_s']:>6.2f} "
            f"{r['compute_roofline_s']:>6.2f} {r['comm_s']:>6.2f} {r['exposed_comm_s']:>6.2f} "
            f"{mfu:>15} {roof:>20} {s['ceiling']:>6.0f} {100 * r['comm_share']:>5.1f} "
            f"{100 * r['exposed_share']:>5.1f} "
            f"{sum(kind.values()) / sum(r['comm_model_bytes'].values()):>6.3f}   "
            f"{paper['samples_per_s']:>5} "
            f"{paper['memory_pct']:>5} {paper['comm_pct']:>5}"
        )
    print(
        f"Cluster: {cluster.describe()}. GiB: the GPU buffer assignment, mem% of the device. "
        "Collective GB per device per step (ring model) by kind; NVL / IB GB: on links inside a "
        "node / across nodes. MFU s: analytic executed FLOPs at the assumed MFU, plus the "
        "pipeline bubble; roof s: roofline of the compiled kernels; comm s: every collective at "
        "its link's bandwidth; expo s: what XLA's schedule leaves exposed. samples/s: MFU s with "
        "no overlap - full overlap; roofline no overlap / as scheduled / full overlap; ceil: "
        "model FLOPs at 100% of peak. comm%: comm s / (MFU s + comm s), the paper's "
        "'communication wait'; expo%: expo s / (roof s + expo s); /model: the bytes against "
        "the analytic communication model (estimate/comm_model.py)."
    )


def markdown(rows: list[dict]) -> str:
    """The results page's table: memory, GB per device per step by kind and link, samples/s."""
    columns = ["strategy", "model", "GiB", "mem%", "all-reduce", "all-gather", "reduce-scatter",
               "permute", "NVLink", "IB", "comm%", "samples/s (MFU)", "roofline", "/model",
               "paper samples/s, mem%, comm%"]  # fmt: skip
    table = []
    for r in rows:
        kind, link, s = r["collectives"]["kind"], r["collectives"]["link"], r["samples_per_s"]
        gb = [f"{v / 1e9:.2f}" for v in (*(kind[k] for k in KINDS), link["nvlink"], link["ib"])]
        paper = ", ".join(str(v) for v in r["paper"].values())
        table.append([
            r["strategy"], f"{r['model']} {r['input_length'] // 1024}k",
            f"{r['memory']['total'] / 2**30:.1f}", f"{100 * r['memory_fraction']:.1f}", *gb,
            f"{100 * r['comm_share']:.1f}",
            f"{s['mfu_no_overlap']:.0f}-{s['mfu_full_overlap']:.0f}",
            f"{s['roofline_as_scheduled']:.0f}",
            f"{sum(kind.values()) / sum(r['comm_model_bytes'].values()):.3f}", paper,
        ])  # fmt: skip
    return page.markdown(columns, table)


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    labels = [f"{r['strategy']}\n{r['model']}@{r['input_length']}" for r in rows]
    x = range(len(rows))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(rows)), 8), sharex=True)
    s = [r["samples_per_s"] for r in rows]
    for key, color in (
        ("roofline_full_overlap", "#c6dbef"),
        ("roofline_as_scheduled", "#6baed6"),
        ("mfu_no_overlap", "#2171b5"),
    ):
        top.bar(x, [v[key] for v in s], color=color, label=key.replace("_", " "))
    top.scatter(x, [v["ceiling"] for v in s], marker="_", s=400, c="k", label="100% of peak")
    top.scatter(x, [r["paper"]["samples_per_s"] for r in rows], marker="*", c="r", label="paper")
    top.set_yscale("log")
    top.set_ylabel("samples/s")
    top.legend(fontsize=8)
    bottom.bar(x, [100 * r["memory_fraction"] for r in rows], color="#74c476", label="compiled")
    bottom.scatter(x, [r["paper"]["memory_pct"] for r in rows], marker="*", c="r", label="paper")
    bottom.axhline(100, color="k", lw=0.8)
    bottom.set_ylabel("memory, % of device")
    bottom.set_xticks(list(x), labels, rotation=60, fontsize=7)
    bottom.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    page.check(args.results, "cluster", argv)
    try:
        wanted = rows(args)
        target, devices = targets.open_target(args.target, args.nodes, args.gpus_per_node)
        cluster = cost.Cluster.from_args(target, args)
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
    results = []
    for model, length in wanted:
        for strategy in args.strategies:
            print(f"compiling {strategy} {model}@{length}", file=sys.stderr, flush=True)
            try:
                results.append(measure(args, cluster, devices, model, length, strategy))
            except ValueError as e:
                raise UsageError(f"{strategy} {model}@{length}: {e}") from None
    print(
        f"{args.attention} {args.batch_size} x {{input}}/{args.target_length} in "
        f"{args.accumulation} accumulation microbatches, {args.dtype}, remat {args.remat}, "
        f"{args.optimizer}, {args.grad_dtype} gradient reduction; compiled for {target.name}"
    )
    _print(results, cluster)
    out = Path(args.out_dir)
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    report = {"config": config, "cluster": cluster.describe(), "rows": results}
    write_json(out, "cluster", report)
    _plot(results, out / "cluster.png")
    where = page.machine(f"{args.nodes} x {args.gpus_per_node} {target.name}")
    page.publish(args, "cluster", argv, markdown(results), where=where)
    return 0
