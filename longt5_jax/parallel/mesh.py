"""The device mesh: named axes data x tensor x pipeline, laid over the devices node by node."""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from longt5_jax.parallel.pipeline import Pipeline

AXES = ("data", "tensor", "pipeline")
# What ZeRO-Offload keeps in host memory between steps (parallel/offload.py).
Offload = Literal["none", "optimizer", "optimizer_and_params"]
OFFLOADS: tuple[Offload, ...] = ("none", "optimizer", "optimizer_and_params")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Mesh shape and ZeRO stage; data=-1 takes whatever the other axes leave."""

    data: int = -1
    tensor: int = 1
    pipeline: int = 1
    zero_stage: int = 1  # 0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters sharded
    # Split the [batch, length, embed] activations between sublayers over `tensor` too: for long
    # inputs, where they dominate memory.
    sequence_sharding: bool = False
    # With pipeline > 1: microbatches in flight (0: 2 x pipeline) and circular repeats; the
    # idle fraction is (pipeline - 1) / (repeats x microbatches + pipeline - 1).
    pipeline_microbatches: int = 0
    pipeline_repeats: int = 1
    # ZeRO-Offload: keep the optimizer state ('optimizer'), and the float32 master parameters
    # too ('optimizer_and_params'), in host memory between steps (parallel/offload.py).
    offload: Offload = "none"

    def __post_init__(self):
        if self.offload not in OFFLOADS:
            raise ValueError(f"ParallelConfig.offload={self.offload!r}: expected one of {OFFLOADS}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ParallelConfig.zero_stage={self.zero_stage}: expected 0, 1, 2 or 3")
        for name in ("tensor", "pipeline"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelConfig.{name}={getattr(self, name)}: expected >= 1")
        if self.data == 0 or self.data < -1:
            raise ValueError(f"ParallelConfig.data={self.data}: expected >= 1, or -1 to fill")
        if self.pipeline_repeats < 1 or self.pipeline_microbatches < 0:
            raise ValueError(
                f"ParallelConfig.pipeline_repeats={self.pipeline_repeats}, pipeline_microbatches="
                f"{self.pipeline_microbatches}: expected repeats >= 1 and microbatches >= 0"
            )
        if self.pipeline > 1 and self.pipeline_microbatches % self.pipeline:
            raise ValueError(
                f"ParallelConfig.pipeline_microbatches={self.pipeline_microbatches} is not a "
                f"multiple of the {self.pipeline} pipeline stages: each stage keeps an equal share "
                "of them"
            )

    def pipeline_schedule(self) -> Pipeline | None:
        """The pipeline schedule, or None without a pipeline axis."""
        if self.pipeline == 1:
            return None
        return Pipeline(
            self.pipeline, self.pipeline_microbatches or 2 * self.pipeline, self.pipeline_repeats
        )

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """(data, tensor, pipeline) for `num_devices`, or a one-line error if they do not fit."""
        rest = self.tensor * self.pipeline
        data = num_devices // rest if self.data == -1 else self.data
        if data < 1 or data * rest != num_devices:
            raise ValueError(
                f"mesh data={self.data} x tensor={self.tensor} x pipeline={self.pipeline} "
                f"does not match {num_devices} devices"
            )
        return data, self.tensor, self.pipeline


def compile_only(device: Any) -> bool:
    """Whether `device` is a compile-only device (a deviceless target's), not this process's:
    it compiles programs but holds no memory."""
    try:
        return device not in jax.devices(device.platform)
    except RuntimeError:  # no backend of that platform here
        return True


def devices_per_node(devices: list) -> int:
    """How many of `devices` share a node: a process's devices, times the processes SLURM puts
    on each node (elsewhere a process is a node: one host, or one simulated on fake devices)."""
    first = devices[0].process_index
    per_process = sum(d.process_index == first for d in devices)
    tasks = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "")
    count = re.match(r"\d+", tasks)  # SLURM_TASKS_PER_NODE reads like '4(x8)'
    return min(per_process * (int(count.group()) if count else 1), len(devices))


def node_of(devices: list, per_node: int) -> list[int]:
    """The node of each device: its process where processes hold whole nodes (compile-only GPUs,
    one process per node), else consecutive runs of `per_node` devices in process order."""
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1 and len(devices) // len(processes) == per_node:
        return [d.process_index for d in devices]
    order = sorted(range(len(devices)), key=lambda i: (devices[i].process_index, devices[i].id))
    nodes = [0] * len(devices)
    for rank, i in enumerate(order):
        nodes[i] = rank // per_node
    return nodes


def make_mesh(
    cfg: ParallelConfig, devices: list | None = None, per_node: int | None = None
) -> Mesh:
    """A mesh over `devices` (default all) placed by node: tensor innermost, inside a node (its
    activation all-reduces are the heaviest traffic), then pipeline, data outermost."""
    devices = list(jax.devices() if devices is None else devices)
    data, tensor, pipeline = cfg.shape(len(devices))
    per_node = per_node or devices_per_node(devices)
    nodes = node_of(devices, per_node)
    order = sorted(range(len(devices)), key=lambda i: (nodes[i], i))
    grid = np.asarray([devices[i] for i in order], dtype=object).reshape(data, pipeline, tensor)
    if tensor > 1 and per_node % tensor:
        warnings.warn(
            f"ParallelConfig.tensor={tensor} does not divide the {per_node} devices of a node: "
            "tensor groups cross nodes, and their all-reduces the slow links",
            stacklevel=2,
        )
    return Mesh(grid.transpose(0, 2, 1), AXES, axis_types=(AxisType.Auto,) * 3)


def check_fits(
    cfg: ParallelConfig,
    num_devices: int,
    split: Mapping[str, int],
    batch: tuple[str, int],
    stacks: Mapping[str, int] = MappingProxyType({}),
    accumulation: tuple[str, int] = ("", 1),
) -> None:
    """One-line errors for a mesh that does not divide the devices, the sizes the tensor axis
    `split`s, the `batch` (of which each of `accumulation` microbatches splits over data, and
    pipeline microbatches) or the layer `stacks` the pipeline cuts into stages. Each size comes
    with the name the user set it by ('LongT5Config.num_heads'), which the error says."""
    data, tensor, _ = cfg.shape(num_devices)
    (batch_name, batch_size), (per_name, per) = batch, accumulation
    each = f" x {per_name} ({per})" if per > 1 else ""
    for name, size in split.items():
        if size % tensor:
            raise ValueError(f"{name}={size} is not divisible by the tensor axis ({tensor})")
    if batch_size % (data * per):
        raise ValueError(
            f"{batch_name}={batch_size} is not divisible by the data axis ({data}){each}"
        )
    schedule = cfg.pipeline_schedule()
    if schedule is None:
        return
    for name, layers in stacks.items():
        schedule.check(layers, name)
    if batch_size % (schedule.microbatches * data * per):
        raise ValueError(
            f"{batch_name}={batch_size} is not divisible by pipeline microbatches x data "
            f"({schedule.microbatches} x {data}){each}: each microbatch splits over the data axis"
        )
