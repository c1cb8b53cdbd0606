"""Candidate parallel configurations for a cluster, pruned and pre-ranked analytically.

The planner (`plan.py`) compiles only a few configurations; this module chooses which. A
candidate is a mesh (data x tensor x pipeline), a ZeRO stage, pipeline microbatches and
repeats, a remat policy and a global batch. Candidates that do not divide (heads, MLP width,
vocabulary over tensor; layers over pipeline stages x repeats; the batch over data x
microbatches) are never made. Each remaining one gets an analytic per-device memory estimate
(exact sharded state from the parameters' logical axes, plus an activation model) and analytic
collective bytes, which feed the same cost model (`cost.py`) the compiled numbers later do.
Activations follow `memory_model.py`, calibrated on the compiled GPU program.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from longt5_jax import flops
from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.model.config import REMAT_POLICIES
from longt5_jax.parallel.mesh import MeshConfig
from longt5_jax.parallel.rules import rules
from longt5_jax.plan import cost, memory_model
from longt5_jax.plan.hlo import ring_bytes, zero_volumes


@dataclasses.dataclass(frozen=True)
class Candidate:
    data: int
    tensor: int
    pipeline: int
    zero_stage: int
    microbatches: int  # pipeline microbatches (0 without a pipeline)
    repeats: int
    remat: str
    batch_size: int

    def mesh(self) -> MeshConfig:
        return MeshConfig(
            self.data,
            self.tensor,
            self.pipeline,
            self.zero_stage,
            pipeline_microbatches=self.microbatches,
            pipeline_repeats=self.repeats,
        )

    def label(self) -> str:
        pipe = f" m{self.microbatches} r{self.repeats}" if self.pipeline > 1 else ""
        return (
            f"d{self.data} t{self.tensor} p{self.pipeline}{pipe} ZeRO-{self.zero_stage} "
            f"remat={self.remat} B={self.batch_size}"
        )

    def gin(self) -> str:
        """The flags that select this candidate (after the model and run gin files)."""
        lines = [
            f"--gin.MeshConfig.data={self.data}",
            f"--gin.MeshConfig.tensor={self.tensor}",
            f"--gin.MeshConfig.pipeline={self.pipeline}",
            f"--gin.MeshConfig.zero_stage={self.zero_stage}",
        ]
        if self.pipeline > 1:
            lines += [
                f"--gin.MeshConfig.pipeline_microbatches={self.microbatches}",
                f"--gin.MeshConfig.pipeline_repeats={self.repeats}",
            ]
        lines += [
            f"--gin.LongT5Config.remat=\"'{self.remat}'\"",
            f"--gin.DataConfig.batch_size={self.batch_size}",
        ]
        return " ".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(
    config: LongT5Config, devices: int, gpus_per_node: int, batch_sizes: list[int]
) -> list[Candidate]:
    """Every configuration that divides the model, the batch and the devices.

    Tensor parallelism stays inside a node (its all-reduces are on the critical path).
    """
    out = []
    layers = (config.num_encoder_layers, config.num_decoder_layers)
    widths = (config.num_heads, config.d_ff, config.vocab_size)
    for t, p in itertools.product(_divisors(devices), _divisors(devices)):
        if devices % (t * p) or t > gpus_per_node or any(w % t for w in widths):
            continue
        data = devices // (t * p)
        schedules = [(0, 1)]
        if p > 1:
            schedules = [(f * p, r) for f in (1, 2, 4) for r in (1, 2)]
        for (m, r), batch in itertools.product(schedules, batch_sizes):
            if any(n % (p * r) for n in layers) or batch % (data * max(m, 1)):
                continue
            for zero, remat in itertools.product(range(4), REMAT_POLICIES):
                out.append(Candidate(data, t, p, zero, m, r, remat, batch))
    return out


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What the estimates need of a model: its parameters' shapes and logical axes."""

    config: LongT5Config
    leaves: tuple[tuple[tuple[int, ...], tuple[str | None, ...]], ...]
    opt_bytes_per_param_byte: float  # optimizer state bytes / parameter bytes

    @classmethod
    def of(cls, config: LongT5Config, optimizer: Any) -> ModelShapes:
        ids = jnp.ones((1, 1), jnp.int32)
        boxed = jax.eval_shape(
            lambda k: LongT5(config).init(k, ids, None, ids)["params"], jax.random.key(0)
        )
        specs = jax.tree.leaves(
            nn.get_partition_spec(boxed),
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
        )
        params = nn.unbox(boxed)
        leaves = tuple(
            (tuple(x.shape), tuple(s) + (None,) * (len(x.shape) - len(s)))
            for x, s in zip(jax.tree.leaves(params), specs, strict=True)
        )
        opt = jax.eval_shape(optimizer.init, params)
        opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt))
        param_bytes = sum(4 * int(np.prod(s)) for s, _ in leaves)
        return cls(config, leaves, opt_bytes / param_bytes)

    def sharded_bytes(self, c: Candidate, use: str, itemsize: int = 4) -> float:
        """Per-device bytes of a parameter-shaped tree under the rule table for `use`."""
        sizes = {"data": c.data, "tensor": c.tensor, "pipeline": c.pipeline, None: 1}
        table = dict(rules(use, c.zero_stage, pipelined=c.pipeline > 1))
        total = 0.0
        for shape, axes in self.leaves:
            used, split = set(), 1
            for dim, axis in zip(shape, axes, strict=True):
                mesh_axis = table.get(axis)
                if mesh_axis and mesh_axis not in used and dim % sizes[mesh_axis] == 0:
                    used.add(mesh_axis)
                    split *= sizes[mesh_axis]
            total += itemsize * int(np.prod(shape)) / split
        return total

    def zero_split_bytes(self) -> float:
        """Bytes of the parameters ZeRO splits (those with an `embed` axis)."""
        return sum(4 * int(np.prod(s)) for s, axes in self.leaves if "embed" in axes)


