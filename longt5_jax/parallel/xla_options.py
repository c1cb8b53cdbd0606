"""XLA compiler options for our executables, chosen per platform: the one place they are set.

The train step compiles with them (`step.ShardedStep`), on a cluster and in the deviceless
compile-ahead alike (`estimate/compile_ahead.py`), so the simulated program is the one the cluster
runs; the launch scripts set no XLA flags of their own.

CPU: jaxlib 0.10 hands dots, elementwise ops and reductions to YNNPACK fusions. Its dots are
fast, but inside the train step its reductions run far slower than XLA's own loops (the layer
norm's scale gradient, a [4096, 512] -> [512] sum), and its elementwise fusions gain nothing.
Dots only trains small TGlobal at 4k inputs fastest, ahead of the default set and of no YNNPACK
at all (docs/journal.md, "On CPU"; `python -m longt5_jax.bench profile` shows where a step's
time goes).

GPU: chosen on the deviceless A100 compile of LongT5-base TGlobal at 4k (global batch 128,
bf16, full remat; `python -m longt5_jax.bench cluster` reads the same figures), each option
against the compile without it. Left out, with what they did there: the pipelined all-gather /
reduce-scatter / all-reduce halve the exposed gradient reduction of a plain DP step for more
memory per device, but inside gradient accumulation they duplicate the microbatch forward passes;
while-loop double buffering adds memory and exposes more of the reduction (figures:
docs/journal.md, "XLA's GPU options");
pipelined p2p and the collective-permute decomposer change nothing in our steps, and together
they crash the compiler (a cycle in algebraic_simplifier, jaxlib 0.10.2).
"""

from __future__ import annotations

import functools

import jax

CPU_OPTIONS: dict[str, str | bool] = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"
}

GPU_OPTIONS = {
    # Collectives become asynchronous and are scheduled to overlap independent kernels: less of
    # the communication is left exposed (most with TP4 x DP8), for a little memory per device.
    # Without it every collective runs synchronously.
    "xla_gpu_enable_latency_hiding_scheduler": True,
    # Combine small collectives of one kind into one launch (each NCCL call costs tens of
    # microseconds of latency across nodes): ZeRO-2 with accumulation issues 27 instead of 46,
    # TP4 x DP8 25 instead of 40, at about the same memory.
    "xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30,
    "xla_gpu_all_gather_combine_threshold_bytes": 1 << 30,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 27,
}


@functools.cache
def _cpu_options_accepted() -> bool:
    """Whether this jaxlib knows the options (a newer one may rename them: then run without)."""
    try:
        jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=CPU_OPTIONS)
    except Exception:  # noqa: BLE001 - any rejection means: compile without the options
        return False
    return True


def compiler_options(platform: str) -> dict[str, str | int | bool] | None:
    """Options for executables that run on `platform` ('cpu', 'gpu', 'tpu'), or None."""
    if platform == "cpu" and _cpu_options_accepted():
        return dict(CPU_OPTIONS)
    if platform == "gpu":
        return dict(GPU_OPTIONS)
    return None


def dump_options(directory: str, every_emitter: bool = False) -> dict[str, str]:
    """Options that make a compile write XLA's dump, the kernels' PTX among it, to `directory`.
    jax 0.10's XLA writes every kernel's PTX with the dump; jax 0.12's only for the emitters
    `xla_dump_emitter_re` names, and naming them all (`every_emitter`) also writes each Triton
    kernel's IR after every pass of its lowering: hundreds of MB, most of such a compile's time.
    So they are asked for only where a dump came without the PTX (`bench sass`)."""
    options = {"xla_dump_to": directory}
    return {**options, "xla_dump_emitter_re": ".*"} if every_emitter else options
