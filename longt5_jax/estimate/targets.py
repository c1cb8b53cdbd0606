"""Compile targets: the GPUs a step can be compiled for without having them, and their figures.

`--target NAME` (a100-80gb, h100-80gb, h200-141gb, v100-32gb: the files in `gpu_specs/`) compiles
with XLA's real GPU compiler, deviceless: the `gpu` extra's CUDA plugin builds compile-only devices
for a `nodes x gpus_per_node` topology from the device description in `gpu_specs/NAME.txtpb` (XLA's
GpuTargetConfig text format; a user's own file of that format works too, e.g. one of XLA's
`tools/hlo_opt/gpu_specs`). The compile-only devices carry their node as `process_index`. `--target
cpu` compiles for fake CPU devices, the CPU compiler's program, with the A100's figures for the cost
model.

The figures the cost model needs beyond what XLA is told (dense half-precision peak, link
bandwidths per GPU and direction) come from the table below, chosen by compute capability; flags
override them. Half precision is the target's too: bfloat16, float16 on a GPU without bfloat16
(the rule of `parallel/devices.py`, which real runs check), so the commands that compile for a
target default `--dtype` to it and refuse bfloat16 where it has none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
from pathlib import Path

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh

from longt5_jax.parallel.devices import cpu_devices, half_precision

SPECS = Path(__file__).parent / "gpu_specs"
# The CUDA plugin checks the driver when jax starts unless told not to; deviceless there is no
# driver, and the check's traceback would precede every run. The CPU stays the default backend.
DEVICELESS_ENV = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "JAX_PLATFORMS": "cpu"}


@dataclasses.dataclass(frozen=True)
class Figures:
    """Per-GPU performance figures (bandwidths in GB/s = 1e9 bytes/s, one direction)."""

    peak_tflops: float  # dense half-precision (bf16, or fp16 where the GPU has no bf16) peak
    intra_node_gbps: float  # NVLink
    inter_node_gbps: float  # the GPU's InfiniBand NIC
    host_gbps: float  # PCIe to host memory
    float32_tflops: float  # dense float32 matmul peak: TF32 tensor cores, a V100's CUDA cores

    def peak(self, dtype: str) -> float:
        """The dense matmul peak of a step computing in `dtype`."""
        return self.float32_tflops if dtype == "float32" else self.peak_tflops


# By CUDA compute capability major version, from NVIDIA's data sheets. V100 SXM2: 125 TFLOP/s
# fp16 tensor core, 15.7 float32 (no TF32), NVLink 2 (300 GB/s both ways), one EDR 100 Gb/s
# NIC per GPU, PCIe 3 x16. A100: 312 TFLOP/s bf16, 156 TF32, NVLink 3 (600 GB/s both ways), one
# HDR 200 Gb/s NIC per GPU, PCIe 4 x16. H100 SXM: 989 TFLOP/s bf16, 494.5 TF32, NVLink 4 (900
# GB/s both ways), NDR 400 Gb/s, PCIe 5 x16; an H200 is an H100 with more and faster HBM (its
# gpu_specs file). (Dense: the sheets' sparse figures halved.)
_FIGURES = {
    7: Figures(125.0, 150.0, 12.5, 12.5, 15.7),
    8: Figures(312.0, 300.0, 25.0, 25.0, 156.0),
    9: Figures(989.0, 450.0, 50.0, 50.0, 494.5),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """What a step is compiled for: a GPU description (empty for CPU) and its figures."""

    name: str
    spec: str  # GpuTargetConfig text; "" compiles for fake CPU devices
    memory_gib: float
    hbm_gbps: float
    figures: Figures
    compute_capability: str = ""  # "7.0"; "" for CPU
    description: str = ""  # the GPU's name, as its driver says it

    @property
    def is_gpu(self) -> bool:
        return bool(self.spec)

    @property
    def half_dtype(self) -> str:
        """The half-precision dtype of training here: bfloat16, float16 on a GPU without it."""
        return half_precision(self.compute_capability)

    def dtype(self, requested: str | None) -> str:
        """A command's compute dtype: `requested` (its --dtype), by default the half dtype; a
        one-line ValueError for bfloat16 on a GPU without it."""
        if requested is None:
            return self.half_dtype
        if requested == "bfloat16" and self.half_dtype != "bfloat16":
            raise ValueError(
                f"--dtype bfloat16: {self.description} (compute capability "
                f"{self.compute_capability}) has no bfloat16; use --dtype {self.half_dtype}"
            )
        return requested


def _field(spec: str, name: str, source: str) -> float:
    m = re.search(rf"\b{name}:\s*([\d.eE+]+)", spec)
    if m is None:
        raise ValueError(f"{source}: no {name} field; expected an XLA GpuTargetConfig text proto")
    return float(m.group(1))


def names() -> list[str]:
    """The targets shipped in `gpu_specs/`, by name."""
    return sorted(p.stem for p in SPECS.glob("*.txtpb"))


def _either(items: list) -> str:
    """'a, b or c'."""
    items = [str(i) for i in items]
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else "".join(items)


def load(name: str) -> Target:
    """One of `names()`, `cpu`, or the path of a GpuTargetConfig text file."""
    if name == "cpu":
        a100 = load("a100-80gb")
        return dataclasses.replace(a100, name="cpu", spec="", compute_capability="", description="")
    path = SPECS / f"{name}.txtpb"
    if not path.is_file():
        path = Path(name)
        if not path.is_file():
            raise ValueError(
                f"--target {name!r}: expected cpu, one of {names()}, or a GpuTargetConfig file"
            )
    spec = path.read_text()
    # major before minor, as XLA writes it; a minor left out is 0 (a proto default).
    m = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)(?:\s+minor:\s*(\d+))?", spec)
    if m is None:
        raise ValueError(f"{path}: no cuda_compute_capability; expected a GpuTargetConfig file")
    major = int(m.group(1))
    if major not in _FIGURES:
        known = _either(sorted(_FIGURES))
        raise ValueError(f"{path}: compute capability {major}.x has no figures here ({known})")
    described = re.search(r'device_description_str:\s*"([^"]*)"', spec)
    return Target(
        name=path.stem,
        spec=spec,
        memory_gib=_field(spec, "device_memory_size", str(path)) / 2**30,
        hbm_gbps=_field(spec, "memory_bandwidth", str(path)) / 1e9,
        figures=_FIGURES[major],
        compute_capability=f"{major}.{m.group(2) or 0}",
        description=described.group(1) if described else path.stem,
    )


def have_gpu_compiler() -> bool:
    """Whether jax's CUDA plugin is installed (the `gpu` extra's CUDA 12 one, or CUDA 13's)."""
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))


