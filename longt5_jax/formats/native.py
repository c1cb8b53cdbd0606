"""Our checkpoints on disk, read without a run: step directories and their state (complete, a
save in progress, set aside as unreadable), each array's shape, dtype and saved sharding from
metadata alone, the saved config and tokenizer, and parameters restored into a given layout.
The checkpoint tools, `init_from`, inference and the resuming run all read through here.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from longt5_jax.errors import UsageError
from longt5_jax.formats.keypath import path_text
from longt5_jax.model.config import LongT5Config


class CheckpointError(UsageError):
    """A path that is not a usable checkpoint, in one line."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read (truncated, corrupt): an older one may serve."""


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    shape: tuple[int, ...]
    dtype: str
    sharding: str  # as saved: the partition spec and mesh, or 'single device'


def damaged(where: Path, step_dir: Path, why: str) -> CheckpointError:
    """A read of `step_dir` failed: damaged, or removed under the reader by the run that wrote
    it (a run keeps only its newest checkpoints), which a rerun reads past."""
    if not step_dir.exists():
        return CheckpointError(
            f"{step_dir}: removed while it was read (a running job keeps only its newest "
            "checkpoints); rerun to read the newest"
        )
    return DamagedCheckpoint(f"{where}: {why}")


def unreadable(e: BaseException) -> str:
    """One line for a read error: tensorstore's own reason (it names the array), not orbax's."""
    cause = e.__cause__ or e.__context__
    while cause is not None:
        e, cause = cause, cause.__cause__ or cause.__context__
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"unreadable: truncated or corrupt ({first[:300]})"


def quiet_failed_reads() -> None:
    """Keep a failed read to its one line: after the first read error orbax abandons its other
    reads, and each (or tensorstore's call back into the closed event loop) would print a
    traceback when collected."""
    if getattr(sys.unraisablehook, "quiet_failed_reads", False):
        return
    previous = sys.unraisablehook
    abandoned = ("Event loop is closed", "Encountered error while reading array")

    def hook(u):
        if not any(text in str(u.exc_value) for text in abandoned):
            previous(u)

    # A mark on the hook itself: a test runner swaps the hook in force (mypy models no
    # function attributes).
    hook.quiet_failed_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(
        lambda r: "exception was never retrieved" not in r.getMessage()
    )


_TMP = "orbax-checkpoint-tmp"  # in the name of a save in progress, until orbax commits it
UNREADABLE = ".unreadable"  # the suffix of a damaged checkpoint set aside by a resuming run


def is_complete(step_dir: Path) -> bool:
    return (
        _TMP not in step_dir.name
        and not step_dir.name.endswith(UNREADABLE)
        and (step_dir / "state").is_dir()
    )


def state_of(step_dir: Path) -> str:
    """'complete', 'unreadable' (set aside by a run that could not read it) or 'incomplete'
    (a save that did not finish)."""
    if is_complete(step_dir):
        return "complete"
    return "unreadable" if step_dir.name.endswith(UNREADABLE) else "incomplete"


def step_of(step_dir: Path) -> int | None:
    """The step a directory holds ('12', or '12.orbax-checkpoint-tmp' mid-save), or None."""
    head = step_dir.name.split(".")[0]
    return int(head) if head.isdigit() else None


def step_dirs(model_dir: str | Path) -> list[Path]:
    """Every step directory under MODEL_DIR (or its checkpoints/), complete or not, by step."""
    root = Path(model_dir)
    root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: (step_of(p), p.name))


def resolve(path: str | Path) -> Path:
    """The step directory CKPT names: itself, or the latest complete one of a MODEL_DIR."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_dir() and (p / "state").is_dir():
        if not is_complete(p):
            raise CheckpointError(f"{p}: an incomplete checkpoint (a save that did not finish)")
        return p
    complete = [d for d in step_dirs(p) if is_complete(d)] if p.is_dir() else []
    if not complete:
        raise CheckpointError(
            f"{p}: not a checkpoint (expected a step directory holding state/, or a MODEL_DIR "
            "with a complete checkpoint under checkpoints/)"
        )
    return complete[-1]


def _sharding_text(sharding: Any) -> str:
    spec = getattr(sharding, "partition_spec", None)
    if spec is None:
        return "single device"
    mesh = " x ".join(f"{n}{s}" for n, s in zip(sharding.axis_names, sharding.shape, strict=True))
    return f"{tuple(spec) or 'replicated'} over {mesh}"


def saved_tree(step_dir: Path, item: str = "state") -> Any:
    """The item's tree of orbax ArrayMetadata, read from metadata files only."""
    if not (step_dir / item).is_dir():
        raise CheckpointError(f"{step_dir}: no '{item}' in this checkpoint")
    _check_store(step_dir / item)
    try:  # the handler itself: orbax's Checkpointer.metadata turns read errors into None
        tree = ocp.PyTreeCheckpointHandler().metadata(step_dir / item)
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise damaged(step_dir / item, step_dir, f"metadata {unreadable(e)}") from None
    return getattr(tree, "tree", tree)