def activations(c: Candidate, config: LongT5Config, lengths: tuple[int, int]):
    """The candidate's activation terms (`memory_model.activations`)."""
    return memory_model.activations(
        config,
        lengths,
        c.batch_size / c.data,
        c.tensor,
        c.pipeline,
        c.microbatches,
        c.repeats,
        c.remat,
    )


def static_bytes(c: Candidate, shapes: ModelShapes) -> float:
    """Parameters, optimizer state and gradients per device, from the rule table."""
    params = shapes.sharded_bytes(c, "params")
    opt = shapes.sharded_bytes(c, "opt_state") * shapes.opt_bytes_per_param_byte
    return params + opt + shapes.sharded_bytes(c, "grads")


def memory_estimate(c: Candidate, shapes: ModelShapes, lengths: tuple[int, int]) -> float:
    """Per-device bytes: the state exactly, activations by the calibrated model."""
    return static_bytes(c, shapes) + activations(c, shapes.config, lengths).bytes()


def comm_estimate(
    c: Candidate, shapes: ModelShapes, lengths: tuple[int, int], cluster: cost.Cluster
) -> float:
    """Analytic communication seconds: ZeRO/data-parallel volumes, Megatron's activation
    all-reduces (2 per encoder layer and 3 per decoder layer, forward and backward), and the
    pipeline's stage-to-stage shifts."""
    cfg, (length, target) = shapes.config, lengths
    per_tp = shapes.sharded_bytes(dataclasses.replace(c, zero_stage=0, data=1), "params")
    split = shapes.zero_split_bytes() / (c.tensor * c.pipeline)
    dp = sum(zero_volumes(c.zero_stage, per_tp, split, c.data, cpu=False).values())
    spans_nodes = c.data > 1 and cluster.devices > cluster.gpus_per_node
    seconds = dp / ((cluster.inter_node_gbps if spans_nodes else cluster.intra_node_gbps) * 1e9)
    rows, b = c.batch_size / c.data, cfg.compute_dtype.itemsize
    passes = 3 if c.remat == "full" or c.pipeline > 1 else 2  # a recomputed forward repeats them
    tokens = cfg.num_encoder_layers / c.pipeline * 2 * length
    tokens += cfg.num_decoder_layers / c.pipeline * 3 * target
    tp = passes * ring_bytes("all-reduce", rows * tokens * cfg.d_model * b, c.tensor)
    seconds += tp / (cluster.intra_node_gbps * 1e9)
    if c.pipeline > 1:
        iterations = c.microbatches * c.repeats + c.pipeline - 1
        shift = iterations * rows / c.microbatches * (length + target) * cfg.d_model * b * 2
        seconds += shift / (cluster.inter_node_gbps * 1e9)
    return seconds


def executed_flops(c: Candidate, config: LongT5Config, lengths: tuple[int, int]) -> float:
    """FLOPs a step of `c` executes; a pipeline rematerialises every iteration whatever the
    layers' own policy."""
    remat = "full" if c.pipeline > 1 else c.remat
    return flops.executed_flops_per_step(config, c.batch_size, *lengths, remat)


@dataclasses.dataclass
class Estimate:
    candidate: Candidate
    memory: float  # bytes per device
    time: cost.StepTime

    @property
    def samples_per_s(self) -> float:
        return self.candidate.batch_size / self.time.total


def estimate(
    c: Candidate, shapes: ModelShapes, lengths: tuple[int, int], cluster: cost.Cluster
) -> Estimate:
    """Memory and step time of a candidate from the analytic models alone."""
    compute = cost.compute_seconds(
        executed_flops(c, shapes.config, lengths), cluster.devices, cluster
    )
    idle = cost.bubble(c.pipeline, c.microbatches, c.repeats)
    comm = comm_estimate(c, shapes, lengths, cluster)
    return Estimate(c, memory_estimate(c, shapes, lengths), cost.step_time(compute, comm, idle))
