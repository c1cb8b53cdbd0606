"""Compile the sharded train step ahead of time from shapes alone: no parameter is ever made.

The state is `jax.eval_shape` of the model's and optimizer's initialisers, and state and batch
are `jax.ShapeDtypeStruct`s carrying the step's shardings, so lowering sees exactly the arrays a
run would pass (per-device shards, donation) while nothing is allocated: a 3B-parameter step
compiles on a laptop. The devices are fake CPU devices, the compile-only GPUs of a target
topology (`targets.devices`), or a real cluster's: the code path is the same, and so are the
compiler options (`xla_options`), so the program analysed is the one the cluster would run.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from longt5_jax.data.batching import FEATURES
from longt5_jax.data.pipeline import GlobalBatch
from longt5_jax.estimate import cost, hlo, hlo_module, roofline, targets
from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.parallel.mesh import ParallelConfig, compile_only, make_mesh, node_of
from longt5_jax.training.step import ShardedStep, StepConfig


def abstract_batch(
    step: ShardedStep, batch_size: int, input_length: int, target_length: int
) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of the eight T5X features as sharded ShapeDtypeStructs."""

    def one(name: str) -> jax.ShapeDtypeStruct:
        length = input_length if name.startswith("encoder") else target_length
        dtype = jnp.float32 if name == "decoder_loss_weights" else jnp.int32
        return jax.ShapeDtypeStruct((batch_size, length), dtype, sharding=step.batch_sharding)

    return {name: one(name) for name in FEATURES}


def sharded_step(
    config: LongT5Config,
    parallel: ParallelConfig,
    step_cfg: StepConfig | None = None,
    optimizer: optax.GradientTransformation | None = None,
    devices: list | None = None,
    per_node: int | None = None,
) -> ShardedStep:
    """The train step of `config` laid out per `plan` (AdamW unless told otherwise), on
    `devices` in nodes of `per_node` (default: as the devices say)."""
    model = LongT5(config, runner=parallel.pipeline_schedule())
    return ShardedStep(
        model,
        step_cfg or StepConfig(),
        optimizer or optax.adamw(1e-3),
        make_mesh(parallel, devices, per_node),
        parallel,
    )


def compile_step(
    step: ShardedStep, batch_size: int, input_length: int, target_length: int, rng: Any = None
) -> Any:
    """The compiled (`jax.stages.Compiled`) train step for batches of this shape (given an
    abstract dropout key `rng`: the step that draws dropout masks)."""
    state = step.abstract_state
    batch = abstract_batch(step, batch_size, input_length, target_length)
    device = step.mesh.devices.flat[0]
    deviceless = compile_only(device)
    with _persistent_cache(not deviceless):
        # Lowering traces the step from the batch's shapes and shardings alone.
        lowered = step.lower(state, cast(GlobalBatch, batch), rng)
        return lowered.compile(_kernel_cache(device.device_kind) if deviceless else None)


def _kernel_cache(device_kind: str) -> dict[str, str | bool] | None:
    """XLA's GPU kernel cache for the deviceless compiles of this process: most of such a
    compile is generating and assembling kernels the analysis never runs, and the layouts a
    planner or benchmark compiles share most of them (the tiny model's DP32 at ZeRO 1-3
    after ZeRO-0 compile in half the time: docs/parallelism.md). One file per process and GPU
    kind, never shared between
    processes (XLA rewrites it whole after each compile); a kernel cache file named in
    XLA_FLAGS is left to rule."""
    if "xla_gpu_kernel_cache_file" in os.environ.get("XLA_FLAGS", ""):
        return None
    name = "".join(c if c.isalnum() else "_" for c in device_kind)
    return {"xla_gpu_kernel_cache_file": str(_kernel_dir() / f"kernels_{name}.bin")}


_kernel_home: Path | None = None  # this process's kernel cache directory, once made or kept


