"""python -m longt5_jax.plan: compile the training step ahead for a cluster you do not have.

Enumerates parallel configurations for the target cluster (`candidates.py`), drops those that do
not divide or whose analytic memory is hopeless, ranks the rest by the cost model (`cost.py`),
then compiles the full-size step for the best `--compile_top` from abstract arrays only
(`compile_ahead.py`) and ranks those by the compiled program: its memory, and on a GPU target
its roofline (each kernel at peak FLOP/s or HBM bandwidth, whichever bounds it) plus the
communication its schedule leaves exposed. The cost model assumes one MFU for every candidate,
so it cannot see what the compiled programs differ in at long inputs: the HBM traffic of a
remat policy and of a scan's copies of saved activations (base 16k x 2 on an H100, fused
kernels, no remat, scanned against unrolled: docs/journal.md).

`--target a100-80gb | h100-80gb | h200-141gb | v100-32gb` (or a GpuTargetConfig file) compiles with
XLA's GPU compiler for `--nodes x --gpus_per_node` compile-only GPUs (the `gpu` extra; no GPU
needed), in the target's half precision unless `--dtype` says otherwise: memory is the GPU buffer
assignment, collectives are the GPU program's. `--target cpu` compiles for as many fake CPU devices,
the CPU compiler's program (other buffer assignment; reduce-scatter spelled all-reduce +
dynamic-slice); the device count is fixed when jax starts, so the planner sets it, or re-runs itself
in a subprocess asking for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from typing import Any, Literal

from longt5_jax import cli
from longt5_jax.errors import RunFault, UsageError
from longt5_jax.estimate import candidates as cands
from longt5_jax.estimate import compile_ahead, cost, hlo, targets
from longt5_jax.estimate.candidates import Estimate
from longt5_jax.estimate.cost import Cluster
from longt5_jax.estimate.shapes import ModelShapes
from longt5_jax.kernels.interface import resolve, runs_on
from longt5_jax.model import LongT5Config
from longt5_jax.parallel.mesh import OFFLOADS
from longt5_jax.training.optim import OptimizerConfig, make_optimizer

_CHILD = "LONGT5_PLAN_CHILD"


WIDTH = 62  # of a candidate's label


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m longt5_jax.plan",
        description=__doc__.split("\n")[0],
        settle=cli.settle_dtype,
    )
    p.add_argument("--model", default="base", help="preset: tiny, small, base, large, xl, xxl")
    p.add_argument("--attention", default="tglobal", help="local or tglobal")
    p.add_argument(
        "--attention_kernel",
        default="auto",
        choices=["auto", "xla", "pallas"],
        help="the fused kernels (pallas) or XLA's attention; auto: the kernels on a GPU target",
    )
    p.add_argument("--input_length", type=int, default=4096)
    p.add_argument("--target_length", type=int, default=512)
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[128], help="global batches")
    cli.add_dtype_argument(p)
    p.add_argument("--optimizer", default="adafactor", choices=["adafactor", "adamw"])
    cli.add_cluster_arguments(p, cpu=True)
    p.add_argument("--memory_gib", type=float, help="per GPU (default: the target's)")
    p.add_argument(
        "--peak_tflops", type=float, help="per GPU, dense, in --dtype (default: the target's)"
    )
    p.add_argument("--intra_node_gbps", type=float, help="GB/s per GPU (default: NVLink's)")
    p.add_argument("--inter_node_gbps", type=float, help="GB/s per GPU (default: the NIC's)")
    p.add_argument("--host_gbps", type=float, help="GB/s per GPU to host memory (default: PCIe's)")
    p.add_argument(
        "--offload",
        nargs="+",
        help="ParallelConfig.offload settings to consider: none, optimizer, optimizer_and_params "
        "(default: all)",
    )
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model-FLOPs utilisation")
    p.add_argument("--compile_top", type=int, default=3, help="compile this many (0: none)")
    p.add_argument("--show", type=int, default=5, help="print this many best")
    return p


def _config(args: argparse.Namespace) -> tuple[LongT5Config, Cluster, targets.Target]:
    args.offload = tuple(args.offload or OFFLOADS)
    if set(args.offload) - set(OFFLOADS):
        raise ValueError(f"--offload {' '.join(args.offload)}: expected some of {OFFLOADS}")
    if min(args.input_length, args.target_length, *args.batch_sizes) < 1:
        raise ValueError("--input_length, --target_length and --batch_sizes must be >= 1")
    if args.compile_top < 0 or args.show < 1:
        raise ValueError("--compile_top must be >= 0 and --show >= 1")
    target = targets.load(args.target)
    config = LongT5Config.preset(
        args.model, args.attention, dtype=args.dtype, attention_kernel=args.attention_kernel
    )
    config = resolve(config, target.compute_capability)
    if config.attention_kernel == "pallas" and not runs_on(target.compute_capability):
        raise ValueError(
            f"--attention_kernel pallas: the fused kernels compile for GPUs of compute capability "
            f"8.0 and newer, not {target.name}; use auto or xla"
        )
    cluster = cost.Cluster.from_args(target, args)
    if target.is_gpu and args.compile_top and not targets.have_gpu_compiler():
        raise ValueError(targets.GPU_EXTRA_MISSING)
    return config, cluster, target


def _rerun(argv: list[str], count: int) -> int:
    """This command again in a fresh process whose XLA makes `count` CPU devices."""
    env = {
        **os.environ,
        _CHILD: "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": cli.xla_flags_for_child(count),
    }
    return subprocess.run([sys.executable, "-m", "longt5_jax.plan", *argv], env=env).returncode


def _compile(
    estimate: Estimate,
    config: LongT5Config,
    lengths: tuple[int, int],
    devices: list[Any],
    cluster: Cluster,
    optimizer_name: Literal["adamw", "adafactor"],
) -> dict[str, Any]:
    """Compile one candidate: its compiled memory, collectives, cost-model step time and, on
    a GPU, the program's roofline step time (the pipeline's idle iterations are in its kernels)."""
    c = estimate.candidate
    cfg = dataclasses.replace(
        config, remat=c.remat, scan_layers=c.scan_layers, cast_params=c.cast_params
    )
    optimizer = make_optimizer(OptimizerConfig(name=optimizer_name))
    shape = (c.batch_size, *lengths)
    compiled = compile_ahead.compile_for(
        cfg, c.mesh(), devices, cluster.gpus_per_node, shape, optimizer=optimizer
    )
    comm = cost.comm_seconds(compiled.collectives, compiled.placement, cluster)
    compute = estimate.time.compute  # the cost model's, as the candidate was ranked
    idle = cost.bubble(c.pipeline, c.microbatches, c.repeats)
    host = cost.host_seconds(compiled.host_transfers.total, cluster)
    memory = compiled.memory()
    roofline = None
    if devices[0].platform != "cpu":  # a GPU target's program
        a = compiled.analyse(cluster)
        roofline = cost.StepTime(a["roofline"]["seconds"], 0.0, a["exposed_comm_s"], host)
    return dict(
        estimate=estimate,
        memory=memory,
        collectives=compiled.collectives,
        placement=compiled.placement,
        host_transfers=compiled.host_transfers,
        time=cost.step_time(compute, comm, idle, host),
        roofline=roofline,
        fits=memory.total <= cluster.memory_gib * 2**30,
    )


def _seconds(row: dict[str, Any]) -> float:
    """What the compiled candidates are ranked by: the roofline plus the exposed communication
    where the program is a GPU's, else the cost model with none of it hidden."""
    time: cost.StepTime = row["roofline"] or row["time"]
    return time.total


