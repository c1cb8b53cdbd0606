"""The config against this machine: the mesh fits the devices, the planner's memory estimate
of a step against device memory, and the attention path (with the fused kernels, one tiny
layer's forward and backward checked against XLA's attention on this device)."""

from __future__ import annotations

import dataclasses
import os
import shlex

import jax

from longt5_jax import kernel_checks
from longt5_jax.doctor.report import Row, fail, ok, warn
from longt5_jax.doctor.software import device_memory
from longt5_jax.errors import first_line
from longt5_jax.estimate import candidates
from longt5_jax.estimate.shapes import ModelShapes
from longt5_jax.kernels import backend, interface
from longt5_jax.model import LongT5Config
from longt5_jax.training.experiment import Experiment
from longt5_jax.training.optim import make_optimizer

TIGHT = 0.9  # an estimate above this share of device memory leaves XLA no room to spare
PRESETS = ("tiny", "small", "base", "large", "xl", "xxl")


def mesh_row(exp: Experiment) -> Row:
    count = jax.device_count()
    try:
        exp.check_fits(count)
    except ValueError as e:
        return fail(
            "config",
            "mesh",
            " ".join(str(e).split()),
            "set ParallelConfig.data/tensor/pipeline to divide the devices (data=-1 "
            "takes the rest)",
        )
    data, tensor, pipeline = exp.parallel.shape(count)
    return ok(
        "config",
        "mesh",
        f"data {data} x tensor {tensor} x pipeline {pipeline} on "
        f"{count} devices, ZeRO-{exp.parallel.zero_stage}",
    )


def resolved_model(exp: Experiment) -> LongT5Config:
    """The model as it runs here: `attention_kernel="auto"` made concrete for this device."""
    capability = str(getattr(jax.local_devices()[0], "compute_capability", ""))
    return interface.resolve(exp.model, capability)


def shapes_of(exp: Experiment) -> ModelShapes:
    return ModelShapes.of(resolved_model(exp), make_optimizer(exp.optim))


def _plan_command(exp: Experiment) -> str:
    """The planner's command for this model, lengths and batch on these devices."""
    model = exp.model.name.split("-")[0]
    if model not in PRESETS:
        return "the planner (python -m longt5_jax.plan) takes preset sizes only"
    args = [
        "python",
        "-m",
        "longt5_jax.plan",
        f"--model={model}",
        f"--attention={'tglobal' if exp.model.attention == 'transient-global' else 'local'}",
        f"--input_length={exp.data.input_length}",
        f"--target_length={exp.data.target_length}",
        f"--batch_sizes={exp.data.batch_size}",
        f"--optimizer={exp.optim.name}",
    ]
    return "plan: " + shlex.join(args)


def _available(device) -> tuple[float | None, str]:
    """(bytes a device may use, where that figure comes from); CPU devices share the host's
    available memory."""
    memory = device_memory(device)
    if memory:
        return memory, "device memory"
    if device.platform != "cpu":
        return None, "memory not reported"
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None, "host memory unknown"
    return pages / jax.local_device_count(), f"host memory / {jax.local_device_count()} devices"


def memory_row(exp: Experiment, shapes: ModelShapes) -> Row:
    """The planner's per-device estimate of a step (state exactly, activations by its model)."""
    data, tensor, pipeline = exp.parallel.shape(jax.device_count())
    model = shapes.config
    c = candidates.Candidate(
        data,
        tensor,
        pipeline,
        exp.parallel.zero_stage,
        exp.parallel.pipeline_microbatches,
        exp.parallel.pipeline_repeats,
        model.remat,
        exp.data.batch_size // max(exp.step.microbatches, 1),
        exp.parallel.offload,
        model.scan_layers,
    )
    estimate = candidates.memory_estimate(
        c, shapes, (exp.data.input_length, exp.data.target_length)
    )
    have, source = _available(jax.local_devices()[0])
    plan = _plan_command(exp)
    if have is None:
        return warn(
            "config",
            "memory",
            f"step estimate {estimate / 2**30:.2f} GiB a device; {source}: not compared",
            plan,
        )
    detail = f"step estimate {estimate / 2**30:.2f} GiB of {have / 2**30:.1f} GiB ({source})"
    if estimate > have:
        return fail(
            "config",
            "memory",
            f"does not fit: {detail}",
            f"remat, ZeRO, more devices or a smaller batch; {plan}",
        )
    if estimate > TIGHT * have:
        return warn("config", "memory", f"tight: {detail}", plan)
    return ok("config", "memory", f"fits: {detail}")


def kernel_rows(exp: Experiment, check: bool) -> list[Row]:
    """Which attention path runs here and why; with the fused kernels (or `check`), one tiny
    layer through them against XLA's attention on this device (interpreted on a CPU)."""
    model = resolved_model(exp)
    capability = str(getattr(jax.local_devices()[0], "compute_capability", ""))
    where = f"compute capability {capability}" if capability else f"{jax.default_backend()}"
    if exp.model.attention_kernel == "auto":
        why = (
            f"auto on {where}: the fused kernels suit {model.dtype} here"
            if model.attention_kernel == "pallas"
            else f"auto on {where}: the fused kernels need a CUDA GPU from "
            f"{backend.KERNELS_SINCE}.0 on ({backend.WIDE_SINCE}.0 in float32)"
        )
    else:
        why = f"set in the config (LongT5Config.attention_kernel={exp.model.attention_kernel!r})"
    rows = [ok("kernels", "attention", f"{model.attention_kernel}: {why}")]
    if model.attention_kernel == "pallas" or check:
        rows.append(layer_check(model))
    return rows


def layer_check(model: LongT5Config) -> Row:
    """One tiny encoder attention layer, forward and backward, fused against XLA's."""
    capability = str(getattr(jax.local_devices()[0], "compute_capability", ""))
    wide = capability == "" or backend.suits(capability, "float32")
    dtype, tolerance = ("float32", 1e-4) if wide else ("bfloat16", 3e-2)
    xla = LongT5Config.preset("tiny", model.attention, dtype=dtype)
    problem = kernel_checks.layer_problem(xla, 2, 32, packed=True)
    fused = dataclasses.replace(xla, attention_kernel="pallas")
    how = "interpreted" if jax.default_backend() == "cpu" else "compiled"
    try:
        want = kernel_checks.run_layer(xla, *problem, dtype=dtype)
        got = kernel_checks.run_layer(fused, *problem, dtype=dtype)
    except Exception as e:  # a kernel that does not lower or launch here
        reason = first_line(e)
        return fail(
            "kernels",
            "layer",
            f"the fused kernels failed here ({how}): {reason}",
            "LongT5Config.attention_kernel='xla' (and report the failure)",
        )
    errors = kernel_checks.relative_errors(got, want, problem[1]["seg"][..., None] > 0)
    worst = max(errors, key=lambda k: errors[k])
    detail = (
        f"tiny {model.attention} layer {how} in {dtype}, forward and backward against "
        f"XLA's attention: largest relative error {errors[worst]:.1e} ({worst})"
    )
    if errors[worst] <= tolerance:
        return ok("kernels", "layer", detail)
    return fail(
        "kernels",
        "layer",
        f"{detail} > {tolerance:.0e}",
        "LongT5Config.attention_kernel='xla' (and report the difference)",
    )
