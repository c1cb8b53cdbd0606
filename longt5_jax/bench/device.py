"""The train step on this machine's GPU, against the deviceless compile of the same step.

Each case (model, input length, batch, remat) is the step the training loop runs (`ShardedStep`
on one device: bf16 activations, float32 parameters, AdamW or `--optimizer`) and is measured
twice, each in a process of its own so that neither compiler nor allocator state leaks between
cases:

- compiled deviceless for `--target` (the compile-only GPU the planner and `bench cluster` use):
  memory from its buffer assignment, and the roofline of its kernels as a step-time estimate;
- compiled for and run on this process's GPU: the same buffer assignment read from the real
  compile, the allocator's peak over the steps, and the step time (median of the timed steps
  after warm-up), as tokens/s and MFU: model FLOPs per second over the target's dense bf16 peak
  and over the bf16 matmul rate measured in the same process.

The ratios (real / deviceless memory, measured / roofline time) say how far the figures the
planner and `bench cluster` give for a cluster nobody here has can be trusted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from longt5_jax import cli
from longt5_jax.bench import results as page
from longt5_jax.bench.pipeline import random_batch
from longt5_jax.bench.report import pyplot, save_figure, write_json
from longt5_jax.bench.torch_steps import time_train_steps
from longt5_jax.bench.train_steps import peak_matmul_flops, torch_inputs
from longt5_jax.errors import UsageError
from longt5_jax.estimate import compile_ahead, cost, flops, hlo, targets
from longt5_jax.kernels import launch as base
from longt5_jax.model import LongT5Config
from longt5_jax.model.config import REMAT_POLICIES
from longt5_jax.parallel.devices import half_dtype
from longt5_jax.parallel.mesh import ParallelConfig
from longt5_jax.training.optim import NAMES, OptimizerConfig, make_optimizer
from longt5_jax.training.step import StepConfig

CASES = ["base:4096:8:none", "base:16384:2:full", "large:4096:4:full", "xl:4096:2:full"]
COLUMNS = {  # the results page's table: `results.records`' paths and formats
    "case": ("case", ""), "step s": ("gpu.step_s", ".3f"), "MFU": ("gpu.mfu", ".1%"),
    "HFU": ("gpu.hfu", ".1%"), "GiB": ("gpu.memory.total", "GiB"),
    "GiB deviceless": ("deviceless.memory.total", "GiB"), "transformers s":
    ("transformers.step_s", ".3f"), "speed-up": ("speedup_over_transformers", ".2f"),
}  # fmt: skip
_RESULT = "RESULT "
_NO_GPU = "bench device runs the step on a GPU; this process has none"
AUTOTUNE_CACHE_OPTION = "xla_gpu_per_fusion_autotune_cache_dir"


def add_step_arguments(p, cases: list[str], target_help: str, length_type=cli.positive) -> None:
    """The arguments `case_step` reads: the cases, the compile target, the attention, its
    kernels, their launch settings, the target length and the optimizer (bench device and bench
    roofline)."""
    p.add_argument("--cases", nargs="+", default=cases, help="MODEL:INPUT_LENGTH:BATCH[:REMAT]")
    p.add_argument("--target", default="h100-80gb", help=target_help)
    p.add_argument("--attention", default="tglobal")
    p.add_argument("--attention_kernel", default="xla", choices=["xla", "pallas"])
    p.add_argument("--target_length", type=length_type, default=512)
    p.add_argument(
        "--scan_layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the layer stacks as a scan (default) or unrolled (LongT5Config.scan_layers)",
    )
    # AdamW by default, as the field's MFU figures (and torch's step beside ours) use; Adafactor
    # is the training loop's default (LongT5's T5X setup): a fraction of AdamW's state, an update
    # of about its bytes (docs/journal.md, "Adafactor against AdamW").
    p.add_argument("--optimizer", default="adamw", choices=NAMES)
    add_launch_argument(p)


def add_launch_argument(p) -> None:
    """--launch: the kernels' Triton launch settings (`parse_launch`; none: `launch.LAUNCH`),
    as every benchmark that compiles them takes it."""
    p.add_argument(
        "--launch",
        type=parse_launch,
        default=(),
        metavar="PATTERN=WARPS:STAGES[:SPLIT[:KEYS]],...",
        help="Triton launch settings of the kernels by kernel name (first match wins)",
    )


def step_argv(args) -> list[str]:
    """`add_step_arguments`' values but the cases, as a child process' arguments."""
    scan = "--scan_layers" if args.scan_layers else "--no-scan_layers"
    return ["--target", args.target, "--attention", args.attention, "--attention_kernel",
            args.attention_kernel, "--target_length", str(args.target_length), scan,
            "--launch", launch_text(args.launch), "--optimizer", args.optimizer]  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m longt5_jax.bench device", description=__doc__.splitlines()[0]
    )
    add_step_arguments(p, CASES, "what the deviceless compile targets")
    p.add_argument(
        "--deviceless",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also compile each case deviceless for --target (memory and roofline ratios)",
    )
    p.add_argument("--steps", type=cli.positive, default=10, help="timed steps per case")
    p.add_argument("--warmup", type=cli.nonnegative, default=2)
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    p.add_argument(
        "--transformers", action="store_true", help="also time transformers' LongT5 (torch)"
    )
    keep = "keep XLA's autotuning results in DIR: later runs skip it and run the same tilings"
    p.add_argument("--autotune_cache", type=Path, metavar="DIR", help=keep)
    p.add_argument("--child", choices=["gpu", "deviceless", "torch"], help=argparse.SUPPRESS)
    page.add_argument(p)
    return p


def parse_launch(text: str) -> tuple[tuple, ...]:
    """'encoder_attention_fwd=4:3:2,*=4:2' -> ((pattern, warps, stages[, split[, keys]]),
    ...)."""
    settings = []
    for item in filter(None, text.split(",")):
        pattern, _, numbers = item.partition("=")
        values = numbers.split(":")
        numeric = len(values) in (2, 3, 4) and all(x.isdigit() for x in values)
        powers = ("1", "2", "4", "8", "16")
        known = numeric and values[0] in powers and all(x in powers for x in values[2:3])
        known = known and all(x in ("16", "32", "64") for x in values[3:])
        if not (pattern and known):
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected PATTERN=WARPS:STAGES[:SPLIT[:KEYS]] (warps and split 1, 2, "
                "4, 8 or 16; keys a tile 16, 32 or 64)"
            )
        settings.append((pattern, *map(int, values)))
    return tuple(settings)


def launch_text(settings) -> str:
    return ",".join(f"{s[0]}=" + ":".join(map(str, s[1:])) for s in settings)


def parse_case(text: str) -> tuple[str, int, int, str]:
    """(model, input length, batch, remat) of a MODEL:INPUT_LENGTH:BATCH[:REMAT] case."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or not all(x.isdigit() and int(x) > 0 for x in parts[1:3]):
        raise ValueError(f"--cases {text!r}: expected MODEL:INPUT_LENGTH:BATCH[:REMAT]")
    remat = parts[3] if len(parts) == 4 else "full"
    if remat not in REMAT_POLICIES:
        raise ValueError(
            f"--cases {text!r}: remat {remat!r} is not one of {', '.join(REMAT_POLICIES)}"
        )
    return parts[0], int(parts[1]), int(parts[2]), remat