def _print_compiled(
    rows: list[dict[str, Any]], cluster: Cluster, target: targets.Target, show: int
) -> None:
    gib = 2**30
    print(
        f"\n{'#':>2} {'candidate':<{WIDTH}} {'GiB/dev':>8} {'est':>6} {'fits':>4} {'AR GB':>6} "
        f"{'AG GB':>6} {'RS GB':>6} {'CP GB':>6} {'A2A GB':>6} {'IB GB':>6} {'PCIe GB':>7} "
        f"{'comp s':>7} {'bubble':>6} {'comm s':>7} {'host s':>6} {'roof s':>7} {'exp s':>6} "
        f"{'samples/s':>9}"
    )
    for i, r in enumerate(rows[:show], 1):
        moved = hlo.bytes_by(r["collectives"], r["placement"])
        kind, t, roof = moved["kind"], r["time"], r["roofline"]
        measured = f"{roof.compute:>7.3f} {roof.comm:>6.3f}" if roof else f"{'-':>7} {'-':>6}"
        print(
            f"{i:>2} {r['estimate'].candidate.label():<{WIDTH}} {r['memory'].total / gib:>8.2f} "
            f"{r['estimate'].memory / gib:>6.1f} {'yes' if r['fits'] else 'NO':>4} "
            f"{kind['all-reduce'] / 1e9:>6.2f} {kind['all-gather'] / 1e9:>6.2f} "
            f"{kind['reduce-scatter'] / 1e9:>6.2f} {kind['collective-permute'] / 1e9:>6.2f} "
            f"{kind['all-to-all'] / 1e9:>6.2f} {moved['link']['ib'] / 1e9:>6.2f} "
            f"{r['host_transfers'].total / 1e9:>7.2f} "
            f"{t.compute:>7.3f} {t.bubble:>6.3f} {t.comm:>7.3f} {t.host:>6.3f} {measured} "
            f"{r['estimate'].candidate.batch_size / _seconds(r):>9.1f}"
        )
    whose = "the GPU buffer assignment" if target.is_gpu else "the CPU compiler's buffer assignment"
    print(
        f"GiB/dev: arguments + outputs - aliased + temporaries of the {target.name}-compiled "
        f"program ({whose}), against {cluster.memory_gib:g} GiB; est: the analytic estimate. "
        "Collective GB per device per step (ring model); IB GB: those crossing nodes; PCIe GB: "
        f"offload's copies to and from host memory, at {cluster.host_gbps:g} GB/s. comp s: "
        f"executed FLOPs at {cluster.mfu:.0%} MFU; comm s: every collective, none hidden."
        + (
            " roof s: the program's roofline (its kernels at peak or HBM bandwidth); exp s: the "
            "communication its schedule leaves exposed; samples/s by roof s + exp s + host s, "
            "which ranks them."
            if target.is_gpu
            else " samples/s by comp s + bubble + comm s + host s. CPU spells reduce-scatter as "
            "all-reduce."
        )
    )


