"""The fused attention kernels against the XLA path they replace, on this machine's backend.

Each case is one attention layer (projections included) of a published size, with random
parameters and padded or packed rows: the encoder's `LongSelfAttention` (tglobal or local), or
the decoder's causal self-attention (512 targets, or LENGTH if fewer, with its bias) followed by
cross-attention over LENGTH encoder tokens (`decoder`). For float32 and bfloat16 it reports the
output's and every gradient's largest error relative to the largest value of the float32 XLA
path (padding rows excluded: the model masks them downstream), and the time of the layer's
forward and backward with each path (median of the timed runs after a warm-up); with several
`--launch` settings, the kernels' time under each (once a program: a setting of none of a case's
kernels is not timed there), and the launch for a train step: every setting that beat the
default, together where they set different kernels. On a GPU the kernels are Triton; elsewhere
they are interpreted (use small cases there).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax

from longt5_jax import cli, kernel_checks
from longt5_jax.bench import profile
from longt5_jax.bench import results as page
from longt5_jax.bench.device import launch_text, parse_launch
from longt5_jax.bench.report import write_json
from longt5_jax.errors import UsageError
from longt5_jax.kernels.launch import KERNELS, kernels_set_by

COLUMNS = {  # the results page's table: `results.records`' paths and formats
    "case": ("case", ""), "XLA s": ("xla_seconds", ".5f"), "kernels s": ("pallas_seconds", ".5f"),
}  # fmt: skip
CASES = [
    "base:tglobal:4096:2:padded",
    "base:tglobal:16384:1:packed",
    "xl:local:4096:1:padded",
    "base:decoder:4096:2:padded",
]


def _time(run, repeats: int) -> float:
    """Median seconds of run() (after one warm-up)."""
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def kernel_times(run, runs: int = 3) -> list[dict]:
    """The device's kernels over `runs` calls of run() (after a warm-up), per call."""
    run()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(runs):
                run()
        return profile.device_kernels(profile.read_trace(Path(trace_dir)), runs)


def measure(
    case: str, repeats: int, launches: Sequence[tuple] = ((),), trace: bool = False
) -> dict:
    xla, problem = kernel_checks.case_problem(case)
    pallas = dataclasses.replace(xla, attention_kernel="pallas")
    real = problem[1]["seg"][..., None] > 0
    reference = kernel_checks.run_layer(xla, *problem)
    device = jax.devices()[0].device_kind
    report = {"case": case, "backend": jax.default_backend(), "device": device}
    first = launches[0]
    report["launch"] = launch_text(first)  # what the checks and `pallas_*` ran with
    report["pallas_float32"] = kernel_checks.relative_errors(
        kernel_checks.run_layer(pallas, *problem, launch=first), reference, real
    )
    for name, config in (("xla", xla), ("pallas", pallas)):
        low = kernel_checks.run_layer(config, *problem, "bfloat16", first)
        report[f"{name}_bfloat16"] = kernel_checks.relative_errors(low, reference, real)
        if repeats:
            report[f"{name}_seconds"] = _time(
                lambda c=config: kernel_checks.run_layer(c, *problem, "bfloat16", first), repeats
            )
    if trace:
        for name, config in (("xla", xla), ("pallas", pallas)):
            report[f"{name}_kernels"] = kernel_times(
                lambda c=config: kernel_checks.run_layer(c, *problem, "bfloat16", first)
            )
    if repeats and len(launches) > 1:
        report["launch_seconds"], report["launch_errors"] = {}, {}
        if trace:
            report["launch_kernels"] = {}
        for launch in launches:  # one setting none of the case's kernels: the first's program
            if launch != first and not kernels_set_by(launch) & family(case):
                report.setdefault("launch_as_first", []).append(launch_text(launch))
                continue
            run = functools.partial(kernel_checks.run_layer, pallas, *problem, "bfloat16", launch)
            try:
                seconds = _time(run, repeats)
            except Exception as e:  # a setting the GPU cannot launch (registers, shared memory)
                report["launch_errors"][launch_text(launch)] = str(e).splitlines()[0][:300]
                continue
            report["launch_seconds"][launch_text(launch)] = seconds
            if trace and launch != first:  # the first's kernels are pallas_kernels
                report["launch_kernels"][launch_text(launch)] = kernel_times(run)
    return report


