"""Scaling from 16 to 64 GPUs on the compiled GPU program: the paper's three strategies for 4, 8
and 16 nodes x 4 A100-80GB, compiled deviceless as `bench cluster` compiles each row.

Weak scaling keeps each GPU's share of the batch (the global batch grows with the GPUs; at the
first node count it is --batch_size), strong scaling keeps the global batch (--batch_size). Each
point's samples/s are `bench cluster`'s bounds (the roofline plus the communication XLA's
schedule leaves exposed; analytic FLOPs at an assumed MFU with no overlap), and its efficiency is
samples/s per GPU against the first node count's: the paper reports 93% from 16 to 64 GPUs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from longt5_jax import cli
from longt5_jax.bench import cluster as table
from longt5_jax.bench import results as page
from longt5_jax.bench.report import pyplot, save_figure, write_json
from longt5_jax.errors import UsageError
from longt5_jax.estimate import cost, targets

PAPER_EFFICIENCY = 0.93  # 16 -> 64 GPUs, the paper's scaling claim
BOUNDS = ("roofline_as_scheduled", "mfu_no_overlap")  # the figures efficiency is reported for


def _parser() -> argparse.ArgumentParser:
    p = table.parser("python -m longt5_jax.bench scaling", __doc__.splitlines()[0], [4, 8, 16])
    p.add_argument("--scalings", nargs="+", default=["weak", "strong"], choices=["weak", "strong"])
    p.set_defaults(rows=["base:4096", "xl:4096"])
    return p


def _points(args: argparse.Namespace, target) -> list[dict]:
    """Every (scaling, row, strategy, node count) point; one compile where two are the same."""
    measured: dict[tuple, dict] = {}
    points = []
    for scaling in args.scalings:
        for model, length in table.rows(args):
            for strategy in args.strategies:
                for nodes in args.nodes:
                    batch = args.batch_size
                    if scaling == "weak":  # each GPU's share of the first node count's batch
                        batch = args.batch_size * nodes // args.nodes[0]
                    key = (model, length, strategy, nodes, batch)
                    if key not in measured:
                        measured[key] = _measure(args, target, *key)
                    points.append({"scaling": scaling, "nodes": nodes, **measured[key]})
    return _with_efficiency(points, args.nodes[0])


def _measure(args, target, model: str, length: int, strategy: str, nodes: int, batch: int):
    point = argparse.Namespace(**{**vars(args), "nodes": nodes, "batch_size": batch})
    print(f"compiling {strategy} {model}@{length} on {nodes} nodes, batch {batch}",
          file=sys.stderr, flush=True)  # fmt: skip
    devices = targets.devices(target, nodes, args.gpus_per_node)
    cluster = cost.Cluster.from_args(target, point)
    try:
        row = table.measure(point, cluster, devices, model, length, strategy)
    except ValueError as e:
        raise UsageError(f"{strategy} {model}@{length} on {nodes} nodes: {e}") from None
    return {**row, "gpus": cluster.devices, "batch_size": batch}


def _with_efficiency(points: list[dict], first: int) -> list[dict]:
    """Each point's efficiency: its samples/s per GPU over the first node count's."""
    base = {
        (p["scaling"], p["model"], p["input_length"], p["strategy"]): p
        for p in points
        if p["nodes"] == first
    }
    for p in points:
        b = base[(p["scaling"], p["model"], p["input_length"], p["strategy"])]
        p["efficiency"] = {
            bound: p["samples_per_s"][bound] / b["samples_per_s"][bound] * b["gpus"] / p["gpus"]
            for bound in BOUNDS
        }
    return points


def _print(points: list[dict]) -> None:
    print(
        f"{'scaling':<7} {'strategy':<10} {'model':<10} {'GPUs':>5} {'batch':>6} {'d/t/p':>8} "
        f"{'GiB':>6} {'samples/s':>10} {'eff':>6} {'MFU s/s':>8} {'eff':>6}"
    )
    for p in points:
        s, e = p["samples_per_s"], p["efficiency"]
        mesh = "/".join(str(v) for v in p["mesh"].values())
        row = f"{p['model']}@{p['input_length']}"
        print(
            f"{p['scaling']:<7} {p['strategy']:<10} {row:<10} "
            f"{p['gpus']:>5} {p['batch_size']:>6} {mesh:>8} {p['memory']['total'] / 2**30:>6.1f} "
            f"{s['roofline_as_scheduled']:>10.1f} {100 * e['roofline_as_scheduled']:>5.1f}% "
            f"{s['mfu_no_overlap']:>8.1f} {100 * e['mfu_no_overlap']:>5.1f}%"
        )
    print(
        "samples/s: the roofline of the compiled kernels plus the communication its schedule "
        "leaves exposed; MFU s/s: analytic FLOPs at the assumed MFU with no overlap. eff: "
        f"samples/s per GPU against the first node count's (the paper: "
        f"{PAPER_EFFICIENCY:.0%} from 16 to 64 GPUs)."
    )


def markdown(points: list[dict]) -> str:
    """The results page's table: a line per scaling, row and strategy; a column per GPU count."""
    lines = sorted({(p["scaling"], p["model"], p["input_length"], p["strategy"]) for p in points},
                   key=lambda k: (k[0] != "weak", k[1:]))  # fmt: skip
    gpus = sorted({p["gpus"] for p in points})
    columns = ["scaling", "model", "strategy", *(f"{g} GPUs samples/s" for g in gpus)]
    columns += [*(f"efficiency at {g}" for g in gpus[1:]), f"GiB at {gpus[-1]}"]
    table = []
    for line in lines:
        mine = {p["gpus"]: p for p in points if
                (p["scaling"], p["model"], p["input_length"], p["strategy"]) == line}  # fmt: skip
        rate = [f"{mine[g]['samples_per_s'][BOUNDS[0]]:.1f}" for g in gpus]
        efficiency = [f"{100 * mine[g]['efficiency'][BOUNDS[0]]:.1f}%" for g in gpus[1:]]
        memory = f"{mine[gpus[-1]]['memory']['total'] / 2**30:.1f}"
        table.append(
            [line[0], f"{line[1]} {line[2] // 1024}k", line[3], *rate, *efficiency, memory]
        )
    return page.markdown(columns, table)