def _check_store(item_dir: Path) -> None:
    """Read every array's zarr header from the OCDBT store, one at a time.

    A damaged store then fails here with one error, instead of inside orbax's concurrent
    reads, whose other pending reads each print a traceback once its event loop has closed.
    """
    if not (item_dir / "manifest.ocdbt").exists():
        return  # not an OCDBT store: orbax reads it alone
    import tensorstore as ts  # only to name a damaged array: no other path reads it directly

    try:
        spec = {"driver": "ocdbt", "base": f"file://{item_dir.absolute()}/"}
        store = ts.KvStore.open(spec).result()
        for key in store.list().result():
            if key.endswith(b"/.zarray"):
                json.loads(store.read(key).result().value)
    except (ValueError, OSError) as e:
        raise damaged(item_dir, item_dir.parent, f"metadata {unreadable(e)}") from None


def array_infos(step_dir: Path, item: str = "state", tree: Any = None) -> dict[str, ArrayInfo]:
    """'params/encoder/.../kernel' -> shape, dtype and saved sharding, for every array
    (of `tree`, the item's `saved_tree`, when already read)."""
    tree = saved_tree(step_dir, item) if tree is None else tree
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        path_text(path): ArrayInfo(
            tuple(m.shape), str(m.dtype), _sharding_text(getattr(m, "sharding", None))
        )
        for path, m in leaves
    }


def _listing(names: list[str], most: int = 6) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_tree(where: Path, saved: dict[str, ArrayInfo], target: Any, hint: str = "") -> None:
    """Raise one error counting the paths in which `saved` and the `target` tree differ and
    naming the first few of each kind (a model of another width differs in every array)."""
    leaves = jax.tree_util.tree_flatten_with_path(target)[0]
    wanted = {path_text(p): tuple(x.shape) for p, x in leaves}

    def ordered(names):  # parameters first: optimizer paths mirror them
        return sorted(names, key=lambda k: (not k.startswith("params/"), k))

    only_saved = ordered(saved.keys() - wanted.keys())
    only_run = ordered(wanted.keys() - saved.keys())
    shapes = [
        f"{k} {saved[k].shape} vs {wanted[k]}"
        for k in ordered(saved.keys() & wanted.keys())
        if saved[k].shape != wanted[k]
    ]
    parts = [
        f"{label}: {_listing(names)}"
        for label, names in (
            ("only in the checkpoint", only_saved),
            ("only in this run", only_run),
            ("shapes differ (checkpoint vs this run)", shapes),
        )
        if names
    ]
    if parts:
        count = len(only_saved) + len(only_run) + len(shapes)
        raise CheckpointError(
            f"{where}: a checkpoint of another model or optimizer; "
            + "; ".join(parts)
            + f" ({count} arrays differ){hint}"
        )


def restore_params(path: str | Path, abstract_params: Any, hint: str = "") -> Any:
    """Only the parameters of the checkpoint CKPT names, laid out as `abstract_params`; `hint`
    ends the error where they are another model's (what the checkpoint was given as)."""
    step_dir = resolve(path)
    tree = saved_tree(step_dir)
    saved = {k: v for k, v in array_infos(step_dir, tree=tree).items() if k.startswith("params/")}
    check_tree(step_dir, saved, {"params": abstract_params}, hint)
    skip = jax.tree.map(lambda _: ocp.PLACEHOLDER, tree)  # orbax skips these
    item = skip | {"params": abstract_params}
    restore_args = skip | {"params": ocp.checkpoint_utils.construct_restore_args(abstract_params)}
    quiet_failed_reads()
    try:
        out = ocp.PyTreeCheckpointer().restore(
            step_dir / "state", args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
        )
    except Exception as e:  # orbax passes on tensorstore's read errors as bare Exceptions
        raise damaged(step_dir, step_dir, unreadable(e)) from None
    return out["params"]


def saved_config(step_dir: Path) -> dict:
    """The config item: {'gin': operative config text, 'model': LongT5Config fields}."""
    path = step_dir / "config" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        if not step_dir.exists():
            raise damaged(path, step_dir, "") from None
        raise CheckpointError(f"{path}: no readable saved config ({e})") from None


def saved_tokenizer(step_dir: Path) -> bytes | None:
    """The SentencePiece model saved with the checkpoint, or None (converted checkpoints)."""
    path = step_dir / "tokenizer" / "metadata"
    if not path.exists():
        return None
    try:
        return base64.b64decode(json.loads(path.read_text())["sentencepiece_model"], validate=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable saved tokenizer ({e})") from None


def model_config(step_dir: Path) -> LongT5Config:
    """The LongT5Config the checkpoint was trained with."""
    fields = saved_config(step_dir).get("model")
    if not isinstance(fields, dict):
        raise CheckpointError(f"{step_dir}: the saved config has no model fields")
    try:
        return LongT5Config(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{step_dir}: saved model config not understood ({e})") from None
