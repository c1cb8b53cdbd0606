"""The fused attention kernels' machine code, read deviceless: what each kernel issues.

Each case (`bench kernels`' MODEL:tglobal|local|decoder:LENGTH:BATCH:padded|packed) is one
attention layer's forward and backward compiled for `--target` (an H100 by default) on this
machine, without a GPU; every Triton kernel's PTX goes through ptxas (registers, spills) and
its machine code through nvdisasm. Per kernel: registers, spilled bytes, instructions, the
launch (threads a program, shared memory, from XLA's thunk sequence) and what it leaves of the
target's SMs (programs an SM holds: `occupancy`), and the instructions of each loop body by
class. A loop body is what a program issues per tile of keys
(or of queries, in the side and bias gradients): against the tensor-core instructions in it,
the rest says whether a kernel is issue-bound (on an H100 four warp schedulers issue one
instruction a cycle each; a 64x64x16 bf16 HGMMA keeps a quarter of the SM's tensor cores busy
for 32 cycles).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from longt5_jax import cli, kernel_checks
from longt5_jax.bench import kernels
from longt5_jax.bench.device import add_launch_argument, launch_text
from longt5_jax.bench.report import write_json
from longt5_jax.errors import UsageError
from longt5_jax.estimate import compile_ahead, targets
from longt5_jax.parallel import xla_options

CLASSES = (  # (class, opcode prefixes), first match wins
    ("tensor", ("HGMMA", "HMMA")),
    ("exp", ("MUFU",)),
    ("float", ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "F2F", "FCHK")),
    ("memory", ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDGSTS", "LDC", "RED", "ATOM")),
    ("local", ("LDL", "STL")),  # spilled registers
    ("sync", ("BAR", "WARPGROUP", "DEPBAR", "MEMBAR", "FENCE", "LDGDEPBAR", "SYNCS")),
    ("uniform", ("U",)),
)


def tool(name: str) -> str:
    """The path of a CUDA tool: ptxas of the gpu extra's CUDA 12 compiler wheel (the one XLA
    compiles with), else from PATH; nvdisasm from PATH."""
    wheel = []
    if name == "ptxas":
        try:
            spec = importlib.util.find_spec("nvidia.cuda_nvcc")
        except ModuleNotFoundError:  # no nvidia package at all
            spec = None
        roots = (spec.submodule_search_locations or []) if spec else []
        wheel = [str(Path(root) / "bin" / name) for root in roots]
    found = [path for path in wheel if Path(path).exists()] or [shutil.which(name) or ""]
    if not found[0]:
        raise UsageError(
            f"{name}: not found. nvdisasm: pip install --target DIR nvidia-cuda-nvdisasm==13.5.37 "
            "and put DIR/nvidia/cu13/bin on PATH (not into jax's environment: jax 0.10 would take "
            "that CUDA 13 directory for its own)"
        )
    return found[0]


def classify(opcode: str) -> str:
    return next((c for c, prefixes in CLASSES if opcode.startswith(prefixes)), "other")


def read_sass(text: str) -> dict:
    """{instructions, by_class, loops: [{instructions, by_class, opcodes}]} of one kernel's
    nvdisasm listing; a loop is the code between a backward branch and its target."""
    code, labels, pending = [], {}, []
    for line in text.splitlines():
        line = line.strip()
        if m := re.match(r"(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            address, instruction = int(m.group(1), 16), m.group(2)
            if instruction.startswith("@"):
                instruction = instruction.split(None, 1)[1]
            code.append((address, instruction.split()[0], instruction))
            labels.update(dict.fromkeys(pending, address))
            pending = []
    loops = []
    for address, opcode, instruction in code:
        target = re.search(r"(\.L_x_\d+)", instruction) if opcode.startswith("BRA") else None
        if target and labels.get(target.group(1), address) < address:
            body = [op for a, op, _ in code if labels[target.group(1)] <= a <= address]
            loops.append(_counts(body))
    return {**_counts([op for _, op, _ in code]), "loops": loops}


def _counts(opcodes: list[str]) -> dict:
    by_class = collections.Counter(classify(op) for op in opcodes)
    top = collections.Counter(op.split(".")[0] for op in opcodes).most_common(8)
    return {"instructions": len(opcodes), "by_class": dict(by_class), "opcodes": dict(top)}


def read_ptx(path: Path, arch: str, workdir: Path) -> dict:
    """One kernel's ptxas and nvdisasm reading."""
    cubin = workdir / (path.stem + ".cubin")
    run = subprocess.run(
        [tool("ptxas"), "-v", f"-arch={arch}", str(path), "-o", str(cubin)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    info = run.stderr
    registers = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    sass = subprocess.run(
        [tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(spills.group(1)) if spills else 0,
        **read_sass(sass),
    }


# A kernel's launch in XLA's thunk sequence: its name (with the FLOPs it declares), grid,
# threads and shared memory.
_THUNK = re.compile(
    r"(\w+?)_flops_(\d+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), \d+, \d+\]\s+"
    r"shared_memory: (\d+) bytes"
)


def read_launches(text: str) -> dict[tuple[str, int], dict]:
    """{(kernel, declared FLOPs): {programs, threads, shared_bytes}} of a thunk sequence."""
    launches = {}
    for m in _THUNK.finditer(text):
        x, y, z, threads, shared = (int(g) for g in m.groups()[2:])
        launches[(m.group(1), int(m.group(2)))] = {
            "programs": x * y * z, "threads": threads, "shared_bytes": shared
        }  # fmt: skip
    return launches


def occupancy(reading: dict, spec: str) -> dict:
    """Programs of this kernel an SM of the target (GpuTargetConfig text) holds at once, what
    limits them, the share of the SM's warps they are, and the waves of the whole grid. As
    CUDA allocates: registers a warp in units of 256 (8 a thread), shared memory with 1 KiB a
    program kept by the driver, at most 32 programs an SM."""

    def field(name):
        return int(re.search(rf"{name}:\s*(\d+)", spec).group(1))

    warps = reading["threads"] // 32
    warp_registers = -(-reading["registers"] * 32 // 256) * 256
    limits = {
        "registers": field("registers_per_core_limit") // warp_registers // warps,
        "shared memory": field("shared_memory_per_core") // (reading["shared_bytes"] + 1024),
        "threads": field("threads_per_core_limit") // reading["threads"],
        "programs": 32,
    }
    held = min(limits.values())
    sms = field("core_count")
    return {
        "programs_per_sm": held,
        "limited_by": min(limits, key=lambda k: limits[k]),
        "occupancy": held * warps * 32 / field("threads_per_core_limit"),
        "waves": reading["programs"] / max(held * sms, 1),
    }


def _attention_ptx(dump: Path) -> list[tuple[str, int, Path]]:
    """(kernel name, declared FLOPs, PTX file) of each attention kernel in an XLA dump."""
    found = []
    for path in dump.glob("*.ptx"):
        entry = re.search(r"\.entry\s+(\w+?)(?:_flops_(\d+))?\(", path.read_text())
        if entry and "attention" in entry.group(1):
            found.append((entry.group(1), int(entry.group(2) or 0), path))
    return found


def compiled_kernels(case: str, target: str, dtype: str, launch: tuple = ()) -> dict[str, dict]:
    """{kernel name: reading} of the case's layer forward and backward compiled for `target`
    with the kernels' `launch` settings (`kernels.launch.launch`)."""
    xla, (params, inputs, cotangent) = kernel_checks.case_problem(case)
    pallas = dataclasses.replace(xla, attention_kernel="pallas")
    config, kind, inputs = kernel_checks.in_dtype(pallas, inputs, dtype)
    spec = targets.load(target)
    # sm_90a: Hopper's warpgroup matmuls (Triton's, on an H100) are in the "a" variant only.
    arch = "sm_" + spec.compute_capability.replace(".", "")
    arch += "a" if arch == "sm_90" else ""
    with tempfile.TemporaryDirectory() as tmp:
        grad = kernel_checks.layer_loss_grad(config, kind, launch)
        args = (params, inputs, cotangent, inputs["x"])
        for every_emitter in (False, True):  # the second where XLA wrote no kernel's PTX
            # Users' matmul precision (the tests ask for "highest").
            with jax.default_matmul_precision("default"):
                options = xla_options.dump_options(tmp, every_emitter)
                compile_ahead.compile_on_one(grad, args, spec, options)
            kernels_ptx = _attention_ptx(Path(tmp))
            if kernels_ptx:
                break
        launches = {}
        for path in Path(tmp).glob("*.thunk_sequence.txt"):
            launches.update(read_launches(path.read_text()))
        readings = {}
        # The decoder's self- and cross-attention kernels share names: "#2" is the one of more
        # FLOPs, the cross-attention over the encoder's tokens.
        for name, flops, path in sorted(kernels_ptx, key=lambda x: x[:2]):
            key = name + "#2" * (name in readings)
            readings[key] = {
                **read_ptx(path, arch, Path(tmp)), **launches[(name, flops)], "flops": flops
            }  # fmt: skip
            readings[key].update(occupancy(readings[key], spec.spec))
    return readings


def _print(case: str, readings: dict, before: dict | None) -> None:
    print(f"{case}: registers, spilled bytes, instructions, threads, shared KiB, programs an "
          "SM (limited by), occupancy, waves; per loop body: instructions "
          "(tensor / exp / float / memory / local / other)")  # fmt: skip
    for name, r in readings.items():
        old = (before or {}).get(name, {})
        line = f"  {name:32s} {r['registers']:>4} {r['spill_bytes']:>5} {r['instructions']:>6}"
        line += f" {r['threads']:>4} {r['shared_bytes'] / 1024:6.1f} {r['programs_per_sm']:>3}"
        line += f" ({r['limited_by']}) {r['occupancy']:6.1%} {r['waves']:6.1f}"
        if old:
            line += f"  (before {old['registers']} / {old['spill_bytes']} / {old['instructions']}"
            line += f" / {old.get('programs_per_sm', '?')} an SM)"
        print(line)
        for i, loop in enumerate(r["loops"]):
            c = [loop["by_class"].get(k, 0) for k in ("tensor", "exp", "float", "memory", "local")]
            parts = " / ".join(str(n) for n in [*c, loop["instructions"] - sum(c)])
            was = old["loops"][i]["instructions"] if i < len(old.get("loops", [])) else None
            print(f"      loop {i}: {loop['instructions']:>5} ({parts})"
                  + (f"  before {was}" if was is not None else ""))  # fmt: skip


def _load(path: Path) -> dict:
    """An earlier report of this command: its readings by case."""
    try:
        return dict(json.loads(path.read_text())["cases"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UsageError(f"--compare {path}: not a report of bench sass ({e})") from None


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    p = cli.ArgumentParser(
        prog="python -m longt5_jax.bench sass", description=__doc__.splitlines()[0]
    )
    p.add_argument("--cases", nargs="+", default=kernels.CASES[:1], help=kernels.CASES[0])
    p.add_argument("--target", default="h100-80gb", help="a100-80gb or h100-80gb")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add_launch_argument(p)
    p.add_argument("--compare", type=Path, metavar="BEFORE.json", help="an earlier report")
    p.add_argument("--out_dir", type=cli.out_dir, default="bench_out")
    args = p.parse_args(argv)
    for case in args.cases:
        kernel_checks.parse_case(case)
    before = _load(args.compare) if args.compare else {}
    tool("ptxas"), tool("nvdisasm")
    targets.prepare_environment()
    cases = {}
    for case in args.cases:
        cases[case] = compiled_kernels(case, args.target, args.dtype, args.launch)
        _print(case, cases[case], before.get(case))
    config = {**vars(args), "launch": launch_text(args.launch)}
    write_json(args.out_dir, "sass", {"config": config, "cases": cases})
    return 0
