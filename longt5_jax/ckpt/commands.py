"""What `python -m longt5_jax.ckpt` reports, as JSON-ready values (the CLI formats them).

`tree` reads metadata only. `stats`, `diff` and `verify` read a few arrays at a time (orbax
partial restores into host memory, up to `BATCH_BYTES` together), so a checkpoint larger than
this machine's memory and saved on any number of devices can still be inspected.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from longt5_jax import configuration
from longt5_jax.formats.keypath import path_text
from longt5_jax.formats.native import (
    CheckpointError,
    array_infos,
    is_complete,
    quiet_failed_reads,
    resolve,
    saved_config,
    saved_tree,
    state_of,
    step_dirs,
    step_of,
    unreadable,
)
from longt5_jax.training.run_config import RunConfig


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def ls(model_dir: str | Path) -> list[dict]:
    """Every step directory with its size, time and state: complete, incomplete (a save that
    did not finish) or unreadable (set aside by a run that could not read it)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory (expected a MODEL_DIR)")
    found = step_dirs(root)
    if not found:
        raise CheckpointError(f"{root}: no checkpoints (expected step directories in checkpoints/)")
    return [
        {
            "step": step_of(d),
            "path": str(d),
            "complete": is_complete(d),
            "state": state_of(d),
            "bytes": _size(d),
            "time": datetime.datetime.fromtimestamp(d.stat().st_mtime).isoformat(" ", "seconds"),
            "items": sorted(p.name for p in d.iterdir() if p.is_dir()),
        }
        for d in found
    ]


@dataclasses.dataclass(frozen=True)
class RunSection:
    """The one section `done` builds from a run's saved config."""

    run: RunConfig


def done(model_dir: str | Path) -> dict:
    """Whether the run in MODEL_DIR saved its last step (RunConfig.train_steps of the config it
    saved): what a job script asks before it requeues itself."""
    root = Path(model_dir)
    if not (root / "config.gin").is_file():
        raise CheckpointError(f"{root}: no config.gin (expected the MODEL_DIR of a started run)")
    cfg, _ = configuration.from_args([f"--gin_file={root / 'config.gin'}"], RunSection)
    steps = cfg.run.train_steps
    complete = [step_of(d) for d in step_dirs(root) if is_complete(d)]
    saved = max((s for s in complete if s is not None), default=0)  # (step_dirs' all are)
    return {"path": str(root), "saved": saved, "steps": steps, "ok": saved >= steps}


def tree(ckpt: str | Path) -> list[dict]:
    """Path, shape, dtype and saved sharding of every array, from metadata alone."""
    return [
        {"path": p, "shape": list(a.shape), "dtype": a.dtype, "sharding": a.sharding}
        for p, a in array_infos(resolve(ckpt)).items()
    ]


# Arrays restored together: one orbax restore an array costs a fixed overhead each (the demo's
# 96 arrays: docs/journal.md, "Figures moved from the code"), and a bound keeps a checkpoint
# larger than memory readable.
BATCH_BYTES = 256 << 20


