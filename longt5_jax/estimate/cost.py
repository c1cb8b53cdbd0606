"""The cost model of a train step on a target cluster: compute, communication and pipeline bubble.

    compute   = executed FLOPs / (devices x peak x MFU)   (model FLOPs + remat's recompute)
    bubble    = (p - 1) / (r m + p - 1)        (GPipe / circular pipeline idle fraction)
    comm      = sum over collectives of bytes per device / bandwidth of the link they cross
    host      = bytes copied between host memory and the device (offload) / PCIe bandwidth
    step time between max(compute', comm) + host (full overlap) and compute' + comm + host
              (none), compute' = compute / (1 - bubble)

Offload's copies are charged in full: the optimizer state cannot move before the gradients
exist nor the parameters back before the update, so little of them can hide behind compute.

A collective whose groups all sit inside one node is charged at the intra-node bandwidth
(NVLink), any other at the inter-node one (InfiniBand): the ring is as slow as its slowest link.
Where the devices sit is a `hlo.Placement` (the mesh's devices and their nodes).
"""

from __future__ import annotations

import dataclasses

from longt5_jax.estimate.hlo import Collective, Placement
from longt5_jax.estimate.targets import Target


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A GPU cluster; bandwidths are per GPU and direction, in GB/s (1e9 bytes/s)."""

    nodes: int = 8
    gpus_per_node: int = 4
    memory_gib: float = 80.0
    peak_tflops: float = 312.0  # A100 dense bf16
    intra_node_gbps: float = 300.0  # NVLink 3 (A100)
    inter_node_gbps: float = 25.0  # InfiniBand HDR 200 Gb/s, one NIC per GPU
    mfu: float = 0.4  # assumed model-FLOPs utilisation of the compute
    hbm_gbps: float = 2039.0  # A100-80GB HBM2e
    host_gbps: float = 25.0  # PCIe 4 x16

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"cluster {field.name}={getattr(self, field.name)}: expected > 0")
        if self.mfu > 1:
            raise ValueError(f"cluster mfu={self.mfu}: expected a fraction in (0, 1]")

    @classmethod
    def of(
        cls, target: Target, nodes: int, gpus_per_node: int, dtype: str = "", **overrides
    ) -> Cluster:
        """The cluster of `nodes x gpus_per_node` of a target GPU computing in `dtype` (the
        half-precision peak unless float32); None overrides are ignored."""
        f = target.figures
        fields = dict(
            memory_gib=target.memory_gib,
            peak_tflops=f.peak(dtype),
            intra_node_gbps=f.intra_node_gbps,
            inter_node_gbps=f.inter_node_gbps,
            hbm_gbps=target.hbm_gbps,
            host_gbps=f.host_gbps,
        )
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(nodes, gpus_per_node, **fields)

    @classmethod
    def from_args(cls, target: Target, args) -> Cluster:
        """`of` for a command: its --nodes, --gpus_per_node and --dtype, and whichever of the
        cluster's figures it has a flag of the same name for (unset flags keep the target's)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"nodes", "gpus_per_node"}
        given = {name: getattr(args, name) for name in names if hasattr(args, name)}
        dtype = getattr(args, "dtype", "")
        return cls.of(target, args.nodes, args.gpus_per_node, dtype, **given)

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return (
            f"{self.nodes} nodes x {self.gpus_per_node} GPUs, {self.memory_gib:g} GiB, "
            f"{self.peak_tflops:g} TFLOP/s peak at {self.mfu:.0%} MFU, HBM {self.hbm_gbps:g} GB/s, "
            f"{self.intra_node_gbps:g} GB/s in a node, {self.inter_node_gbps:g} GB/s between"
        )


def collective_seconds(op: Collective, placement: Placement, cluster: Cluster) -> float:
    """One collective's time per step at the bandwidth of the slowest link it crosses."""
    link = placement.link(op)
    gbps = cluster.inter_node_gbps if link == "ib" else cluster.intra_node_gbps
    return op.bytes_per_device / (gbps * 1e9)


def comm_seconds(ops: list[Collective], placement: Placement, cluster: Cluster) -> float:
    """Time of a step's collectives, one after another, none hidden."""
    return sum(collective_seconds(op, placement, cluster) for op in ops)


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
    host: float = 0.0  # offload's copies between host memory and the device

    @property
    def busy(self) -> float:
        return self.compute + self.bubble

    @property
    def total(self) -> float:
        """No overlap: the upper bound."""
        return self.busy + self.comm + self.host

    @property
    def overlapped(self) -> float:
        """Full overlap of communication with compute: the lower bound."""
        return max(self.busy, self.comm) + self.host

    @property
    def comm_share(self) -> float:
        """The share of a step spent waiting on communication, none of it hidden."""
        return self.comm / self.total if self.total else 0.0


def step_time(compute: float, comm: float, idle_fraction: float, host: float = 0.0) -> StepTime:
    """Compute, bubble, communication and host-copy seconds of one step."""
    return StepTime(compute, compute * idle_fraction / (1 - idle_fraction), comm, host)


def host_seconds(moved_bytes: float, cluster: Cluster) -> float:
    """Time of `moved_bytes` copied between a GPU and its host (both directions summed)."""
    return moved_bytes / (cluster.host_gbps * 1e9)
