"""Golden partition specs: how every shipped parallel config lays out the state.

For each `configs/parallel/*.gin` (at its shipped ZERO_STAGE, and at ZeRO-3 where it ships
another) the step's own code (`step.ShardedStep`: `parallel.rules`, `parallel.sharding`,
`optim.moment_axes`) assigns a PartitionSpec to every parameter, gradient and optimizer-state
leaf (AdamW's moments, Adafactor's factored `v_row`/`v_col` and full `v`) of LongT5-XL TGlobal,
whose every sharded dimension divides every mesh. The specs are compared with
`tests/golden/partition_specs.json` (config, then key path: "P(spec) [shape]"), so a change to the
rule table, the ZeRO stage handling, the optimizer's moment axes or the pipeline's layer stacking
shows up as a readable diff there. Nothing is compiled: the parameters are abstract
(`jax.eval_shape`) and the 32-device meshes are `AbstractMesh`es.

After an intended change, regenerate the golden file and review its diff:

    LONGT5_UPDATE_GOLDEN=1 pytest tests/test_partition_specs.py
"""

import functools
import json
import math
import os
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType

from longt5_jax import configuration
from longt5_jax.model import LongT5, LongT5Config
from longt5_jax.parallel.mesh import AXES, ParallelConfig, make_mesh
from longt5_jax.training.optim import OptimizerConfig, make_optimizer
from longt5_jax.training.step import ShardedStep, StepConfig

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden" / "partition_specs.json"
UPDATE = os.environ.get("LONGT5_UPDATE_GOLDEN") == "1"
MODEL = "configs/models/xl_tglobal.gin"
KEY = jax.random.key(0)
PARALLEL = sorted(p.stem for p in (ROOT / "configs" / "parallel").glob("*.gin"))
# The shipped runs' optimizers: AdamW (clipped as in the demo, and with weight decay: both add
# states of their own) and Adafactor as in pretraining (T5X's defaults: factored from 128 on).
OPTIMIZERS = {
    "adamw": OptimizerConfig(name="adamw", weight_decay=0.01, grad_clip_norm=1.0),
    "adafactor": OptimizerConfig(name="adafactor"),
}


def _shipped_stage(name: str) -> int:
    configuration.parse([str(ROOT / "configs" / "parallel" / f"{name}.gin")])
    return configuration.build(ParallelConfig).zero_stage


def _cases() -> list[tuple[str, int]]:
    cases = []
    for name in PARALLEL:
        shipped = _shipped_stage(name)
        cases += [(name, stage) for stage in sorted({shipped, 3})]
    return cases


def _case_key(name: str, stage: int) -> str:
    return f"{name} ZERO_STAGE={stage}"


def _path(path) -> str:
    names = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
    return "/".join(names)


def _spec(entries) -> str:
    return "P(" + ", ".join("None" if e is None else repr(e) for e in entries) + ")"


def _entries(prefix: str, shardings, shapes, mesh_shape: dict[str, int]) -> dict[str, str]:
    """'prefix/key/path' -> 'P(spec) [shape]' for every leaf, checking each split divides."""
    out = {}
    flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
    for (path, sharding), shape in zip(flat, jax.tree.leaves(shapes), strict=True):
        key = f"{prefix}/{_path(path)}"
        # One entry per dimension: trailing Nones are the same layout either way.
        spec = tuple(sharding.spec) + (None,) * (len(shape.shape) - len(sharding.spec))
        for dim, entry in enumerate(spec):
            axes = entry if isinstance(entry, tuple) else (entry,)
            ways = math.prod(mesh_shape[a] for a in axes if a is not None)
            assert shape.shape[dim] % ways == 0, (key, spec, shape.shape, mesh_shape)
        out[key] = f"{_spec(spec)} {list(shape.shape)}"
    return out


OPTIMIZER = optax.named_chain(*((name, make_optimizer(cfg)) for name, cfg in OPTIMIZERS.items()))


@functools.cache
def _shapes(config: LongT5Config):
    """Abstract parameters and optimizer state: the same for every mesh (and pipeline, which
    keeps the stacks in layer order)."""
    ids = jnp.ones((1, 1), jnp.int32)
    init = jax.eval_shape(lambda: nn.unbox(LongT5(config).init(KEY, ids, None, ids))["params"])
    return init, jax.eval_shape(OPTIMIZER.init, init)


def specs_of(name: str, stage: int) -> dict[str, str]:
    """Every leaf's spec under the parallel config `name` at ZeRO `stage`, as the step assigns
    it. Both optimizers run as one chain (the state is {'adamw': ..., 'adafactor': ...}): the
    step lays out each params-shaped subtree of the state on its own, so each optimizer's
    leaves get what they would alone, for one model trace instead of two."""
    configuration.parse(
        [str(ROOT / MODEL), str(ROOT / "configs" / "parallel" / f"{name}.gin")],
        [f"ZERO_STAGE = {stage}"],
    )
    parallel = configuration.build(ParallelConfig)
    config = configuration.build(LongT5Config)
    devices = (
        parallel.data * parallel.tensor * parallel.pipeline
    )  # every shipped config names all three
    if devices == len(jax.devices()):
        mesh = make_mesh(parallel)
    else:  # the cluster's 32 devices: only the mesh's shape matters for the specs
        mesh = AbstractMesh(parallel.shape(devices), AXES, axis_types=(AxisType.Auto,) * len(AXES))
    mesh_shape = dict(mesh.shape)
    model = LongT5(config, runner=parallel.pipeline_schedule())
    step = ShardedStep(model, StepConfig(), OPTIMIZER, mesh, parallel)
    params, opt_state = _shapes(config)
    return {
        "mesh": " x ".join(f"{a} {n}" for a, n in mesh_shape.items()),
        **_entries("params", step.state_shardings.params, params, mesh_shape),
        **_entries("grads", step.grad_shardings, params, mesh_shape),
        **_entries("opt_state", step.state_shardings.opt_state, opt_state, mesh_shape),
    }


CASES = _cases()


@pytest.fixture(scope="module")
def golden() -> dict[str, dict[str, str]]:
    if UPDATE:
        table = {_case_key(*case): specs_of(*case) for case in CASES}
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(table, indent=1) + "\n")
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing: run LONGT5_UPDATE_GOLDEN=1 pytest {__file__}")
    return json.loads(GOLDEN.read_text())


def _diff(want: dict[str, str], got: dict[str, str]) -> list[str]:
    lines = []
    for key in sorted(want.keys() | got.keys()):
        w, g = want.get(key, "(absent)"), got.get(key, "(absent)")
        if w != g:
            lines.append(f"  {key}: golden {w}, now {g}")
    return lines


@pytest.mark.parametrize("name, stage", CASES, ids=[f"{n}-zero{s}" for n, s in CASES])
def test_partition_specs_match_the_golden_file(golden, name, stage):
    key = _case_key(name, stage)
    assert key in golden, f"{key}: no golden entry; regenerate with LONGT5_UPDATE_GOLDEN=1"
    diff = _diff(golden[key], specs_of(name, stage))
    if diff:
        pytest.fail(
            f"{key}: {len(diff)} specs differ from {GOLDEN.name} (if intended, regenerate with "
            "LONGT5_UPDATE_GOLDEN=1 and review the diff):\n" + "\n".join(diff),
            pytrace=False,
        )


def test_the_golden_file_has_no_stale_configs(golden):
    stale = sorted(set(golden) - {_case_key(*case) for case in CASES})
    assert not stale, f"golden entries for configs no longer shipped: {stale}"
