"""The device mesh: named axes data x tensor x pipeline, built from jax.devices() order."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from longt5_jax.parallel.pipeline import Pipeline

AXES = ("data", "tensor", "pipeline")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
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

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"MeshConfig.zero_stage={self.zero_stage}: expected 0, 1, 2 or 3")
        for name in ("tensor", "pipeline"):
            if getattr(self, name) < 1:
                raise ValueError(f"MeshConfig.{name}={getattr(self, name)}: expected >= 1")
        if self.data == 0 or self.data < -1:
            raise ValueError(f"MeshConfig.data={self.data}: expected >= 1, or -1 to fill")
        if self.pipeline_repeats < 1 or self.pipeline_microbatches < 0:
            raise ValueError(
                f"MeshConfig.pipeline_repeats={self.pipeline_repeats}, pipeline_microbatches="
                f"{self.pipeline_microbatches}: expected repeats >= 1 and microbatches >= 0"
            )
        if 0 < self.pipeline_microbatches < self.pipeline:
            raise ValueError(
                f"MeshConfig.pipeline_microbatches={self.pipeline_microbatches} is fewer than the "
                f"{self.pipeline} pipeline stages: each stage needs a microbatch in flight"
            )

    def pipeline_plan(self) -> Pipeline | None:
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


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A mesh over `devices` (default all), data outermost so tensor groups are neighbours."""
    devices = jax.devices() if devices is None else devices
    shape = cfg.shape(len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * 3)


def check_fits(
    cfg: MeshConfig,
    num_devices: int,
    num_heads: int,
    d_ff: int,
    vocab_size: int,
    batch_size: int,
    num_layers: tuple[int, int] = (0, 0),
) -> None:
    """One-line errors for a mesh that does not divide the devices, the model or the batch."""
    data, tensor, _ = cfg.shape(num_devices)
    for name, size in (
        ("LongT5Config.num_heads", num_heads),
        ("LongT5Config.d_ff", d_ff),
        ("LongT5Config.vocab_size", vocab_size),
    ):
        if size % tensor:
            raise ValueError(f"{name}={size} is not divisible by the tensor axis ({tensor})")
    if batch_size % data:
        raise ValueError(
            f"DataConfig.batch_size={batch_size} is not divisible by the data axis ({data})"
        )
    plan = cfg.pipeline_plan()
    if plan is None:
        return
    for name, layers in zip(("num_encoder_layers", "num_decoder_layers"), num_layers, strict=True):
        plan.check(layers, f"LongT5Config.{name}")
    if batch_size % (plan.microbatches * data):
        raise ValueError(
            f"DataConfig.batch_size={batch_size} is not divisible by pipeline microbatches x "
            f"data ({plan.microbatches} x {data}): each microbatch splits over the data axis"
        )
