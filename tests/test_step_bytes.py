"""The compiled train step's device memory and HBM bytes per step, held against a baseline.

A few shipped parallel layouts, each through a different memory path (data parallelism with
ZeRO-2 and the layers' parameters cast where used; optimizer state offloaded to the host; tensor
parallelism with ZeRO-3; a pipeline), are compiled deviceless for 2 nodes x 4 A100-80GB with the
shipped GPU options. Per layout, the per-device bytes of XLA's GPU buffer assignment (`total`,
`temporaries`, `arguments`, `host`: `estimate/hlo.py`) and the HBM bytes its kernels read and
write per step (`estimate/roofline.py`) must stay within 1% of `tests/golden/step_bytes.json`,
either way: a rise is a regression, a fall a saving to lock in. A change that moves them rewrites
the baseline, saying why, in the same commit:

    LONGT5_STEP_BYTES_REASON="why" python -m pytest -q -n 0 tests/test_step_bytes.py

Skipped without the `gpu` extra, and under another jax than the baseline's (XLA's fusion and
buffer assignment differ between releases).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import pytest

from longt5_jax import configuration
from longt5_jax.estimate import compile_ahead, roofline, targets
from longt5_jax.model import LongT5Config
from longt5_jax.parallel.mesh import ParallelConfig
from longt5_jax.training.step import StepConfig

# A minute of deviceless compiles: with the slow tests, which `.ci/run` runs.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not targets.have_gpu_compiler(), reason="the gpu extra (jax[cuda12]) is not installed"
    ),
]
ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tests" / "golden" / "step_bytes.json"
REASON_VARIABLE = "LONGT5_STEP_BYTES_REASON"
TOLERANCE = 0.01
QUANTITIES = ("total", "temporaries", "arguments", "host", "hbm")
SHAPE = (16, 128, 32)  # global batch (8 devices and 4 pipeline microbatches divide it), lengths
# The tiny model widened to LongT5-small's width, so that parameters, their gradients and the
# optimizer state weigh as much as the activations: how the parameters are cast shows.
WIDE = [
    "LongT5Config.d_model = 512",
    "LongT5Config.d_ff = 2048",
    "LongT5Config.num_heads = 8",
    "LongT5Config.d_kv = 64",
]
# name -> (parallel gin file, extra bindings): the model is tiny_tglobal.gin widened, bf16,
# full remat, AdamW, data filling the 8 devices.
LAYOUTS = {
    "dp8 ZeRO-2, cast at use": ("dp32_zero2.gin", []),
    "dp8 ZeRO-1, optimizer offloaded": ("dp8.gin", ["ParallelConfig.offload = 'optimizer'"]),
    "dp4 x tp2 ZeRO-3": ("dp4_tp2.gin", ["ZERO_STAGE = 3"]),
    "dp2 x tp2 x pp2": ("dp2_tp2_pp2.gin", []),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    config: LongT5Config
    parallel: ParallelConfig


def _layout(gin_file: str, extra: list[str]) -> Layout:
    files = [str(ROOT / "configs" / "models" / "tiny_tglobal.gin")]
    files.append(str(ROOT / "configs" / "parallel" / gin_file))
    settings = ["LongT5Config.dtype = 'bfloat16'", "LongT5Config.remat = 'full'"]
    configuration.parse(files, [*WIDE, *settings, "ParallelConfig.data = -1", *extra])
    return Layout(configuration.build(LongT5Config), configuration.build(ParallelConfig))


def _figures(layout: Layout, devices: list) -> dict[str, int]:
    compiled = compile_ahead.compile_for(
        layout.config, layout.parallel, devices, 4, SHAPE, StepConfig()
    )
    memory = compiled.memory()
    # HBM bytes do not depend on the device's speed: any peak and bandwidth give the same.
    hbm = roofline.roofline(compiled.module, 1.0, 1.0).bytes
    return {
        "total": memory.total,
        "temporaries": memory.temporaries,
        "arguments": memory.arguments,
        "host": memory.host,
        "hbm": int(hbm),
    }


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, int]]:
    """Every layout's figures, compiled once for the module."""
    devices = targets.devices(targets.load("a100-80gb"), 2, 4)
    return {name: _figures(_layout(*spec), devices) for name, spec in LAYOUTS.items()}


def _moved(old: float, new: float) -> float:
    """The relative change from `old` to `new` (a change from 0 is infinite)."""
    if old == 0:
        return 0.0 if new == 0 else float("inf")
    return (new - old) / old


def _write(measured: dict[str, dict[str, int]], baseline: dict, reason: str) -> None:
    """The baseline rewritten with today's figures; a layout whose figures moved by more than
    the tolerance (or is new) takes `reason`, the others keep theirs."""
    old = baseline.get("layouts", {})
    layouts = {}
    for name, figures in measured.items():
        before = old.get(name)
        moved = before is None or any(
            abs(_moved(before[q], figures[q])) > TOLERANCE for q in QUANTITIES
        )
        layouts[name] = {**figures, "reason": reason if moved else before["reason"]}
    text = json.dumps({"jax": jax.__version__, "layouts": layouts}, indent=2) + "\n"
    BASELINE.write_text(text)


def _breaches(name: str, baseline: dict[str, int], figures: dict[str, int]) -> list[str]:
    lines = []
    for q in QUANTITIES:
        change = _moved(baseline[q], figures[q])
        if abs(change) > TOLERANCE:
            way = "rose" if change > 0 else "fell"
            lines.append(
                f"{name}: {q} {way} {abs(change):.2%} (more than {TOLERANCE:.0%}): baseline "
                f"{baseline[q]:,} bytes, now {figures[q]:,}"
            )
    return lines


def _load() -> dict:
    return json.loads(BASELINE.read_text()) if BASELINE.is_file() else {}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_bytes_match_the_baseline(measured, name):
    """A rise or a fall of more than 1% in any figure fails, naming the layout, the quantity and
    both values, until the baseline is rewritten with a reason."""
    reason = os.environ.get(REASON_VARIABLE, "").strip()
    baseline = _load()
    if reason:
        _write(measured, baseline, reason)
        baseline = _load()
    assert baseline, f"{BASELINE.relative_to(ROOT)} is missing"
    if baseline["jax"] != jax.__version__:
        pytest.skip(f"{BASELINE.name} was measured with jax {baseline['jax']}")
    held = baseline["layouts"].get(name)
    assert held is not None, (
        f"{name}: not in {BASELINE.relative_to(ROOT)}; write it with "
        f'{REASON_VARIABLE}="why" python -m pytest -q -n 0 tests/test_step_bytes.py'
    )
    breaches = _breaches(name, held, measured[name])
    assert not breaches, "\n".join(
        [
            *breaches,
            f"(baseline reason: {held['reason']})",
            f"If intended, rewrite {BASELINE.relative_to(ROOT)} saying why, in the same commit: "
            f'{REASON_VARIABLE}="why the figures moved" python -m pytest -q -n 0 '
            "tests/test_step_bytes.py",
        ]
    )


def test_a_layout_missing_from_the_tests_is_not_held():
    """Every layout in the baseline is one the tests compile (none left behind unchecked)."""
    baseline = _load()
    assert set(baseline.get("layouts", {})) <= set(LAYOUTS)
