"""python -m longt5_jax.plan: compile the training step ahead for a cluster you do not have.

Enumerates parallel configurations for the target cluster (`candidates.py`), drops those that do
not divide or whose analytic memory is hopeless, ranks the rest by the cost model (`cost.py`),
then lowers and compiles the full-size step for the best `--compile_top` on as many fake CPU
devices as the cluster has GPUs, from abstract arrays only (`aot.py`), and ranks those by the
compiled executable's memory and collective bytes. Compiling on CPU compiles CPU code: the
memory numbers are the CPU compiler's buffer assignment (a GPU compile fuses and schedules
differently), and CPU GSPMD spells a reduce-scatter as all-reduce + dynamic-slice. Nothing is
cached to disk.

The device count is fixed when jax starts: the planner sets `jax_num_cpu_devices`, or, when jax
already runs with another count, re-runs itself in a subprocess with XLA_FLAGS asking for them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the real imports wait until the device count is set
    from longt5_jax.candidates import Estimate
    from longt5_jax.cost import Cluster, StepTime
    from longt5_jax.model import LongT5Config
    from longt5_jax.parallel.compiled import Memory

_CHILD = "LONGT5_PLAN_CHILD"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m longt5_jax.plan", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="base", help="preset: tiny, small, base, large, xl, xxl")
    p.add_argument("--attention", default="tglobal", help="local or tglobal")
    p.add_argument("--input_length", type=int, default=4096)
    p.add_argument("--target_length", type=int, default=512)
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[128], help="global batches")
    p.add_argument("--dtype", default="bfloat16", help="activation/matmul dtype")
    p.add_argument("--optimizer", default="adafactor", choices=["adafactor", "adamw"])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--gpus_per_node", type=int, default=4)
    p.add_argument("--memory_gib", type=float, default=80.0, help="per GPU")
    p.add_argument("--peak_tflops", type=float, default=312.0, help="per GPU, bf16 dense")
    p.add_argument("--intra_node_gbps", type=float, default=300.0, help="GB/s per GPU (NVLink)")
    p.add_argument("--inter_node_gbps", type=float, default=25.0, help="GB/s per GPU (IB HDR)")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model-FLOPs utilisation")
    p.add_argument("--compile_top", type=int, default=3, help="compile this many (0: none)")
    p.add_argument("--show", type=int, default=5, help="print this many best")
    return p


def _config(args: argparse.Namespace) -> tuple[LongT5Config, Cluster]:
    from longt5_jax import cost
    from longt5_jax.model import LongT5Config

    if min(args.input_length, args.target_length, *args.batch_sizes) < 1:
        raise ValueError("--input_length, --target_length and --batch_sizes must be >= 1")
    if args.compile_top < 0 or args.show < 1:
        raise ValueError("--compile_top must be >= 0 and --show >= 1")
    config = LongT5Config.preset(args.model, args.attention, dtype=args.dtype)
    cluster = cost.Cluster(
        args.nodes,
        args.gpus_per_node,
        args.memory_gib,
        args.peak_tflops,
        args.intra_node_gbps,
        args.inter_node_gbps,
        args.mfu,
    )
    return config, cluster


def _cpu_devices(count: int) -> list | None:
    """`count` fake CPU devices in this process, or None if jax already started with others."""
    import jax

    with contextlib.suppress(RuntimeError):  # raises once the backend has started
        jax.config.update("jax_num_cpu_devices", count)
    devices = jax.devices("cpu")
    return devices if len(devices) == count else None


def _rerun(argv: list[str], count: int) -> int:
    """This command again in a fresh process whose XLA makes `count` CPU devices."""
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    env = {
        **os.environ,
        _CHILD: "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={count}".strip(),
    }
    return subprocess.run([sys.executable, "-m", "longt5_jax.plan", *argv], env=env).returncode


def _compile(
    estimate: Estimate,
    config: LongT5Config,
    lengths: tuple[int, int],
    devices: list,
    cluster: Cluster,
    optimizer_name: str,
) -> tuple[Memory, dict[str, float], StepTime]:
    """Compile one candidate; its compiled memory, collectives and cost-model step time."""
    from longt5_jax import aot, cost
    from longt5_jax import candidates as cands
    from longt5_jax.optim import OptimizerConfig, make_optimizer
    from longt5_jax.parallel import compiled as hlo

    c = estimate.candidate
    cfg = dataclasses.replace(config, remat=c.remat)
    optimizer = make_optimizer(OptimizerConfig(name=optimizer_name))
    step = aot.sharded_step(cfg, c.mesh(), optimizer=optimizer, devices=devices)
    exe = aot.compile_step(step, c.batch_size, *lengths)
    ops = hlo.collectives(exe.as_text())
    memory = hlo.memory(exe)
    comm = cost.comm_seconds(ops, cluster)
    compute = cost.compute_seconds(cands.executed_flops(c, cfg, lengths), cluster.devices, cluster)
    idle = cost.bubble(c.pipeline, c.microbatches, c.repeats)
    return memory, hlo.bytes_by_kind(ops), cost.step_time(compute, comm, idle)


def _print_compiled(rows: list[dict], cluster: Cluster, show: int) -> None:
    gib = 2**30
    print(
        f"\n{'#':>2} {'candidate':<44} {'GiB/dev':>8} {'fits':>4} {'AR GB':>7} {'AG GB':>7} "
        f"{'RS GB':>6} {'CP GB':>6} {'A2A GB':>6} {'comp s':>7} {'bubble':>6} {'comm s':>7} "
        f"{'samples/s':>9}"
    )
    for i, r in enumerate(rows[:show], 1):
        moved = r["collectives"]
        t = r["time"]
        print(
            f"{i:>2} {r['estimate'].candidate.label():<44} {r['memory'].total / gib:>8.2f} "
            f"{'yes' if r['fits'] else 'NO':>4} {moved['all-reduce'] / 1e9:>7.2f} "
            f"{moved['all-gather'] / 1e9:>7.2f} {moved['reduce-scatter'] / 1e9:>6.2f} "
            f"{moved['collective-permute'] / 1e9:>6.2f} {moved['all-to-all'] / 1e9:>6.2f} "
            f"{t.compute:>7.3f} {t.bubble:>6.3f} {t.comm:>7.3f} "
            f"{r['estimate'].candidate.batch_size / t.total:>9.1f}"
        )
    print(
        "GiB/dev: arguments + outputs - aliased + temporaries of the CPU-compiled executable "
        f"(the CPU compiler's buffer assignment), against {cluster.memory_gib:g} GiB. "
        "Collective GB per device per step, ring model; CPU spells reduce-scatter as all-reduce."
    )


def _print_estimates(estimates: list[Estimate], show: int) -> None:
    print(f"\n{'#':>2} {'candidate':<44} {'est GiB/dev':>11} {'est step s':>10} {'samples/s':>9}")
    for i, e in enumerate(estimates[:show], 1):
        print(
            f"{i:>2} {e.candidate.label():<44} {e.memory / 2**30:>11.2f} "
            f"{e.time.total:>10.3f} {e.samples_per_s:>9.1f}"
        )


def _ranked(args: argparse.Namespace, config: LongT5Config, cluster: Cluster) -> list[Estimate]:
    """Analytic estimates of every candidate near fitting, best first."""
    from longt5_jax import candidates as cands
    from longt5_jax.optim import OptimizerConfig, make_optimizer

    lengths = (args.input_length, args.target_length)
    found = cands.enumerate_candidates(
        config, cluster.devices, cluster.gpus_per_node, args.batch_sizes
    )
    shapes = cands.ModelShapes.of(config, make_optimizer(OptimizerConfig(name=args.optimizer)))
    limit = cluster.memory_gib * 2**30
    estimates = [cands.estimate(c, shapes, lengths, cluster) for c in found]
    kept = [e for e in estimates if e.memory <= 1.5 * limit]
    print(
        f"{args.model} {config.attention} {args.input_length}/{args.target_length} on "
        f"{cluster.describe()}\n{len(found)} candidates divide; {len(found) - len(kept)} dropped "
        f"as hopeless (analytic memory > 1.5 x {cluster.memory_gib:g} GiB); "
        f"{sum(e.memory <= limit for e in kept)} fit by the analytic estimate",
        flush=True,
    )
    return sorted(kept, key=lambda e: (-e.samples_per_s, e.memory))


def _compile_best(
    args: argparse.Namespace,
    config: LongT5Config,
    cluster: Cluster,
    devices: list,
    ranked: list[Estimate],
) -> list[dict]:
    """Compile up to --compile_top candidates in ranked order. After each compile the analytic
    memory is scaled by the worst compiled/analytic ratio seen so far, and candidates that would
    then not fit are passed over: the analytic model misses what XLA keeps alive."""
    limit, scale, rows = cluster.memory_gib * 2**30, 1.0, []
    lengths = (args.input_length, args.target_length)
    queue = [e for e in ranked if e.memory <= limit] or ranked
    for e in queue:
        if len(rows) == args.compile_top:
            break
        if rows and e.memory * scale > limit:
            continue
        print(f"compiling {len(rows) + 1}/{args.compile_top}: {e.candidate.label()}", end="")
        start = time.perf_counter()
        memory, moved, step = _compile(e, config, lengths, devices, cluster, args.optimizer)
        print(f"  {memory.total / 2**30:.1f} GiB/dev ({time.perf_counter() - start:.0f} s)")
        sys.stdout.flush()
        scale = max(scale, memory.total / e.memory)
        fits = memory.total <= limit
        rows.append(dict(estimate=e, memory=memory, collectives=moved, time=step, fits=fits))
    rows.sort(key=lambda r: (not r["fits"], r["time"].total / r["estimate"].candidate.batch_size))
    return rows


def run(args: argparse.Namespace, config: LongT5Config, cluster: Cluster, devices: list) -> int:
    ranked = _ranked(args, config, cluster)
    if ranked is None:
        print(
            "error: no configuration divides the model, the batch and the devices", file=sys.stderr
        )
        return 2
    if not ranked:
        print("error: no candidate comes near fitting in memory", file=sys.stderr)
        return 1
    fitting = [e for e in ranked if e.memory <= cluster.memory_gib * 2**30]
    _print_estimates(fitting or ranked, args.show)
    rows = _compile_best(args, config, cluster, devices, ranked) if args.compile_top else []
    if rows:
        _print_compiled(rows, cluster, args.show)
    best = [r["estimate"] for r in rows if r["fits"]]
    if rows and not best:
        print("\nno compiled candidate fits; the best by the analytic estimate instead:")
    print("\nbest, as gin flags:")
    for e in (best or ranked)[: min(3, args.show)]:
        print(f"  {e.candidate.label()}\n    {e.candidate.gin()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    try:
        config, cluster = _config(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from longt5_jax.candidates import enumerate_candidates

    # Before any device exists (and before a re-run): a cluster nothing divides is bad input.
    if not enumerate_candidates(config, cluster.devices, cluster.gpus_per_node, args.batch_sizes):
        print(
            f"error: no data x tensor x pipeline layout of {cluster.devices} devices divides "
            f"{args.model} (heads, MLP width, vocabulary, layers) and batch {args.batch_sizes}",
            file=sys.stderr,
        )
        return 2
    devices = _cpu_devices(cluster.devices)
    if devices is None:
        if os.environ.get(_CHILD):
            print(f"error: could not make {cluster.devices} CPU devices", file=sys.stderr)
            return 2
        return _rerun(argv, cluster.devices)
    return run(args, config, cluster, devices)


if __name__ == "__main__":
    sys.exit(main())
