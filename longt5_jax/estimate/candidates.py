"""Candidate parallel configurations for a cluster, pruned and pre-ranked analytically.

The planner (`plan.py`) compiles only a few configurations; this module chooses which. A
candidate is a mesh (data x tensor x pipeline), a ZeRO stage, pipeline microbatches and
repeats, a remat policy, the layers scanned or unrolled and a global batch. Candidates that do
not divide (heads, MLP width, vocabulary over tensor; layers over pipeline stages x repeats; the
batch over data x microbatches) are never made. Each remaining one gets an analytic per-device
memory estimate (exact sharded state from the parameters' logical axes, plus an activation
model) and analytic collective bytes, which feed the same cost model (`cost.py`) the compiled
numbers later do. Activations follow `memory_model.py`, calibrated on the compiled GPU program.
"""

from __future__ import annotations

import dataclasses
import itertools

from longt5_jax.estimate import comm_model, cost, flops, memory_model
from longt5_jax.estimate.shapes import ModelShapes
from longt5_jax.model import LongT5Config
from longt5_jax.model.config import REMAT_POLICIES
from longt5_jax.parallel.mesh import OFFLOADS, Offload, ParallelConfig
from longt5_jax.training.step import StepConfig


def planned_remat(config: LongT5Config) -> tuple[str, ...]:
    """The remat policies the planner weighs: all four with the fused kernels; on XLA's
    attention save_attention compiles to full remat's program, so three."""
    if config.attention_kernel == "pallas":
        return REMAT_POLICIES
    return tuple(p for p in REMAT_POLICIES if p != "save_attention")


def cast_params_for(parallel: ParallelConfig) -> str:
    """Where a layout's layers cast their parameters to the compute dtype
    (`LongT5Config.cast_params`), as the compiled programs measured it: in each layer as it uses
    them where every device holds whole parameters beside sharded gradients (data parallelism
    with ZeRO-2, `configs/parallel/dp32_zero2.gin`), since a copy cast once a step would live from
    the forward to the backward; once a step elsewhere (ZeRO-0/1's backward stacks the layers'
    gradients at half width, ZeRO-3 gathers half-width parameters)."""
    whole = parallel.zero_stage == 2 and parallel.tensor == 1 and parallel.pipeline == 1
    return "at_use" if whole else "once"


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
    offload: Offload = "none"  # ParallelConfig.offload
    scan_layers: bool = True  # LongT5Config.scan_layers

    def mesh(self) -> ParallelConfig:
        return ParallelConfig(
            self.data,
            self.tensor,
            self.pipeline,
            self.zero_stage,
            pipeline_microbatches=self.microbatches,
            pipeline_repeats=self.repeats,
            offload=self.offload,
        )

    @property
    def cast_params(self) -> str:
        return cast_params_for(self.mesh())

    @property
    def sizes(self) -> dict[str, int]:
        return {"data": self.data, "tensor": self.tensor, "pipeline": self.pipeline}

    def label(self) -> str:
        pipe = f" m{self.microbatches} r{self.repeats}" if self.pipeline > 1 else ""
        off = f" offload={self.offload}" if self.offload != "none" else ""
        unrolled = "" if self.scan_layers else " unrolled"
        return (
            f"d{self.data} t{self.tensor} p{self.pipeline}{pipe} ZeRO-{self.zero_stage}{off} "
            f"remat={self.remat}{unrolled} B={self.batch_size}"
        )

    def gin(self) -> str:
        """The flags that select this candidate (after the model and run gin files)."""
        lines = [
            f"--gin.ParallelConfig.data={self.data}",
            f"--gin.ParallelConfig.tensor={self.tensor}",
            f"--gin.ParallelConfig.pipeline={self.pipeline}",
            f"--gin.ParallelConfig.zero_stage={self.zero_stage}",
        ]
        if self.offload != "none":
            lines.append(f"--gin.ParallelConfig.offload=\"'{self.offload}'\"")
        if self.pipeline > 1:
            lines += [
                f"--gin.ParallelConfig.pipeline_microbatches={self.microbatches}",
                f"--gin.ParallelConfig.pipeline_repeats={self.repeats}",
            ]
        lines.append(f"--gin.LongT5Config.remat=\"'{self.remat}'\"")
        if self.cast_params != "once":
            lines.append(f"--gin.LongT5Config.cast_params=\"'{self.cast_params}'\"")
        if not self.scan_layers:
            lines.append("--gin.LongT5Config.scan_layers=False")
        lines.append(f"--gin.DataConfig.batch_size={self.batch_size}")
        return " ".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(
    config: LongT5Config,
    devices: int,
    gpus_per_node: int,
    batch_sizes: list[int],
    offloads: tuple[Offload, ...] = OFFLOADS,
) -> list[Candidate]:
    """Every configuration that divides the model, the batch and the devices, with each of
    `offloads`.

    Tensor parallelism stays inside a node (its all-reduces are on the critical path). ZeRO
    splits the state over data alone, so with one data rank only ZeRO-0 (the other stages are
    the same program). Without a pipeline each candidate comes unrolled, then scanned: the
    analytic models cannot tell them apart, and at base 16k the unrolled layers moved fewer
    bytes under each remat policy compiled (no scan's copies of saved activations; base 16k x 2
    on an H100 without remat, docs/journal.md), so among equals they
    are compiled first and the compiled programs decide.
    """
    out, remats = [], planned_remat(config)
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
            zeros = range(4) if data > 1 else (0,)
            scans = (False, True) if p == 1 else (True,)
            for zero, remat, off, scan in itertools.product(zeros, remats, offloads, scans):
                out.append(Candidate(data, t, p, zero, m, r, remat, batch, off, scan))
    return out


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