def case_step(args, case: str, devices: list):
    """(config, the training loop's single-device step on devices[0], (batch, input, target)
    shape, remat) of a case; `args` gives the attention and the target length."""
    model, length, batch, remat = parse_case(case)
    config = LongT5Config.preset(
        model,
        args.attention,
        dtype=half_dtype(devices[0]),
        remat=remat,
        attention_kernel=args.attention_kernel,
        scan_layers=args.scan_layers,
    )
    optimizer = make_optimizer(OptimizerConfig(name=args.optimizer))
    step = compile_ahead.sharded_step(
        config, ParallelConfig(data=1), StepConfig(), optimizer, devices[:1], 1
    )
    return config, step, (batch, length, args.target_length), remat


def _deviceless(args, case: str) -> dict:
    """The step compiled for the target's compile-only GPU: memory and roofline."""
    target, devices = targets.open_target(args.target, 1, 1)
    _, step, shape, _ = case_step(args, case, devices)
    began = time.perf_counter()
    compiled = compile_ahead.CompiledStep(step, compile_ahead.compile_step(step, *shape), 1)
    a = compiled.analyse(cost.Cluster.of(target, 1, 1))
    return {
        "compile_s": time.perf_counter() - began,
        "memory": a["memory"],
        "roofline_s": a["roofline"]["seconds"],
    }


