"""XLA compiler options for our executables, chosen per platform.

On CPU, jaxlib 0.10 hands dots, elementwise ops and reductions to YNNPACK fusions. Its dots are
fast, but inside the train step its reductions run far slower than XLA's own loops (the layer
norm's scale gradient, a [4096, 512] -> [512] sum, took 5 ms instead of under 1), and its
elementwise fusions gain nothing. Dots only: small TGlobal at 4k inputs trains in 6.7 s a step,
against 10.5 s with the default set and 8.7 s with no YNNPACK at all (measured on one idle 2-core
machine; `python -m longt5_jax.bench profile` shows where a step's time goes). GPUs and TPUs get
no options.
"""

from __future__ import annotations

import functools

import jax

CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


@functools.cache
def _cpu_options_accepted() -> bool:
    """Whether this jaxlib knows the options (a newer one may rename them: then run without)."""
    try:
        jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=CPU_OPTIONS)
    except Exception:  # noqa: BLE001 - any rejection means: compile without the options
        return False
    return True


def compiler_options(platform: str) -> dict[str, str] | None:
    """Options for executables that run on `platform` ('cpu', 'gpu', 'tpu'), or None."""
    if platform == "cpu" and _cpu_options_accepted():
        return dict(CPU_OPTIONS)
    return None