class Arrays:
    """A checkpoint's saved arrays, restored into host memory on request, a batch at a time."""

    def __init__(self, step_dir: Path):
        self.step_dir = step_dir
        leaves, self._treedef = jax.tree_util.tree_flatten_with_path(saved_tree(step_dir))
        self._metadata = [m for _, m in leaves]
        self.names = [path_text(p) for p, _ in leaves]
        self._index = {name: i for i, name in enumerate(self.names)}
        quiet_failed_reads()  # several reads in flight: orbax abandons the rest on an error

    def _restore(self, names: list[str]) -> dict[str, np.ndarray]:
        wanted = sorted(self._index[name] for name in names)

        def only(values):  # orbax skips PLACEHOLDER leaves
            leaves = [ocp.PLACEHOLDER] * len(self.names)
            for i in wanted:
                leaves[i] = values[i]
            return jax.tree_util.tree_unflatten(self._treedef, leaves)

        args = ocp.args.PyTreeRestore(
            item=only(self._metadata),
            restore_args=only([ocp.RestoreArgs(restore_type=np.ndarray)] * len(self.names)),
        )
        try:
            out = ocp.PyTreeCheckpointer().restore(self.step_dir / "state", args=args)
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise CheckpointError(f"{self.step_dir}: {names[0]}: {unreadable(e)}") from None
        leaves = jax.tree.leaves(out)  # the others came back as PLACEHOLDER
        return {self.names[i]: np.asarray(leaves[i]) for i in wanted}

    def read_many(
        self, names: list[str], errors: list[CheckpointError] | None = None
    ) -> dict[str, np.ndarray]:
        """The arrays `names`, restored together. Where that fails, each is read alone: the
        error naming an unreadable one is raised or, given `errors`, appended there (and the
        readable ones returned)."""
        try:
            return self._restore(names)
        except CheckpointError:
            pass
        read = {}
        for name in names:
            try:
                read[name] = self._restore([name])[name]
            except CheckpointError as e:
                if errors is None:
                    raise
                errors.append(e)
        return read

    def batches(self, names: list[str] | None = None) -> Iterator[list[str]]:
        """`names` (every array's by default) in runs of up to BATCH_BYTES (a larger array
        alone)."""
        run: list[str] = []
        size = 0
        for name in self.names if names is None else names:
            meta = self._metadata[self._index[name]]
            nbytes = math.prod(meta.shape) * np.dtype(meta.dtype).itemsize
            if run and size + nbytes > BATCH_BYTES:
                yield run
                run, size = [], 0
            run.append(name)
            size += nbytes
        if run:
            yield run

    def items(self, names: list[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        for run in self.batches(names):
            yield from self.read_many(run).items()

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        return self.items()


def _stats(x: np.ndarray) -> dict:
    v = x.astype(np.float64).ravel()
    finite = v[np.isfinite(v)]
    return {
        "norm": float(np.sqrt(np.sum(finite * finite))),
        "min": float(finite.min()) if finite.size else math.nan,
        "max": float(finite.max()) if finite.size else math.nan,
        "nan": int(np.isnan(v).sum()),
        "inf": int(np.isinf(v).sum()),
    }


def stats(ckpt: str | Path) -> list[dict]:
    """Per-array L2 norm, min and max (over finite values) and NaN/Inf counts."""
    return [
        {"path": name, "shape": list(x.shape), "dtype": str(x.dtype), **_stats(x)}
        for name, x in Arrays(resolve(ckpt))
    ]


def diff(a: str | Path, b: str | Path) -> dict:
    """Per-array max |a-b| and max |a-b| / max |b|; paths and shapes that differ."""
    da, db = resolve(a), resolve(b)
    ia, ib = array_infos(da), array_infos(db)
    left, right = Arrays(da), Arrays(db)
    common = [k for k in ia if k in ib and ia[k].shape == ib[k].shape]
    tensors = []
    for (name, x), (_, y) in zip(left.items(common), right.items(common), strict=True):
        x, y = x.astype(np.float64), y.astype(np.float64)
        err = float(np.max(np.abs(x - y), initial=0.0))
        scale = float(np.max(np.abs(y), initial=0.0))
        tensors.append({"path": name, "max_abs": err, "max_rel": err / scale if scale else err})
    return {
        "a": str(da),
        "b": str(db),
        "only_in_a": sorted(ia.keys() - ib.keys()),
        "only_in_b": sorted(ib.keys() - ia.keys()),
        "shapes_differ": [
            {"path": k, "a": list(ia[k].shape), "b": list(ib[k].shape)}
            for k in sorted(ia.keys() & ib.keys())
            if ia[k].shape != ib[k].shape
        ],
        "tensors": tensors,
        "identical": len(common) == len(ia) == len(ib) and all(t["max_abs"] == 0 for t in tensors),
    }


def config(ckpt: str | Path) -> dict:
    step_dir = resolve(ckpt)
    return {"path": str(step_dir), **saved_config(step_dir)}


def verify(ckpt: str | Path) -> dict:
    """Read every array: complete (all items, every array readable at its shape) and finite."""
    step_dir = resolve(ckpt)
    problems = [
        f"no '{item}' item" for item in ("state", "config") if not (step_dir / item).is_dir()
    ]
    count = size = 0
    try:
        infos = array_infos(step_dir)
        saved_config(step_dir)
        arrays = Arrays(step_dir)
    except CheckpointError as e:
        return {"path": str(step_dir), "arrays": 0, "bytes": 0, "problems": [str(e)], "ok": False}
    for run in arrays.batches():
        errors: list[CheckpointError] = []  # every unreadable array of the run, not the first
        read = arrays.read_many(run, errors)
        problems += [str(e) for e in errors]
        for name, x in read.items():
            count, size = count + 1, size + x.nbytes
            if tuple(x.shape) != infos[name].shape:
                problems.append(f"{name}: shape {x.shape}, metadata says {infos[name].shape}")
            bad = _stats(x)
            if bad["nan"] or bad["inf"]:
                problems.append(f"{name}: {bad['nan']} NaN and {bad['inf']} Inf values")
    return {
        "path": str(step_dir),
        "arrays": count,
        "bytes": size,
        "problems": problems,
        "ok": not problems,
    }