def _on_gpu(args, case: str) -> dict:
    """The step compiled for and run on this process's GPU."""
    if jax.default_backend() != "gpu":
        raise ValueError(_NO_GPU)
    device = jax.devices()[0]
    config, step, (b, length, target_length), remat = case_step(args, case, jax.devices())
    state = step.init(jax.random.key(0))
    features = random_batch(b, length, target_length, config.vocab_size)
    batch = jax.device_put({k: jnp.asarray(v) for k, v in features.items()}, step.batch_sharding)
    began = time.perf_counter()
    compiled, autotune_cache = _compile(step.lower(state, batch), args.autotune_cache)
    compile_s = time.perf_counter() - began
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        began = time.perf_counter()
        state, metrics = compiled(state, batch, None)
        losses.append(float(jax.block_until_ready(metrics["loss"])))
        if i >= args.warmup:
            times.append(time.perf_counter() - began)
    seconds = statistics.median(times)
    model_flops = flops.train_flops_per_step(config, b, length, target_length)
    executed = flops.executed_flops_per_step(config, b, length, target_length, remat)
    bf16 = peak_matmul_flops(8192, chain=1, repeats=10, dtype=jnp.bfloat16)
    measured_peak = bf16["flops_per_s"]
    peak = targets.load(args.target).figures.peak_tflops * 1e12
    return {
        "device": device.device_kind,
        "compile_s": compile_s,
        "autotune_cache": autotune_cache,
        "memory": hlo.memory(compiled).as_dict(),
        "allocator_peak": int((device.memory_stats() or {}).get("peak_bytes_in_use", 0)),
        "step_s": seconds,
        "step_s_range": [min(times), max(times)],
        "tokens_per_s": b * (length + target_length) / seconds,
        "model_tflops_per_step": model_flops / 1e12,
        "mfu": model_flops / seconds / peak,
        "hfu": executed / seconds / peak,
        "bf16_matmul_tflops": measured_peak / 1e12,
        "mfu_of_measured_peak": model_flops / seconds / measured_peak,
        "losses": losses,
    }


def _transformers(args, case: str, device: str = "cuda") -> dict:
    """transformers' PyTorch LongT5 of the same size, batch and precision on this GPU."""
    model, length, b, remat = parse_case(case)
    config = LongT5Config.preset(model, args.attention)
    inputs = torch_inputs(random_batch(b, length, args.target_length, config.vocab_size))
    checkpointing = remat != "none"
    return time_train_steps(config, inputs, checkpointing, args.warmup, args.steps, device)


def _compile(lowered, autotune_cache: Path | None):
    """(the compiled step, what became of `autotune_cache`). Only the autotuner's choices are
    kept there, no kernels (XLA's kernel cache can lose Hopper kernels' TMA metadata,
    openxla/xla#35951). A jaxlib that does not know the option compiles without it."""
    if autotune_cache is None:
        return lowered.compile(), None
    autotune_cache.mkdir(parents=True, exist_ok=True)
    try:
        options = {AUTOTUNE_CACHE_OPTION: str(autotune_cache)}
        return lowered.compile(options), str(autotune_cache)
    except Exception as e:  # noqa: BLE001 - jaxlib's error types vary; only this one is ours
        if AUTOTUNE_CACHE_OPTION not in str(e):
            raise
        return lowered.compile(), f"not kept: {str(e).splitlines()[0]}"


def _child(args, kind: str, case: str) -> dict:
    """Run one case's `kind` in a process of its own; its report comes back on stdout."""
    env = dict(os.environ)
    if kind == "deviceless":
        env.update(targets.DEVICELESS_ENV)
    else:  # the allocator may take what the step needs (jax's default stops at 75%)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    cmd = [sys.executable, "-m", "longt5_jax.bench", "device", "--child", kind, "--cases", case]
    cmd += step_argv(args) + ["--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup)]
    if args.autotune_cache:
        cmd += ["--autotune_cache", str(args.autotune_cache)]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith(_RESULT)]
    if not lines:
        return {"error": f"the {kind} run of {case} exited {done.returncode}"}
    return json.loads(lines[-1][len(_RESULT) :])


def _row(case: str, deviceless: dict, gpu: dict) -> dict:
    row = {"case": case, "deviceless": deviceless, "gpu": gpu}
    if "error" not in deviceless and "error" not in gpu:
        row["memory_ratio"] = gpu["memory"]["total"] / deviceless["memory"]["total"]
        row["allocator_over_compiled"] = gpu["allocator_peak"] / gpu["memory"]["total"]
        row["time_over_roofline"] = gpu["step_s"] / deviceless["roofline_s"]
    return row


