"""Where the HBM traffic and the roofline time of the single-device train step go, by model part.

Each case (model, input length, batch, remat) is the step the training loop runs on one GPU
(`ShardedStep`: half-precision activations, bf16 or fp16 as the GPU has, float32 parameters, AdamW
or `--optimizer adafactor`),
compiled deviceless for `--target` in a process of its own, as `bench device` does: no compiler
state or kernel cache carries from one case to the next (each process's resident memory stays
small, xl at 16k tokens included). Its kernels are costed by `estimate/roofline.py`
(each max(FLOPs / peak, bytes / HBM bandwidth), Pallas Triton kernels at the FLOPs they declare) and
reported as:

- HBM bytes per step; roofline seconds and the part of them spent in memory-bound kernels;
- roofline MFU: the model's analytic FLOPs (`estimate.flops`, no recomputation) over peak x roofline
  seconds, and the ideal time (those FLOPs at peak);
- the kernels grouped by the jax name stack in their HLO metadata: transforms (jit, jvp,
  transpose, vmap), scan and remat plumbing dropped, the module path kept with the op (the einsum
  spec for an einsum's dot, the primitive otherwise, the kernel's name for a Pallas call), and
  marked fwd, bwd (under `transpose`), remat (the forward recomputed for the backward) or `-`
  (outside the differentiated function, e.g. the optimizer's update, or no metadata at all: a
  kernel the compiler made, named by its instruction);
- the kernels by kind (`estimate.roofline.KINDS_OF_KERNEL`: the Pallas attention kernels, matmuls,
  the memory-bound rest), in the terms `bench profile` sorts a GPU's timeline into, beside the
  time a step may take at `--goal_mfu`, and the rate the Pallas kernels would need for that goal
  if the matmuls ran at `--matmul_tflops` (by default the peak; a GPU's measured rate is lower)
  and the rest at the HBM bandwidth: what a goal asks of the kernels, everything else at best.

`--compare BEFORE.json` prints the change against an earlier report of this command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from longt5_jax import cli
from longt5_jax.bench import device
from longt5_jax.bench import results as page
from longt5_jax.bench.report import pyplot, save_figure, write_json
from longt5_jax.errors import UsageError
from longt5_jax.estimate import compile_ahead, flops, hlo, hlo_module, roofline, targets
from longt5_jax.kernels import launch as base
from longt5_jax.model import LongT5Config

CASES = [
    "base:16384:2:full",
    "large:4096:4:full",
    "xl:4096:1:full",
    "base:4096:4:none",
    "xl:16384:1:full",
]
_RESULT = "RESULT "
COLUMNS = {  # the results page's table: `results.records`' paths and formats
    "case": ("case", ""), "HBM GB": ("roofline.bytes", "GB"), "GiB": ("memory.total", "GiB"),
    "roofline ms": ("roofline.seconds", "ms"), "roofline MFU": ("mfu", ".1%"),
    "Pallas TFLOP/s the goal needs": ("goal.pallas_tflops", ".0f"),
}  # fmt: skip
# Name-stack entries that say how an op was reached, not which part of the model it belongs to.
_TRANSFORM = re.compile(r"^[\w.]*\(.*\)$")  # jit(f), jvp(LongT5), transpose(jvp(..)), vmap()
# Name-stack entries of jax's own machinery, not the model's (jax 0.12 names a scanned layer's
# call `eval_jaxpr` where 0.10 says `closed_call`).
_PLUMBING = {"while", "body", "cond", "closed_call", "checkpoint", "remat", "rematted_computation",
             "eval_jaxpr"}  # fmt: skip
_INSTANCE = re.compile(r"\.\d+$")


def _parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m longt5_jax.bench roofline", description=__doc__.splitlines()[0]
    )
    device.add_step_arguments(p, CASES, targets.names_help(), cli.positive)
    p.add_argument("--top", type=cli.positive, default=10, help="groups listed per case")
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    page.add_argument(p)
    p.add_argument("--compare", type=Path, metavar="BEFORE.json", help="an earlier report")
    p.add_argument(
        "--goal_mfu", type=cli.fraction, default=0.35,
        help="the MFU whose step time the kinds are set beside (default 0.35)",
    )  # fmt: skip
    p.add_argument(
        "--matmul_tflops", type=cli.rate,
        help="the matmuls' rate for the goal's arithmetic (default: the target's peak)",
    )  # fmt: skip
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def describe(op_name: str, kernel_name: str) -> tuple[str, str, str]:
    """(direction, module path, op) of a kernel from its op_name metadata; a kernel without
    metadata is named by its instruction (`copy`, `loop_broadcast_fusion`)."""
    parts = [p for p in op_name.split("/") if p]
    if not parts:
        return "", "", _INSTANCE.sub("", kernel_name)
    transforms = " ".join(p for p in parts if _TRANSFORM.match(p))
    if "rematted_computation" in parts:
        direction = "remat"
    elif "transpose(" in transforms:
        direction = "bwd"
    else:
        direction = "fwd" if "jvp(" in transforms else ""
    *path, op = parts
    path = [p for p in path if not _TRANSFORM.match(p) and p not in _PLUMBING]
    if op == "pallas_call" and path:  # .../NAME.flops_N/pallas_call
        op = re.sub(r"\.flops_\d+$", "", path.pop())
    elif path and "->" in path[-1]:  # an einsum: its spec names the op
        spec = path.pop()
        op = spec if op == "dot_general" else f"{spec}/{op}"
    return direction, "/".join(path), op


def groups(kernels: list, total_s: float) -> list[dict]:
    """Kernels (`estimate.roofline.kernels`) summed per (direction, module path, op), the costliest
    first; `share` is of `total_s`, `count` the launches per step."""
    acc: dict[tuple[str, str, str], dict] = {}
    for k in kernels:
        key = describe(k.op_name, k.name)
        g = acc.setdefault(
            key,
            {"direction": key[0], "part": key[1], "op": key[2], "bytes": 0.0, "flops": 0.0,
             "seconds": 0.0, "compute_bound_s": 0.0, "count": 0},
        )  # fmt: skip
        g["bytes"] += k.times * k.bytes
        g["flops"] += k.times * (k.fast_flops + k.slow_flops)
        g["seconds"] += k.times * k.seconds
        g["compute_bound_s"] += k.times * k.compute_s * (k.compute_s >= k.memory_s)
        g["count"] += k.times
    rows = sorted(acc.values(), key=lambda g: -g["seconds"])
    for g in rows:
        g["share"] = g["seconds"] / total_s if total_s else 0.0
    return rows


def rate_needed(flops_: float, seconds: float) -> float:
    """FLOP/s that do `flops_` in `seconds`; inf where no time is left (the goal's step time is
    gone before the Pallas kernels run)."""
    return flops_ / seconds if seconds > 0 else float("inf")


def measure(args, case: str) -> dict:
    """One case compiled deviceless for the target: roofline totals and groups, memory."""
    target, devices = targets.open_target(args.target, 1, 1)
    config, step, shape, _ = device.case_step(args, case, devices)
    began = time.perf_counter()
    executable = compile_ahead.compile_step(step, *shape)
    compile_s = time.perf_counter() - began
    module = hlo_module.Module.parse(executable.as_text())
    peak, hbm = target.figures.peak_tflops * 1e12, target.hbm_gbps * 1e9
    kernels = roofline.kernels(module, peak, hbm)
    total = roofline.total(kernels)
    model_flops = flops.train_flops_per_step(config, *shape)
    kinds = roofline.by_kind(kernels)
    # The goal's arithmetic: its step time, less the matmuls at the rate asked and the rest at
    # the bandwidth, is what the Pallas kernels' FLOPs may take.
    goal_s = model_flops / (peak * args.goal_mfu)
    rate = (args.matmul_tflops or target.figures.peak_tflops) * 1e12
    matmul_s = roofline.by_kind(roofline.kernels(module, rate, hbm))["matmul"].seconds
    return {
        "case": case,
        "target": target.name,
        "compile_s": compile_s,
        "memory": hlo.memory(executable).as_dict(),
        "roofline": total.as_dict(),
        "memory_bound_s": total.seconds - total.compute_bound_seconds,
        "model_flops": model_flops,
        "ideal_s": model_flops / peak,
        "mfu": model_flops / (peak * total.seconds),
        "groups": groups(kernels, total.seconds),
        "kinds": {kind: r.as_dict() for kind, r in kinds.items()},
        "goal": {
            "mfu": args.goal_mfu,
            "seconds": goal_s,
            "matmul_tflops": rate / 1e12,
            "matmul_s": matmul_s,
            "pallas_tflops": rate_needed(
                kinds["pallas"].flops, goal_s - matmul_s - kinds["other"].seconds
            )
            / 1e12,
        },
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def _child(args, case: str) -> dict:
    """Run one case in a process of its own; its report comes back on stdout."""
    env = {**os.environ, **targets.DEVICELESS_ENV}
    cmd = [sys.executable, "-m", "longt5_jax.bench", "roofline", "--child", "--cases", case]
    cmd += device.step_argv(args) + ["--goal_mfu", str(args.goal_mfu)]
    cmd += ["--matmul_tflops", str(args.matmul_tflops)] if args.matmul_tflops else []
    began = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith(_RESULT)]
    if not lines:
        return {"case": case, "error": f"the compile of {case} exited {done.returncode}"}
    return {**json.loads(lines[-1][len(_RESULT) :]), "wall_s": time.perf_counter() - began}


def _print(rows: list[dict], top: int, goal: float) -> None:
    w = max([22, *(len(r["case"]) for r in rows)])
    print(
        f"{'case':{w}} {'GB/step':>8} {'roof ms':>8} {'ideal ms':>8} {'MFU':>6} {'mem-bd':>6} "
        f"{'kernels':>8} {'compile s':>9} {'GiB':>6}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['case']:{w}} {r['error']}")
            continue
        roof = r["roofline"]
        print(
            f"{r['case']:{w}} {roof['bytes'] / 1e9:8.1f} {roof['seconds'] * 1e3:8.1f} "
            f"{r['ideal_s'] * 1e3:8.1f} {r['mfu']:6.1%} "
            f"{r['memory_bound_s'] / roof['seconds']:6.1%} {roof['kernels']:8d} "
            f"{r['compile_s']:9.1f} {r['memory']['total'] / 2**30:6.2f}"
        )
    _print_kinds(rows, goal)
    for r in rows:
        if "error" in r:
            continue
        print(f"\n{r['case']}: top {top} of {len(r['groups'])} groups")
        print(f"  {'dir':5} {'GB':>7} {'ms':>7} {'share':>6} {'count':>6}  part  op")
        for g in r["groups"][:top]:
            print(
                f"  {g['direction'] or '-':5} {g['bytes'] / 1e9:7.1f} {g['seconds'] * 1e3:7.2f} "
                f"{g['share']:6.1%} {g['count']:6d}  {g['part'] or '-'}  {g['op']}"
            )


def _cell(r: dict) -> str:
    """A roofline in a cell: 'ms (TFLOP, GB)'."""
    return f"{r['seconds'] * 1e3:.1f} ({r['flops'] / 1e12:.1f}, {r['bytes'] / 1e9:.1f})"


def _print_kinds(rows: list[dict], goal: float) -> None:
    """Each case's roofline by kind of kernel, the step time `goal` MFU allows, and the rate the
    Pallas kernels need for it with the matmuls at the rate given and the rest at bandwidth."""
    rows = [r for r in rows if "error" not in r]
    if not rows:
        return
    kinds, width = roofline.KINDS_OF_KERNEL, max([22, *(len(r["case"]) for r in rows)])
    print(f"\nby kind: roofline ms (TFLOP, GB); the step at {goal:.0%} MFU")
    head = " ".join(f"{k:>20}" for k in kinds)
    print(f"{'case':{width}} {head} {'goal ms':>8} {'matmul ms':>17} {'pallas TFLOP/s':>14}")
    for r in rows:
        cells = " ".join(f"{_cell(r['kinds'][k]):>20}" for k in kinds)
        g = r["goal"]
        matmul = f"{g['matmul_s'] * 1e3:.1f} at {g['matmul_tflops']:.0f}"
        print(
            f"{r['case']:{width}} {cells} {g['seconds'] * 1e3:8.1f} {matmul:>17} "
            f"{g['pallas_tflops']:14.0f}"
        )


def load_report(path: Path) -> dict[str, dict]:
    """An earlier report of this command: its rows by case."""
    try:
        rows = json.loads(path.read_text())["rows"]
        return {r["case"]: r for r in rows if "error" not in r and "roofline" in r}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"--compare {path}: not a report of bench roofline ({e})") from None


def compare(before: dict[str, dict], rows: list[dict]) -> list[dict]:
    """Per case in both: bytes, roofline seconds and MFU before and after, and after / before."""
    out = []
    for r in rows:
        b = before.get(r["case"])
        if b is None or "error" in r:
            continue
        pairs = {
            "bytes": (b["roofline"]["bytes"], r["roofline"]["bytes"]),
            "roofline_s": (b["roofline"]["seconds"], r["roofline"]["seconds"]),
            "mfu": (b["mfu"], r["mfu"]),
        }
        row = {"case": r["case"]}
        for name, (was, now) in pairs.items():
            row[name] = {"before": was, "after": now, "ratio": now / was if was else float("nan")}
        out.append(row)
    return out


def _print_comparison(changes: list[dict], path: Path) -> None:
    w = max([22, *(len(c["case"]) for c in changes)])
    print(f"\nagainst {path} (ratio = after / before)")
    print(
        f"{'case':{w}} {'GB before':>9} {'after':>7} {'ratio':>6} {'ms before':>9} {'after':>7} "
        f"{'ratio':>6} {'MFU before':>10} {'after':>6} {'ratio':>6}"
    )
    for c in changes:
        b, s, m = c["bytes"], c["roofline_s"], c["mfu"]
        print(
            f"{c['case']:{w}} {b['before'] / 1e9:9.1f} {b['after'] / 1e9:7.1f} {b['ratio']:6.3f} "
            f"{s['before'] * 1e3:9.1f} {s['after'] * 1e3:7.1f} {s['ratio']:6.3f} "
            f"{m['before']:10.1%} {m['after']:6.1%} {m['ratio']:6.3f}"
        )


def _label(group: dict, width: int = 48) -> str:
    """A group in a line: direction, the innermost parts of its path that fit, and its op."""
    parts = group["part"].split("/")
    while len(parts) > 1 and len("/".join(parts)) > width:
        parts = parts[1:]
    path = "/".join(parts) if parts == group["part"].split("/") else ".../" + "/".join(parts)
    return f"{group['direction'] or '-'} {path or '-'} {group['op']}"


def _plot(rows: list[dict], top: int, path: Path) -> None:
    rows = [r for r in rows if "error" not in r]
    if not rows:
        return
    plt = pyplot()
    fig, axes = plt.subplots(len(rows) + 1, 1, figsize=(11, 2.2 + 2.6 * len(rows)), squeeze=False)
    ax = axes[0][0]
    names = [r["case"] for r in rows]
    memory = [r["memory_bound_s"] * 1e3 for r in rows]
    compute = [r["roofline"]["compute_bound_seconds"] * 1e3 for r in rows]
    ax.barh(names, memory, label="memory-bound kernels", color="#6baed6")
    ax.barh(names, compute, left=memory, label="compute-bound kernels", color="#fd8d3c")
    ax.scatter([r["ideal_s"] * 1e3 for r in rows], names, color="k", label="model FLOPs at peak")
    ax.set_xlabel(f"roofline ms per step on {rows[0]['target']}")
    ax.legend(fontsize=7)
    for r, (ax,) in zip(rows, axes[1:], strict=True):
        shown = r["groups"][:top][::-1]
        ax.barh(range(len(shown)), [100 * g["share"] for g in shown], color="#6baed6")
        ax.set_yticks(range(len(shown)), [_label(g) for g in shown], fontsize=6)
        ax.set_title(f"{r['case']}: % of roofline time", fontsize=9)
    save_figure(fig, path)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    page.check(None if args.child else args.results, "roofline", argv)
    for case in args.cases:
        model = device.parse_case(case)[0]
        LongT5Config.preset(model, args.attention)  # an unknown model or attention, said now
    if not targets.load(args.target).is_gpu:
        raise UsageError(f"--target {args.target}: bench roofline costs GPU kernels")
    if args.child:
        with base.launch(args.launch):  # read where the kernels are traced
            print(_RESULT + json.dumps(measure(args, args.cases[0])), flush=True)
        return 0
    before = load_report(args.compare) if args.compare else None
    rows = []
    for case in args.cases:
        print(f"{case}: deviceless compile for {args.target}", file=sys.stderr, flush=True)
        rows.append(_child(args, case))
    _print(rows, args.top, args.goal_mfu)
    out = Path(args.out_dir)
    config = {**vars(args), "launch": device.launch_text(args.launch)}
    report: dict[str, Any] = {
        "config": {k: v for k, v in config.items() if k not in ("out_dir", "child")}
    }
    report["rows"] = rows
    if before is not None:
        report["comparison"] = compare(before, rows)
        _print_comparison(report["comparison"], args.compare)
    write_json(out, "roofline", report)
    _plot(rows, args.top, out / "roofline.png")
    where = page.machine(f"one {args.target}")
    page.publish(args, "roofline", argv, page.records(rows, COLUMNS), where=where)
    return 0 if all("error" not in r for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)