def state_bytes(c: Candidate, shapes: ModelShapes) -> dict[str, float]:
    """Per-device bytes of parameters, optimizer state and gradients (from the rule table), and
    of what offload keeps in host memory between steps."""
    sizes, zero = c.sizes, c.zero_stage
    params = shapes.sharded_bytes(sizes, "params", zero)
    opt = shapes.sharded_bytes(sizes, "opt_state", zero) * shapes.opt_bytes_per_param_byte
    grads = shapes.sharded_bytes(sizes, "grads", zero)
    if c.pipeline > 1:  # the step's region: whole gradients per shard, and their partial sums
        grads = 2 * shapes.sharded_bytes(sizes, "grads", 0)
    reordered = 0.0
    if c.repeats > 1:
        # A circular schedule reads its layers stage-major (`pipeline.stage_major`, an
        # all-to-all of the shards as held): the encoder's reordered copy is live through the
        # encoder's backward pass, where the step peaks; the decoder's is gone by then (XLA's
        # live ranges of an xl 16k p2 m8 r2 step for A100s hold a stage's encoder layers).
        reordered = shapes.sharded_bytes(sizes, "params", zero, stack="encoder")
    if c.offload == "none":
        return {"device": params + opt + grads + reordered, "host": 0.0}
    # Offloaded parameters still come to the device for the step's forward and backward
    # passes: counted there too (an upper bound: XLA frees some of them early).
    host = opt + (params if c.offload == "optimizer_and_params" else 0.0)
    return {"device": params + grads + reordered, "host": host}


def static_bytes(c: Candidate, shapes: ModelShapes) -> float:
    """The state's bytes on each device during a step (`state_bytes`)."""
    return state_bytes(c, shapes)["device"]


def host_seconds(c: Candidate, shapes: ModelShapes, cluster: cost.Cluster) -> float:
    """Time of the step's host <-> device copies: what offload keeps on the host comes to the
    device and goes back once per step, over each GPU's own PCIe link."""
    return cost.host_seconds(2 * state_bytes(c, shapes)["host"], cluster)


def update_seconds(c: Candidate, shapes: ModelShapes, cluster: cost.Cluster) -> float:
    """The optimizer update's HBM time a step: it reads the gradients, parameters and optimizer
    state of the shard it updates and writes the last two back, memory-bound (at HBM's
    bandwidth on an H100 at xl 4k x 1: docs/journal.md, "Where xl 4k's step goes"). It is paid
    once a step whatever the batch,
    so it is what makes larger batches faster per sample on a few GPUs, where no gradient
    reduction does. Offloaded, it runs on the host, from memory slower than HBM: charged the
    same, a lower bound there, so that offload never gains by it (its copies are
    `host_seconds`)."""
    updated = shapes.sharded_bytes(c.sizes, "opt_state", c.zero_stage)  # float32, param-shaped
    moments = updated * shapes.opt_bytes_per_param_byte
    return (3 * updated + 2 * moments) / (cluster.hbm_gbps * 1e9)


def memory_estimate(c: Candidate, shapes: ModelShapes, lengths: tuple[int, int]) -> float:
    """Per-device bytes: the state exactly, activations by the calibrated model."""
    return static_bytes(c, shapes) + activations(c, shapes.config, lengths).bytes()


def comm_estimate(
    c: Candidate, shapes: ModelShapes, lengths: tuple[int, int], cluster: cost.Cluster
) -> float:
    """Communication seconds by the analytic model (`comm_model.py`), each mesh axis at the
    bandwidth of the links its groups cross when the mesh is laid out by node (tensor
    innermost, then pipeline, then data)."""
    layout = comm_model.Layout.of(c.mesh(), cluster.devices, StepConfig(), (c.batch_size, *lengths))
    # A group along an axis spans as many devices as that axis and the ones inside it.
    span = {"tensor": c.tensor, "pipeline": c.tensor * c.pipeline, "data": cluster.devices}
    seconds = 0.0
    for axes in comm_model.volumes(shapes, layout).values():
        for axis, moved in axes.items():
            reach = max(span[a] for a in axis.split("+"))
            crosses = reach > cluster.gpus_per_node or cluster.gpus_per_node % reach
            gbps = cluster.inter_node_gbps if crosses else cluster.intra_node_gbps
            seconds += moved / (gbps * 1e9)
    return seconds


def executed_flops(c: Candidate, config: LongT5Config, lengths: tuple[int, int]) -> float:
    """FLOPs a step of `c` executes (model FLOPs plus what the remat policy recomputes)."""
    return flops.executed_flops_per_step(config, c.batch_size, *lengths, c.remat)


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
    # The executed FLOPs at the assumed MFU, then the update.
    executed = executed_flops(c, shapes.config, lengths)
    compute = cost.compute_seconds(executed, cluster.devices, cluster)
    compute += update_seconds(c, shapes, cluster)
    idle = cost.bubble(c.pipeline, c.microbatches, c.repeats)
    comm = comm_estimate(c, shapes, lengths, cluster)
    host = host_seconds(c, shapes, cluster)
    return Estimate(
        c, memory_estimate(c, shapes, lengths), cost.step_time(compute, comm, idle, host)
    )
