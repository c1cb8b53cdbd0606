"""The planner's memory estimate against the compiled GPU program, over a grid of layouts.

Each candidate (model, input length, global batch, data x tensor x pipeline, ZeRO stage, remat)
is compiled deviceless for the target cluster and its per-device memory (XLA's GPU buffer
assignment) set beside the analytic estimate (`estimate/memory_model.py`). `--fit` refits the
model's two coefficients per remat policy on the grid and shows the estimate before and after;
the fitted values are what `memory_model.CALIBRATION` holds.
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
from longt5_jax.errors import UsageError
from longt5_jax.estimate import candidates as cands
from longt5_jax.estimate import compile_ahead, memory_model, targets
from longt5_jax.estimate.shapes import ModelShapes
from longt5_jax.model import LongT5Config
from longt5_jax.parallel.devices import half_dtype
from longt5_jax.training.optim import OptimizerConfig, make_optimizer

# model:input_length:batch -> candidates "data,tensor,pipeline,zero,microbatches,repeats,remat"
GRID = {
    "base:4096:128": [
        "32,1,1,0,0,1,full", "32,1,1,3,0,1,full", "32,1,1,1,0,1,save_dots",
        "32,1,1,2,0,1,none", "8,4,1,1,0,1,full", "8,4,1,1,0,1,save_dots",
        "4,4,2,1,8,1,full", "16,1,2,0,4,2,full", "4,4,2,1,8,1,save_dots",
    ],
    "large:4096:256": [
        "32,1,1,1,0,1,full", "16,2,1,2,0,1,save_dots", "8,4,1,0,0,1,none", "8,2,2,1,4,1,full",
        "8,2,2,1,4,1,save_dots",
    ],
    "xl:8192:128": [
        "32,1,1,2,0,1,full", "32,1,1,3,0,1,save_dots", "8,4,1,1,0,1,full", "8,4,1,3,0,1,none",
        "4,4,2,1,8,1,full", "16,2,1,2,0,1,save_dots",
    ],
    "xl:16384:128": ["16,1,2,0,8,2,full", "16,1,2,0,4,1,full", "8,1,4,3,16,2,save_dots"],
    "xl:16384:64": [
        "32,1,1,3,0,1,full", "16,2,1,2,0,1,full", "8,4,1,1,0,1,full", "8,4,1,3,0,1,save_dots",
    ],
}  # fmt: skip
# The fused kernels' grid (`--attention_kernel pallas`): their four policies, pipelines too.
FUSED_GRID = {
    "base:4096:128": [
        "32,1,1,0,0,1,full", "32,1,1,3,0,1,save_attention", "32,1,1,1,0,1,save_dots",
        "32,1,1,2,0,1,none", "8,4,1,1,0,1,full", "8,4,1,1,0,1,save_attention",
        "8,4,1,1,0,1,save_dots", "8,4,1,1,0,1,none", "4,4,2,1,8,1,full",
        "4,4,2,1,8,1,save_attention", "4,4,2,1,8,1,save_dots",
    ],
    "large:4096:256": [
        "32,1,1,1,0,1,save_attention", "16,2,1,3,0,1,full", "16,2,1,2,0,1,save_dots",
        "8,4,1,0,0,1,none", "8,2,2,1,4,1,full", "8,2,2,1,4,1,save_attention",
        "8,2,2,1,4,1,save_dots",
    ],
    "xl:8192:128": [
        "32,1,1,2,0,1,full", "8,4,1,1,0,1,save_attention", "16,2,1,2,0,1,save_dots",
        "4,4,2,1,8,1,full", "4,4,2,1,8,1,save_attention", "8,1,4,3,16,2,save_dots",
    ],
    "xl:16384:64": [
        "32,1,1,3,0,1,full", "32,1,1,3,0,1,save_attention", "8,4,1,1,0,1,full",
        "16,1,2,0,4,1,full", "16,1,2,0,4,1,save_attention",
    ],
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m longt5_jax.bench memory", description=__doc__.splitlines()[0]
    )
    cli.add_cluster_arguments(p)
    p.add_argument("--grid", nargs="+", help="MODEL:LENGTH:BATCH=d,t,p,zero,m,r,remat[;...]")
    p.add_argument("--attention", default="tglobal")
    p.add_argument("--attention_kernel", default="xla", choices=["xla", "pallas"])
    p.add_argument("--target_length", type=cli.positive, default=512)
    p.add_argument("--optimizer", default="adafactor", choices=["adafactor", "adamw"])
    p.add_argument("--fit", action="store_true", help="refit the calibration on this grid")
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    page.add_argument(p)
    return p


def _grid(args: argparse.Namespace) -> dict[str, list[str]]:
    if not args.grid:
        return FUSED_GRID if args.attention_kernel == "pallas" else GRID
    out = {}
    for item in args.grid:
        key, sep, cands = item.partition("=")
        if not sep or key.count(":") != 2:
            raise ValueError(f"--grid {item!r}: expected MODEL:LENGTH:BATCH=d,t,p,zero,m,r,remat")
        out[key] = cands.split(";")
    return out


def _candidate(text: str, batch: int) -> cands.Candidate:
    parts = text.split(",")
    if len(parts) != 7:
        raise ValueError(f"candidate {text!r}: expected d,t,p,zero,microbatches,repeats,remat")
    *numbers, remat = parts
    data, tensor, pipeline, zero, microbatches, repeats = (int(n) for n in numbers)
    return cands.Candidate(data, tensor, pipeline, zero, microbatches, repeats, remat, batch)


def _measure(args, devices) -> list[dict]:
    optimizer = make_optimizer(OptimizerConfig(name=args.optimizer))
    rows = []
    for key, texts in _grid(args).items():
        model, length, batch = key.split(":")
        config = LongT5Config.preset(
            model,
            args.attention,
            dtype=half_dtype(devices[0]),
            attention_kernel=args.attention_kernel,
        )
        shapes = ModelShapes.of(config, optimizer)
        lengths = (int(length), args.target_length)
        for text in texts:
            c = _candidate(text, int(batch))
            print(f"compiling {model}@{length} {c.label()}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            compiled = compile_ahead.compile_for(
                dataclasses.replace(config, remat=c.remat),
                c.mesh(),
                devices,
                args.gpus_per_node,
                (c.batch_size, *lengths),
                optimizer=optimizer,
            )
            static, memory = cands.static_bytes(c, shapes), compiled.memory()
            rows.append(
                dict(
                    model=model,
                    input_length=int(length),
                    candidate=c.label(),
                    activations=cands.activations(c, config, lengths),
                    static=static,
                    compiled=memory.total,
                    # What the compile's total is made of: the state it takes and gives back
                    # (arguments, outputs) beside what it allocates within the step.
                    memory=memory.as_dict(),
                    compile_s=time.perf_counter() - start,
                )
            )
    return rows


def _table(rows: list[dict], calibrations: dict[str, dict]) -> None:
    names = list(calibrations)
    print(
        f"{'model':<12} {'candidate':<44} {'compiled GiB':>12} "
        + " ".join(f"{n + ' GiB':>11} {'ratio':>5}" for n in names)
    )
    for r in rows:
        cells = []
        for calibration in calibrations.values():
            est = r["static"] + r["activations"].bytes(calibration)
            cells.append(f"{est / 2**30:>11.2f} {r['compiled'] / est:>5.2f}")
        print(
            f"{r['model'] + '@' + str(r['input_length']):<12} {r['candidate']:<44} "
            f"{r['compiled'] / 2**30:>12.2f} " + " ".join(cells)
        )
    for name, calibration in calibrations.items():
        worst = max(abs(_estimate(r, calibration) / r["compiled"] - 1) for r in rows)
        print(f"{name}: worst |estimate / compiled - 1| = {worst:.1%}")


def markdown(rows: list[dict], calibrations: dict[str, dict]) -> str:
    """The results page's table: compiled GiB per device against each calibration's estimate."""
    columns = ["model", "candidate", "compiled GiB"]
    columns += [f"{name} {col}" for name in calibrations for col in ("GiB", "ratio")]
    table = []
    for r in rows:
        estimates = [_estimate(r, c) for c in calibrations.values()]
        cells = [x for e in estimates for x in (f"{e / 2**30:.2f}", f"{r['compiled'] / e:.2f}")]
        model = f"{r['model']} {r['input_length'] // 1024}k"
        table.append([model, r["candidate"], f"{r['compiled'] / 2**30:.2f}", *cells])
    return page.markdown(columns, table)


def _estimate(row: dict, calibration: dict) -> float:
    return row["static"] + row["activations"].bytes(calibration)


def _plot(rows: list[dict], calibrations: dict[str, dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 6))
    top = max(r["compiled"] for r in rows) / 2**30
    for name, calibration in calibrations.items():
        ax.scatter(
            [r["compiled"] / 2**30 for r in rows],
            [_estimate(r, calibration) / 2**30 for r in rows],
            label=name,
        )
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    ax.plot([0, top], [0, 1.15 * top], "k:", lw=0.6)
    ax.plot([0, top], [0, top / 1.15], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compiled GiB per device")
    ax.set_ylabel("estimated GiB per device")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    page.check(args.results, "memory", argv)
    try:
        _grid(args)
        if not targets.load(args.target).is_gpu:
            raise ValueError("--target: the calibration is against a GPU compile")
        _, devices = targets.open_target(args.target, args.nodes, args.gpus_per_node)
        rows = _measure(args, devices)
    except ValueError as e:
        raise UsageError(str(e)) from None
    calibrations = {"estimate": memory_model.CALIBRATION}
    if args.fit:
        samples = [(r["activations"], r["static"], r["compiled"]) for r in rows]
        fitted = memory_model.fit(samples)
        calibrations["refit"] = {**memory_model.CALIBRATION, **fitted}
        print("refit: " + ", ".join(f"{k}: ({a:.2f}, {b:.2f})" for k, (a, b) in fitted.items()))
    _table(rows, calibrations)
    out = Path(args.out_dir)
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "calibrations": calibrations,
        "rows": [
            {**r, "activations": dataclasses.asdict(r["activations"])}
            | {f"estimate_{n}": _estimate(r, c) for n, c in calibrations.items()}
            for r in rows
        ],
    }
    write_json(out, "memory", report)
    _plot(rows, calibrations, out / "memory.png")
    where = page.machine(f"{args.nodes} x {args.gpus_per_node} {args.target}")
    page.publish(args, "memory", argv, markdown(rows, calibrations), where=where)
    return 0