def _print_estimates(estimates: list[Estimate], show: int) -> None:
    print(
        f"\n{'#':>2} {'candidate':<{WIDTH}} {'est GiB/dev':>11} {'est step s':>10} {'samples/s':>9}"
    )
    for i, e in enumerate(estimates[:show], 1):
        print(
            f"{i:>2} {e.candidate.label():<{WIDTH}} {e.memory / 2**30:>11.2f} "
            f"{e.time.total:>10.3f} {e.samples_per_s:>9.1f}"
        )


def _ranked(args: argparse.Namespace, config: LongT5Config, cluster: Cluster) -> list[Estimate]:
    """Analytic estimates of every candidate near fitting, best first."""
    lengths = (args.input_length, args.target_length)
    found = cands.enumerate_candidates(
        config, cluster.devices, cluster.gpus_per_node, args.batch_sizes, args.offload
    )
    shapes = ModelShapes.of(config, make_optimizer(OptimizerConfig(name=args.optimizer)))
    limit = cluster.memory_gib * 2**30
    estimates = [cands.estimate(c, shapes, lengths, cluster) for c in found]
    kept = [e for e in estimates if e.memory <= 1.5 * limit]
    print(
        f"{args.model} {config.attention} {config.dtype} {args.input_length}/{args.target_length} "
        f"attention_kernel={config.attention_kernel} on {cluster.describe()}\n"
        f"{len(found)} candidates divide; {len(found) - len(kept)} "
        f"dropped as hopeless (analytic memory > 1.5 x {cluster.memory_gib:g} GiB); "
        f"{sum(e.memory <= limit for e in kept)} fit by the analytic estimate",
        flush=True,
    )
    return sorted(kept, key=lambda e: (-e.samples_per_s, e.memory))