def _plot(points: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    lines = sorted({(p["scaling"], p["model"], p["input_length"], p["strategy"]) for p in points})
    for line in lines:
        mine = [p for p in points if (p["scaling"], p["model"], p["input_length"], p["strategy"])
                == line]  # fmt: skip
        gpus = [p["gpus"] for p in mine]
        label = f"{line[0]} {line[3]} {line[1]}@{line[2]}"
        style = "-" if line[0] == "weak" else "--"
        top.plot(gpus, [p["samples_per_s"][BOUNDS[0]] for p in mine], style, marker="o",
                 label=label)  # fmt: skip
        bottom.plot(gpus, [100 * p["efficiency"][BOUNDS[0]] for p in mine], style, marker="o")
    bottom.axhline(100 * PAPER_EFFICIENCY, color="r", lw=0.8, label="paper, 16 -> 64 GPUs")
    top.set_ylabel("samples/s (roofline + exposed communication)")
    top.set_yscale("log")
    top.legend(fontsize=7)
    bottom.set_ylabel("efficiency, %")
    bottom.set_xlabel("GPUs")
    bottom.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    args.nodes = sorted(set(args.nodes))
    page.check(args.results, "scaling", argv)
    try:
        table.rows(args)
        target, _ = targets.open_target(args.target, args.nodes[0], args.gpus_per_node)
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
    points = _points(args, target)
    _print(points)
    out = Path(args.out_dir)
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    write_json(out, "scaling", {"config": config, "points": points})
    _plot(points, out / "scaling.png")
    where = page.machine(f"{args.nodes} nodes x {args.gpus_per_node} {target.name}")
    page.publish(args, "scaling", argv, markdown(points), where=where)
    return 0