def _print(rows: list[dict]) -> None:
    gib = 2**30
    head = (
        f"{'case':24} {'step s':>7} {'tok/s':>8} {'MFU':>6} {'HFU':>6} {'dl GiB':>7} "
        f"{'gpu GiB':>7} {'alloc':>7} {'mem r':>6} {'roof s':>7} {'t/roof':>6} {'vs HF':>6}"
    )
    print(head)
    for r in rows:
        d, g = r["deviceless"], r["gpu"]
        if "error" in g:
            print(f"{r['case']:24} {g['error']}")
            continue
        if "memory_ratio" not in r:  # the GPU's figures alone (and transformers')
            vs = r.get("speedup_over_transformers")
            print(
                f"{r['case']:24} {g['step_s']:7.3f} {g['tokens_per_s']:8.0f} {g['mfu']:6.1%} "
                f"{g['hfu']:6.1%} {'-':>7} {g['memory']['total'] / gib:7.2f} "
                f"{g['allocator_peak'] / gib:7.2f} {'-':>6} {'-':>7} {'-':>6} "
                + (f"{vs:6.2f}" if vs else f"{'-':>6}")
                + f"  ({d.get('error', '')})"
            )
            continue
        print(
            f"{r['case']:24} {g['step_s']:7.3f} {g['tokens_per_s']:8.0f} {g['mfu']:6.1%} "
            f"{g['hfu']:6.1%} {d['memory']['total'] / gib:7.2f} {g['memory']['total'] / gib:7.2f} "
            f"{g['allocator_peak'] / gib:7.2f} {r['memory_ratio']:6.3f} {d['roofline_s']:7.3f} "
            f"{r['time_over_roofline']:6.2f} {r.get('speedup_over_transformers', 0):6.2f}"
        )


def _plot(rows: list[dict], path: Path) -> None:
    rows = [r for r in rows if "memory_ratio" in r]
    if not rows:
        return
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["case"] for r in rows]
    x = range(len(rows))
    for offset, label, values in (
        (-0.27, "deviceless", [r["deviceless"]["memory"]["total"] / 2**30 for r in rows]),
        (0.0, "GPU compile", [r["gpu"]["memory"]["total"] / 2**30 for r in rows]),
        (0.27, "allocator peak", [r["gpu"]["allocator_peak"] / 2**30 for r in rows]),
    ):
        left.bar([i + offset for i in x], values, width=0.27, label=label)
    left.set_ylabel("GiB per device")
    left.set_title("memory")
    left.legend()
    right.bar([i - 0.2 for i in x], [r["gpu"]["step_s"] for r in rows], 0.4, label="measured")
    right.bar([i + 0.2 for i in x], [r["deviceless"]["roofline_s"] for r in rows], 0.4,
              label="deviceless roofline")  # fmt: skip
    right.set_ylabel("seconds per step")
    right.set_title("step time")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    page.check(None if args.child else args.results, "device", argv)
    try:
        for case in args.cases:
            parse_case(case)
        targets.load(args.target)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.child:
        run = {"gpu": _on_gpu, "deviceless": _deviceless, "torch": _transformers}[args.child]
        try:
            with base.launch(args.launch):
                report = run(args, args.cases[0])
        except ValueError as e:  # no GPU here, or no compiler for the target
            report = {"error": str(e)}
        print(_RESULT + json.dumps(report), flush=True)
        return 0
    # This process never starts jax's backend: its GPU stays free for each case's own process.
    rows = []
    for case in args.cases:
        print(f"{case}: on this GPU", file=sys.stderr, flush=True)
        gpu = _child(args, "gpu", case)
        if gpu.get("error") == _NO_GPU:
            raise UsageError(gpu["error"])
        deviceless = {"error": "not compiled (--no-deviceless)"}
        if args.deviceless:
            print(f"{case}: deviceless compile for {args.target}", file=sys.stderr, flush=True)
            deviceless = _child(args, "deviceless", case)
        rows.append(_row(case, deviceless, gpu))
        if args.transformers:
            print(f"{case}: transformers on this GPU", file=sys.stderr, flush=True)
            rows[-1]["transformers"] = torch = _child(args, "torch", case)
            if "step_s" in torch and "step_s" in gpu:
                rows[-1]["speedup_over_transformers"] = torch["step_s"] / gpu["step_s"]
    _print(rows)
    out = Path(args.out_dir)
    config = {k: v for k, v in vars(args).items() if k not in ("out_dir", "child")}
    write_json(out, "device", {"config": config, "rows": rows})
    _plot(rows, out / "device.png")
    where = page.machine(gpu=rows[-1]["gpu"].get("device", "unknown GPU"))
    page.publish(args, "device", argv, page.records(rows, COLUMNS), where=where)
    return 0