def _compile_best(
    args: argparse.Namespace,
    config: LongT5Config,
    cluster: Cluster,
    devices: list[Any],
    ranked: list[Estimate],
) -> list[dict[str, Any]]:
    """Compile up to --compile_top candidates in ranked order. After each compile the analytic
    memory is scaled by the worst compiled/analytic ratio seen so far for that layer form, and
    candidates that would then not fit are passed over: what the analytic model misses, it
    misses alike nearby. Per form, because the model is calibrated on scanned programs and
    XLA's unrolled ones hold more at large sizes (xl 16k on 8 x 4 A100s, ZeRO-3 save_attention:
    docs/journal.md), so one unrolled compile says nothing of a scanned twin."""
    limit = cluster.memory_gib * 2**30
    scale: dict[bool, float] = {}
    rows: list[dict[str, Any]] = []
    lengths = (args.input_length, args.target_length)
    queue = [e for e in ranked if e.memory <= limit] or ranked
    for e in queue:
        if len(rows) == args.compile_top:
            break
        form = e.candidate.scan_layers
        if rows and e.memory * scale.get(form, 1.0) > limit:
            continue
        # A whole line before the compile: XLA's own warnings (stderr) come while it runs.
        print(f"compiling {len(rows) + 1}/{args.compile_top}: {e.candidate.label()}", flush=True)
        start = time.perf_counter()
        row = _compile(e, config, lengths, devices, cluster, args.optimizer)
        total = row["memory"].total
        print(
            f"  {total / 2**30:.1f} GiB/dev, estimated {e.memory / 2**30:.1f} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        scale[form] = max(scale.get(form, 1.0), total / e.memory)
        rows.append(row)
    rows.sort(key=lambda r: (not r["fits"], _seconds(r) / r["estimate"].candidate.batch_size))
    return rows


def run(
    args: argparse.Namespace,
    config: LongT5Config,
    cluster: Cluster,
    target: targets.Target,
    devices: list[Any],
) -> int:
    ranked = _ranked(args, config, cluster)
    if not ranked:
        raise RunFault("no candidate comes near fitting in memory")
    fitting = [e for e in ranked if e.memory <= cluster.memory_gib * 2**30]
    _print_estimates(fitting or ranked, args.show)
    rows = _compile_best(args, config, cluster, devices, ranked) if args.compile_top else []
    if rows:
        _print_compiled(rows, cluster, target, args.show)
    best = [r["estimate"] for r in rows if r["fits"]]
    if rows and not best:
        print("\nno compiled candidate fits; the best by the analytic estimate instead:")
    print("\nbest, as gin flags:")
    kernel = f"--gin.LongT5Config.attention_kernel=\"'{config.attention_kernel}'\""
    for e in (best or fitting or ranked)[: min(3, args.show)]:
        print(f"  {e.candidate.label()}\n    {e.candidate.gin()} {kernel}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    targets.prepare_environment()
    try:
        config, cluster, target = _config(args)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    # Before any device exists (and before a re-run): a cluster nothing divides is bad input.
    found = cands.enumerate_candidates(
        config, cluster.devices, cluster.gpus_per_node, args.batch_sizes, args.offload
    )
    if not found:
        raise UsageError(
            f"no data x tensor x pipeline layout of {cluster.devices} devices divides "
            f"{args.model} (heads, MLP width, vocabulary, layers) and batch {args.batch_sizes}"
        )
    devices = []
    if args.compile_top:
        try:
            devices = targets.devices(target, args.nodes, args.gpus_per_node)
        except RuntimeError:  # jax already runs with another number of CPU devices
            if os.environ.get(_CHILD):
                raise UsageError(f"could not make {cluster.devices} CPU devices") from None
            return _rerun(argv, cluster.devices)
    return run(args, config, cluster, target, devices)


if __name__ == "__main__":
    sys.exit(main())