GPU_EXTRA_MISSING = (
    "compiling for a GPU target needs the gpu extra (pip install -e '.[gpu]', no GPU needed); "
    "--target cpu compiles for fake CPU devices instead"
)


def prepare_environment() -> None:
    """Set the deviceless variables; call before jax's backend starts."""
    for key, value in DEVICELESS_ENV.items():
        os.environ.setdefault(key, value)
    # jax read JAX_PLATFORMS when it was imported. (Its Config sets its options as attributes
    # at run time; its type declares none.)
    if not jax.config.jax_platforms:  # type: ignore[attr-defined]
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


def names_help(cpu: bool = False) -> str:
    """What --target takes, for a help line: 'a100-80gb, h100-80gb, ..., cpu or a file'."""
    return _either([*names(), *(["cpu"] if cpu else []), "a file"])


def open_target(name: str, nodes: int, gpus_per_node: int) -> tuple[Target, list]:
    """The target `name` and its devices to compile for, the environment set first (before jax
    starts); a one-line ValueError for an unknown target or a GPU one without the gpu extra."""
    target = load(name)
    if target.is_gpu and not have_gpu_compiler():
        raise ValueError(GPU_EXTRA_MISSING)
    prepare_environment()
    return target, devices(target, nodes, gpus_per_node)


def devices(target: Target, nodes: int, gpus_per_node: int) -> list:
    """`nodes x gpus_per_node` devices to compile for: compile-only GPUs (node = process_index),
    or this process's CPU devices (node = position // gpus_per_node) when there are that many."""
    count = nodes * gpus_per_node
    if not target.is_gpu:
        cpu_devices(count)
        found = jax.devices("cpu")
        if len(found) != count:
            raise RuntimeError(f"{count} CPU devices are needed, this process has {len(found)}")
        return found
    if not have_gpu_compiler():
        raise ValueError(GPU_EXTRA_MISSING)
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=target.spec, topology=f"{nodes}x1x{gpus_per_node}"
    )
    return list(topology.devices)


def tracing_for(devices: list) -> contextlib.AbstractContextManager:
    """Trace a program for `devices` (`devices()`'s) inside this. From jax 0.12, Pallas' Triton
    lowering takes the GPU it compiles for from the mesh in force, no longer from the process'
    devices (a compile-only process has none): a kernel traced outside any mesh fails to lower
    ("No supported GPU devices found"). The train step traces in its own mesh already."""
    return jax.set_mesh(Mesh(np.asarray(devices), ("devices",)))
