"""Where a train step's time goes: one traced step, its XLA ops joined with the compiled HLO.

`jax.profiler` traces one step of our train step after warm-up. XLA:CPU runs independent ops
concurrently on its threads, so each op's wall time is shared among the ops running at the same
instant: the rows then sum to the step's busy time, and the rest of the step is idle (the gaps
between ops). Each op is named by the model path in its HLO metadata (encoder or decoder, the
layer's module) and its kind (a matmul fusion or anything else), and the top ops are listed with
their output shapes, so a slow step points at the tensors that make it slow. On a GPU the
device's own timeline also gives each kernel by name (registers, shared memory, occupancy) and
the step's time by kind, as `bench roofline` sorts the compiled program's kernels: the Pallas
attention kernels, the matmuls, the rest.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

import jax

from longt5_jax import cli
from longt5_jax.bench import train_steps as ts
from longt5_jax.bench.device import add_launch_argument, launch_text
from longt5_jax.bench.report import write_json
from longt5_jax.errors import RunFault
from longt5_jax.estimate import hlo_module, roofline
from longt5_jax.kernels import launch as base
from longt5_jax.model import LongT5Config
from longt5_jax.model.config import REMAT_POLICIES

_MATMUL_NAMES = ("dot", "ynn_fusion", "xnn_fusion", "onednn")
# A GPU's matmul kernels by name: cuBLAS's (nvjet on Hopper, the xmma, cutlass and sm80 kernels
# before it), cuDNN's, and XLA's Triton GEMM fusions (`gemm_fusion_dot_12`).
_GPU_MATMUL = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|cudnn|s16816|s1688", re.IGNORECASE)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(prog="python -m longt5_jax.bench profile", description=__doc__)
    p.add_argument("--preset", default="small")
    p.add_argument("--attention", default="transient-global", choices=["local", "transient-global"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention_kernel", default="xla", choices=["xla", "pallas"])
    p.add_argument("--remat", default="none", choices=REMAT_POLICIES)
    p.add_argument("--input_length", type=cli.positive, default=4096)
    p.add_argument("--target_length", type=cli.positive, default=256)
    p.add_argument("--batch_size", type=cli.positive, default=1)
    p.add_argument("--top", type=cli.positive, default=20, help="ops listed one by one")
    add_launch_argument(p)
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    return p.parse_args(argv)


def hlo_ops(hlo_text: str) -> dict[str, dict]:
    """Instruction name -> output shape, model path (HLO metadata) and whether it is a matmul."""
    found = list(hlo_module.instructions(hlo_text))
    opcodes = collections.defaultdict(set)
    for computation, _, instr in found:
        opcodes[computation].add(instr.opcode)
    ops = {}
    for _, _, instr in found:
        named = re.search(r'op_name="([^"]*)"', instr.attrs)
        calls = re.search(r"calls=%([\w.\-]+)", instr.attrs)
        fused_dot = calls is not None and "dot" in opcodes[calls.group(1)]
        matmul = instr.opcode == "dot" or instr.name.startswith(_MATMUL_NAMES) or fused_dot
        path = named.group(1) if named else ""
        ops[instr.name] = {"shape": instr.type, "path": path, "matmul": matmul}
    return ops


def wall_shares(events: list[dict]) -> tuple[dict[int, float], float, float]:
    """Each event's share of wall time (split evenly among concurrent events), idle and span.

    `events` are complete trace events (ts, dur in microseconds); returns shares by index.
    """
    points = sorted(
        [(e["ts"], 1, i) for i, e in enumerate(events)]
        + [(e["ts"] + e["dur"], -1, i) for i, e in enumerate(events)]
    )
    share: dict[int, float] = collections.defaultdict(float)
    active: set[int] = set()
    idle, last = 0.0, None
    for t, kind, i in points:
        if last is not None:
            if active:
                for a in active:
                    share[a] += (t - last) / len(active)
            else:
                idle += t - last
        last = t
        (active.add if kind == 1 else active.discard)(i)
    span = points[-1][0] - points[0][0] if points else 0.0
    return dict(share), idle, span


def device_kernels(trace: dict, runs: int = 1) -> list[dict]:
    """The kernels the GPU ran in `trace`, by name (a Pallas kernel's without its declared FLOPs):
    milliseconds and launches per run, most time first. Needs no HLO: it reads the device's own
    timeline, which also holds the Triton kernels that the HLO join misses."""
    devices = {
        e["pid"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
        and "/device:" in str((e.get("args") or {}).get("name", ""))
    }  # fmt: skip
    ms: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.Counter()
    launch: dict[str, dict] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e:
            name = re.sub(r"_flops_\d+$", "", e["name"])
            ms[name] += e["dur"] / 1e3 / runs
            calls[name] += 1
            launch.setdefault(name, _launch_details(e.get("args") or {}))
    rows = sorted(ms.items(), key=lambda kv: -kv[1])
    return [
        {"kernel": n, "kind": kind_of(n), "ms": v, "calls": calls[n] / runs, **launch[n]}
        for n, v in rows
    ]


def kind_of(kernel: str) -> str:
    """Which of `estimate.roofline.KINDS_OF_KERNEL` a kernel on the GPU's timeline is, by its name
    (its declared FLOPs dropped), as the roofline sorts the compiled program's: ours (a name of
    `kernels.launch.KERNELS`), a matmul (cuBLAS's, cuDNN's or XLA's Triton GEMM), or the rest."""
    if kernel in base.KERNELS:
        return "pallas"
    return "matmul" if _GPU_MATMUL.search(kernel) else "other"


def by_kind(rows: list[dict]) -> dict[str, float]:
    """Milliseconds per run of `device_kernels` rows, summed by kind (all kinds, in order)."""
    return {k: sum(r["ms"] for r in rows if r["kind"] == k) for k in roofline.KINDS_OF_KERNEL}


def _launch_details(args: dict) -> dict:
    """Registers per thread, shared memory per block (bytes) and theoretical occupancy (%) of a
    kernel event, from CUPTI's `kernel_details` ('regs:209 ... dynamic_shared:139776 ...')."""
    found = dict(re.findall(r"(\w+):([\d.]+)", args.get("kernel_details", "")))
    if not found:
        return {}
    shared = int(found.get("static_shared", 0)) + int(found.get("dynamic_shared", 0))
    return {"regs": int(found["regs"]), "shared": shared, "occupancy": float(found["occ_pct"])}


def read_trace(trace_dir: Path) -> dict:
    """The newest trace `jax.profiler.trace(trace_dir)` wrote."""
    traces = sorted(Path(trace_dir).glob("plugins/profile/*/*.trace.json.gz"))
    if not traces:
        raise RunFault(f"the profiler wrote no trace under {trace_dir}")
    with gzip.open(traces[-1]) as f:
        return json.load(f)


def group_of(path: str, matmul: bool) -> str:
    """'encoder attention matmul'-style row name from an op's model path."""
    stack = "encoder" if "encode" in path else "decoder" if "decode" in path else "outside stacks"
    # A layer's ops sit under its module: `.../EncoderLayer/attention/...` inside the scanned
    # stack's body (`layers/attention` where the stack is unrolled).
    module = re.search(r"(?:layers|Layer)/([a-z_]+)", path)
    # Ops without metadata: the optimizer update, scan residual buffers, split reductions.
    where = module.group(1) if module else ("no model path" if not path else "")
    return " ".join(x for x in (stack, where, "matmul" if matmul else "other") if x)


def breakdown(trace: dict, hlo_text: str, top: int) -> dict:
    """Rows by model part and the `top` single ops, in milliseconds of wall time."""
    ops = hlo_ops(hlo_text)
    # XLA ops only (not the host-side frames and runtime regions around them). On a GPU an op
    # runs as kernels named by the kernel, the op in their `hlo_op` argument.
    events = []
    for e in trace["traceEvents"]:
        name = (e.get("args") or {}).get("hlo_op", e.get("name"))
        if e.get("ph") == "X" and name in ops:
            events.append({**e, "name": name})
    share, idle, span = wall_shares(events)
    by_group: dict[str, float] = collections.defaultdict(float)
    by_op: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.Counter(e["name"] for e in events)
    for i, s in share.items():
        op = ops[events[i]["name"]]
        by_group[group_of(op["path"], op["matmul"])] += s
        by_op[events[i]["name"]] += s
    rows = sorted(by_group.items(), key=lambda kv: -kv[1])
    top_ops = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    return {
        "span_ms": span / 1e3,
        "idle_ms": idle / 1e3,
        "groups": [{"group": g, "ms": v / 1e3} for g, v in rows],
        "top_ops": [
            {
                "op": n,
                "ms": v / 1e3,
                "calls": calls[n],
                "shape": ops[n]["shape"],
                "matmul": ops[n]["matmul"],
                "path": ops[n]["path"],
            }
            for n, v in top_ops
        ],
    }


def print_kernels(rows: list[dict], top: int) -> None:
    print(f"{'ms':>9} {'launches':>8} {'regs':>4} {'smem KiB':>8} {'occ %':>5}  kernel")
    for r in rows[:top]:
        launch = (
            f"{r['regs']:>4} {r['shared'] / 1024:>8.0f} {r['occupancy']:>5.1f}"
            if "regs" in r
            else f"{'':>4} {'':>8} {'':>5}"
        )
        print(f"{r['ms']:>9.3f} {r['calls']:>8.0f} {launch}  {r['kernel'][:90]}")


def _print(report: dict) -> None:
    b = report["breakdown"]
    busy = b["span_ms"] - b["idle_ms"]
    print(
        f"step {report['step_s']:.2f} s untraced; traced span {b['span_ms']:.0f} ms, "
        f"busy {busy:.0f} ms, idle {b['idle_ms']:.0f} ms"
    )
    print(f"{'ms':>9} {'share':>6}  part")
    for r in b["groups"]:
        print(f"{r['ms']:>9.1f} {r['ms'] / b['span_ms']:>6.1%}  {r['group']}")
    print(f"\n{'ms':>9} {'calls':>5}  {'op':<30} {'shape':<34} path")
    for r in b["top_ops"]:
        print(f"{r['ms']:>9.1f} {r['calls']:>5}  {r['op']:<30} {r['shape']:<34} {r['path'][-70:]}")
    print("\nkernels on the device's timeline:")
    print_kernels(report["kernels"], len(report["kernels"]))
    if report["kinds"]:
        print("by kind (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in report["kinds"].items()))


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parse(argv)
    config = LongT5Config.preset(
        args.preset,
        args.attention,
        dtype=args.dtype,
        remat=args.remat,
        attention_kernel=args.attention_kernel,
    )
    batch = ts.features(config, args.batch_size, args.input_length, args.target_length)
    with base.launch(args.launch):  # read when the step is traced and compiled
        step = ts.OursStep(config, batch)
    step()  # warm-up
    seconds = step()
    out = Path(args.out_dir)
    trace_dir = out / "profile_trace"
    with jax.profiler.trace(str(trace_dir)):
        step()
    trace = read_trace(trace_dir)
    hlo_text = step.compiled.as_text()
    assert hlo_text is not None  # XLA's CPU and GPU executables both have their text
    report = {
        "device": str(jax.devices()[0]),
        "config": {
            **{k: v for k, v in vars(args).items() if k != "out_dir"},
            "launch": launch_text(args.launch),
        },
        "step_s": seconds,
        "breakdown": breakdown(trace, hlo_text, args.top),
    }
    kernels = device_kernels(trace)
    # As `bench roofline` sorts the compiled step (whose `--goal_mfu` arithmetic these measure);
    # a CPU's timeline has no kernels.
    report["kinds"] = by_kind(kernels) if kernels else {}
    report["kernels"] = kernels[: args.top]
    _print(report)
    write_json(out, "profile", report)
    # The program the trace ran, so the breakdown can be redone or read further.
    (out / "profile_hlo.txt").write_text(hlo_text)
    print(f"wrote {out / 'profile.json'} (trace under {trace_dir})")
    return 0