def _print(report: dict) -> None:
    worst = {k: max(v.values()) for k, v in report.items() if k.endswith(("32", "16"))}
    line = "  ".join(f"{k} {v:.1e}" for k, v in worst.items())
    print(f"{report['case']:32} worst relative error: {line}")
    if "xla_seconds" in report:
        x, p = report["xla_seconds"], report["pallas_seconds"]
        print(f"{'':32} fwd+bwd bf16: xla {x * 1e3:.2f} ms, pallas {p * 1e3:.2f} ms ({x / p:.2f}x)")
    for launch, seconds in report.get("launch_seconds", {}).items():
        print(f"{'':32} pallas {seconds * 1e3:8.2f} ms with --launch {launch or '(default)'}")
    for launch, error in report.get("launch_errors", {}).items():
        print(f"{'':32} --launch {launch}: {error}")
    if "pallas_kernels" in report:
        print("  the kernels' layer, bf16, forward and backward, by kernel:")
        profile.print_kernels(report["pallas_kernels"], 12)
    for launch, kernels in report.get("launch_kernels", {}).items():
        print(f"  by kernel with --launch {launch or '(default)'}:")
        profile.print_kernels(kernels, 12)


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    p = cli.ArgumentParser(
        prog="python -m longt5_jax.bench kernels", description=__doc__.splitlines()[0]
    )
    p.add_argument("--cases", nargs="+", default=CASES, help=CASES[0])
    p.add_argument("--repeats", type=int, default=10, help="timed runs per kernel (0: none)")
    p.add_argument(
        "--launch",
        nargs="+",
        type=parse_launch,
        default=[()],
        help="Triton launch settings to time, PATTERN=WARPS:STAGES[,...] each (the first is "
        "checked; '' is the default)",
    )
    p.add_argument(
        "--trace", action="store_true", help="time each kernel of both paths (jax.profiler)"
    )
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    page.add_argument(p)
    args = p.parse_args(argv)
    page.check(args.results, "kernels", argv)
    for case in args.cases:
        kernel_checks.parse_case(case)
    if args.repeats < 0:
        raise UsageError(f"--repeats {args.repeats}: expected >= 0")
    config = {**vars(args), "launch": [launch_text(x) for x in args.launch]}
    reports = []
    for case in args.cases:
        reports.append(measure(case, args.repeats, args.launch, args.trace))
        _print(reports[-1])
        # After each case: a run stopped by its time limit (gpu_check.sh's) keeps what it timed.
        best = _best_launch(reports)
        write_json(
            args.out_dir, "kernels", {"config": config, "cases": reports, "best_launch": best}
        )
    if best is not None:
        print(f"--launch for the step (what beat the default): {best or '(default)'}")
    page.publish(args, "kernels", argv, page.records(reports, COLUMNS), where=page.machine())
    return 0


def _best_launch(reports: list[dict]) -> str | None:
    """The launch to run steps with: together, each setting timed on every case that took the
    cases' layers less time than the default (''), most gained first, leaving out one that sets
    a kernel an earlier one sets. A setting sets only the kernels its patterns match, and the
    settings taken set none in common, so each kernel runs as in the setting that gained, and
    their gains add up (a layer's time is its kernels' and XLA's, a case's kernels one family's:
    a decoder split and TGlobal's dq split both count, where the fastest alone would drop one).
    `gpu_check.sh` then times the train step with it beside the default. Without the default
    timed, the fastest setting; None where no settings were timed."""
    timed = [_layer_seconds(r) for r in reports if "launch_seconds" in r]
    everywhere = set.intersection(*(set(t) for t in timed)) if timed else set()
    totals = {launch: sum(t[launch] for t in timed) for launch in everywhere}
    if "" not in totals:
        return min(totals, key=lambda x: totals[x]) if totals else None
    taken: list[str] = []
    kernels: set[str] = set()
    for launch in sorted((x for x in totals if totals[x] < totals[""]), key=lambda x: totals[x]):
        sets = kernels_set_by(parse_launch(launch))
        if not sets & kernels:
            taken.append(launch)
            kernels |= sets
    return ",".join(taken)


def _layer_seconds(report: dict) -> dict[str, float]:
    """A case's layer time under each launch setting: where every setting was traced (`--trace`),
    its kernels' device time, else the timed calls', which count the host's dispatch too (on an
    H200 the calls' spread hid the decoder's dkv in 4 warps: docs/journal.md, "Launch settings")."""
    seconds = report["launch_seconds"]
    traced = {**report.get("launch_kernels", {})}
    if "pallas_kernels" in report and "launch" in report:
        traced[report["launch"]] = report["pallas_kernels"]
    if set(seconds) <= set(traced):
        seconds = {launch: sum(k["ms"] for k in traced[launch]) / 1e3 for launch in seconds}
    first = seconds.get(report.get("launch"))  # what the settings it stood for ran
    return {**seconds, **dict.fromkeys(report.get("launch_as_first", []) if first else [], first)}


def family(case: str) -> set[str]:
    """The kernels a case's layer calls (`kernel_KERNELS`)."""
    start = {"tglobal": "encoder_attention_", "local": "encoder_local_attention_"}
    return {
        k for k in KERNELS if k.startswith(start.get(kernel_checks.parse_case(case)[1], "decoder_"))
    }