def keep_kernels_in(path: Path) -> bool:
    """Keep this process's deviceless kernel caches in `path` (made if missing) instead of a
    temporary directory removed at exit, so a later process given the same directory starts
    from them (the test suite gives each of its worker processes one). XLA rewrites a cache
    file whole, so a directory is held (locked) while its process lives: False, and nothing
    changed, where another live process holds `path`."""
    global _kernel_home
    path.mkdir(parents=True, exist_ok=True)
    lock = (path / "held").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return False
    atexit.register(lock.close)  # the lock is released with it, when the process ends
    _kernel_home = path
    return True


def _kernel_dir() -> Path:
    global _kernel_home
    if _kernel_home is None:
        _kernel_home = Path(tempfile.mkdtemp(prefix="longt5_jax_kernels_"))
        atexit.register(shutil.rmtree, _kernel_home, ignore_errors=True)
    return _kernel_home


@contextlib.contextmanager
def _persistent_cache(enabled: bool):
    """A compile-only program cannot be read back from jax's persistent cache (there is no
    client to load it on), so it is not written there: jax writes only programs that took
    longer to compile than its threshold (whether the cache is used at all is fixed per
    process)."""
    option = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, option)
    if not enabled:
        jax.config.update(option, float("inf"))
    try:
        yield
    finally:
        jax.config.update(option, before)


def compile_on_one(fn, args, target: targets.Target, compiler_options: dict | None = None):
    """Jitted `fn` compiled for one device of `target` at the shapes of `args` (arrays or
    ShapeDtypeStructs), without that device: the executable, never written to jax's
    persistent cache (`_persistent_cache`)."""
    device = targets.devices(target, 1, 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args
    )
    with _persistent_cache(False), targets.tracing_for([device]):
        return fn.lower(*abstract).compile(compiler_options=compiler_options)


@dataclasses.dataclass
class CompiledStep:
    """A compiled train step and what it costs each device: memory, collectives, time."""

    step: ShardedStep
    executable: Any  # jax.stages.Compiled
    gpus_per_node: int

    @functools.cached_property
    def module(self) -> hlo_module.Module:
        return hlo_module.Module.parse(self.executable.as_text())

    @functools.cached_property
    def collectives(self) -> list[hlo.Collective]:
        return hlo.collectives(self.module)

    @functools.cached_property
    def placement(self) -> hlo.Placement:
        devices = list(self.step.mesh.devices.flat)
        return hlo.Placement.of(self.step.mesh, node_of(devices, self.gpus_per_node))

    @functools.cached_property
    def host_transfers(self) -> hlo.HostTransfers:
        return hlo.host_transfers(self.module)

    def memory(self) -> hlo.Memory:
        return hlo.memory(self.executable)

    def analyse(self, cluster: cost.Cluster) -> dict[str, Any]:
        """Memory, collective bytes (by kind, link and mesh axes), the roofline of the program
        and the communication it leaves exposed as scheduled, on `cluster`, JSON-ready."""
        peak, hbm = cluster.peak_tflops * 1e12, cluster.hbm_gbps * 1e9
        seconds = {
            op.name: cost.collective_seconds(op, self.placement, cluster) for op in self.collectives
        }
        once = {op.name: seconds[op.name] / op.count for op in self.collectives if op.count}
        return {
            "memory": self.memory().as_dict(),
            "collectives": hlo.bytes_by(self.collectives, self.placement),
            "comm_s": sum(seconds.values()),
            "host_transfers": dataclasses.asdict(self.host_transfers),
            "host_s": cost.host_seconds(self.host_transfers.total, cluster),
            "roofline": roofline.roofline(self.module, peak, hbm).as_dict(),
            "exposed_comm_s": roofline.exposed_communication(self.module, once, peak, hbm),
        }


def compile_for(
    config: LongT5Config,
    parallel: ParallelConfig,
    devices: list,
    gpus_per_node: int,
    shape: tuple[int, int, int],
    step_cfg: StepConfig | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> CompiledStep:
    """Compile the step of `config` on `plan` over `devices` for (batch, input, target) shapes."""
    step = sharded_step(config, parallel, step_cfg, optimizer, devices, gpus_per_node)
    return CompiledStep(step, compile_step(step, *shape), gpus_per_node)
