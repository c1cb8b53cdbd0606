"""The cost model of a train step on a target cluster: compute, communication and pipeline bubble.

    step time = compute / (1 - bubble) + communication
    compute   = executed FLOPs / (devices x peak x MFU)   (model FLOPs + remat's recompute)
    bubble    = (p - 1) / (r m + p - 1)        (GPipe / circular pipeline idle fraction)
    comm      = sum over collectives of bytes per device / bandwidth

A collective whose groups all sit inside one node is charged at the intra-node bandwidth
(NVLink), any other at the inter-node one (InfiniBand): the ring is as slow as its slowest link.
Device d of the mesh (row-major data x tensor x pipeline, as `make_mesh` lays them out) sits on
node d // gpus_per_node, so tensor groups are neighbours and fill a node first. Communication is
not overlapped with compute: an upper bound, as XLA's latency-hiding scheduler hides part of it.
"""

from __future__ import annotations

import dataclasses

from longt5_jax.parallel.compiled import Collective


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A GPU cluster; bandwidths are per GPU, in GB/s (1e9 bytes/s)."""

    nodes: int = 8
    gpus_per_node: int = 4
    memory_gib: float = 80.0
    peak_tflops: float = 312.0  # A100 dense bf16
    intra_node_gbps: float = 300.0  # NVLink 3 (A100), one direction
    inter_node_gbps: float = 25.0  # InfiniBand HDR 200 Gb/s, one NIC per GPU
    mfu: float = 0.4  # assumed model-FLOPs utilisation of the compute

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"cluster {field.name}={getattr(self, field.name)}: expected > 0")
        if self.mfu > 1:
            raise ValueError(f"cluster mfu={self.mfu}: expected a fraction in (0, 1]")

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return (
            f"{self.nodes} nodes x {self.gpus_per_node} GPUs, {self.memory_gib:g} GiB, "
            f"{self.peak_tflops:g} TFLOP/s peak at {self.mfu:.0%} MFU, "
            f"{self.intra_node_gbps:g} GB/s in a node, {self.inter_node_gbps:g} GB/s between"
        )


def comm_seconds(ops: list[Collective], cluster: Cluster) -> float:
    """Time of a step's collectives, each at the bandwidth of the slowest link its groups use."""
    total = 0.0
    for op in ops:
        spans = op.spans(cluster.gpus_per_node)
        gbps = cluster.inter_node_gbps if spans else cluster.intra_node_gbps
        total += op.bytes_per_device / (gbps * 1e9)
    return total


def compute_seconds(flops: float, devices: int, cluster: Cluster) -> float:
    """Time of `flops` spread evenly over `devices` at the assumed utilisation."""
    return flops / (devices * cluster.peak_tflops * 1e12 * cluster.mfu)


def bubble(stages: int, microbatches: int, repeats: int) -> float:
    """Pipeline idle fraction (p - 1) / (r m + p - 1); 0 without a pipeline."""
    if stages <= 1:
        return 0.0
    return (stages - 1) / (repeats * microbatches + stages - 1)


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float  # seconds idle in the pipeline's fill and drain
    comm: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.comm

    @property
    def comm_share(self) -> float:
        return self.comm / (self.comm + self.compute) if self.comm + self.compute else 0.0


def step_time(compute: float, comm: float, idle_fraction: float) -> StepTime:
    """Compute, bubble and communication seconds of one step."""
    return StepTime(compute, compute * idle_fraction / (1 - idle_fraction), comm)
