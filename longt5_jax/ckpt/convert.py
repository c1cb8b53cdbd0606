"""Conversions between our checkpoints, transformers' and T5X's.

A native checkpoint written here is a MODEL_DIR holding one parameters-only step (`state` with
`params` and `step`, and the `config` item), so every tool reads it and a run starts from it
with `CheckpointConfig.init_from`. Outputs are built beside their final path and renamed into
place at the end: a failing conversion leaves nothing, and an existing path is never replaced.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from longt5_jax import cli
from longt5_jax.ckpt.commands import Arrays
from longt5_jax.formats import hf, t5x
from longt5_jax.formats.atomic import publishing
from longt5_jax.formats.native import CheckpointError, model_config, resolve
from longt5_jax.model.config import LongT5Config


def _fresh(out: str | Path, source: str | Path | None = None, checkpoint: bool = False) -> Path:
    """OUT, absolute, checked to be new and none of what the conversion reads (`source`, a
    native checkpoint where `checkpoint`)."""
    read = [("SRC", source)]
    cli.check_outputs([("OUT", out)], [] if checkpoint else read, read if checkpoint else [])
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: already exists; choose a new output path")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _into_place(out: Path, write) -> Path:
    """Run `write(tmp_dir)` and rename the result to `out` (absent or empty, checked by _fresh);
    on failure remove it."""
    with publishing(out, directory=True) as tmp:
        write(tmp)
    return out


def gin_lines(config: LongT5Config) -> str:
    return "".join(f"LongT5Config.{k} = {v!r}\n" for k, v in dataclasses.asdict(config).items())


def write_native(out: str | Path, config: LongT5Config, params: Any, source: str) -> Path:
    """A parameters-only native checkpoint of `params` at step 0 in the new MODEL_DIR `out`."""
    out = _fresh(out)

    def write(tmp: Path) -> None:
        manager = ocp.CheckpointManager(tmp / "checkpoints", item_names=("state", "config"))
        state = {"params": params, "step": np.int32(0)}
        item = {"gin": gin_lines(config), "model": dataclasses.asdict(config), "source": source}
        manager.save(
            0,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(item)
            ),
        )
        manager.wait_until_finished()
        manager.close()

    return _into_place(out, write)


def native_params(step_dir: Path) -> dict:
    """The parameters of a native checkpoint as nested dicts of host float32 arrays."""
    arrays = Arrays(step_dir)
    params: dict = {}
    for name in arrays.names:
        if name.startswith("params/"):
            *parents, leaf = name.split("/")[1:]
            node = params
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = arrays.read(name).astype(np.float32)
    if not params:
        raise CheckpointError(f"{step_dir}: no parameters in this checkpoint")
    return params


def hf_to_native(src: str | Path, out: str | Path) -> Path:
    _fresh(out, src)  # before the work of reading the source
    config, params = hf.load(src)
    return write_native(out, config, params, source=f"transformers {Path(src).absolute()}")


def t5x_to_native(src: str | Path, out: str | Path, **overrides: Any) -> Path:
    _fresh(out, src)
    config, params = t5x.load(src, **overrides)
    return write_native(out, config, params, source=f"t5x {Path(src).absolute()}")


def native_to_hf(ckpt: str | Path, out: str | Path) -> Path:
    step_dir = resolve(ckpt)
    _fresh(out, step_dir, checkpoint=True)
    config, params = model_config(step_dir), native_params(step_dir)
    hf.name_table(config)  # fails early, before writing, for a tree transformers cannot hold
    return _into_place(_fresh(out), lambda tmp: hf.save(config, params, tmp))
