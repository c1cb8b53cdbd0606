"""Storage: MODEL_DIR creatable and writable (a probe file, created and removed: nothing of a
run), free space against one checkpoint, the cache variables, the tokenizer and the first
record of each data file (read by the data layer's own readers)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from longt5_jax import environment
from longt5_jax.data import cache_dir
from longt5_jax.data.pipeline import load_tokenizer, open_split
from longt5_jax.data.sources import expand, open_source
from longt5_jax.doctor.report import Row, fail, ok, warn
from longt5_jax.errors import UsageError
from longt5_jax.estimate.shapes import ModelShapes
from longt5_jax.training.experiment import Experiment

DEMO_EPOCHS = 100  # the demo itself trains 3


def model_dir_row(model_dir: Path) -> Row:
    problem = environment.writable_problem(model_dir)
    if problem:
        return fail(
            "storage",
            "MODEL_DIR",
            f"{model_dir}: {problem}",
            "set MODEL_DIR to a writable directory on shared storage",
        )
    state = "exists" if model_dir.is_dir() else "can be created"
    return ok("storage", "MODEL_DIR", f"{model_dir} {state} and is writable")


def checkpoint_bytes(shapes: ModelShapes) -> float:
    """One checkpoint: the float32 parameters and the optimizer state."""
    params = sum(4 * leaf.size for leaf in shapes.leaves)
    return params * (1 + shapes.opt_bytes_per_param_byte)


def space_row(model_dir: Path, shapes: ModelShapes, keep: int) -> Row:
    existing = next(p for p in (model_dir, *model_dir.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    size = checkpoint_bytes(shapes)
    detail = f"{free / 2**30:.1f} GiB free at {existing}; a checkpoint is {size / 2**30:.3f} GiB"
    if free < size:
        return fail("storage", "free space", detail, "free space, or set MODEL_DIR elsewhere")
    if free < (keep + 1) * size:
        return warn(
            "storage",
            "free space",
            f"{detail}, {keep} kept (CheckpointConfig.keep) and one being written do not fit",
            "free space or keep fewer",
        )
    return ok("storage", "free space", detail)


def cache_rows() -> list[Row]:
    rows = []
    for name, holds in environment.CACHES.items():
        value = os.environ.get(name)
        problem = environment.cache_problems().get(name)
        if problem:
            rows.append(
                fail(
                    "storage",
                    name,
                    f"{value}: {problem} (a run would go without its cache of {holds})",
                    f"point {name} to a writable directory, or unset it",
                )
            )
        elif value:
            rows.append(ok("storage", name, f"{value} is writable ({holds})"))
        else:
            rows.append(_unset_cache_row(name, holds))
    return rows


def _unset_cache_row(name: str, holds: str) -> Row:
    """A cache variable left unset: the derived files go to the default directory, which must
    be writable; compiled programs are not kept, so each process of each job compiles anew."""
    if name != "LONGT5_JAX_CACHE":
        return ok("storage", name, f"unset: no cache of {holds} (export it to reuse them)")
    default = cache_dir()
    problem = environment.writable_problem(default)
    if problem:
        return fail(
            "storage", name, f"unset, and its default {default}: {problem}",
            f"export {name}=<a writable directory>",
        )  # fmt: skip
    return ok("storage", name, f"unset: {default} is writable ({holds})")


def data_rows(exp: Experiment) -> list[Row]:
    """The tokenizer loads (the default one is trained, or found in the cache) and each data
    file's first record reads."""
    rows = []
    try:
        tokenizer = load_tokenizer(exp.data)
        rows.append(ok("storage", "tokenizer", f"{tokenizer.path} ({tokenizer.vocab_size} ids)"))
    except (UsageError, OSError) as e:
        rows.append(
            fail(
                "storage",
                "tokenizer",
                _line(e),
                "set DataConfig.tokenizer to a readable SentencePiece model",
            )
        )
    if exp.data.task == "aclsum":
        return [*rows, demo_data_row(exp)]
    for field in ("train_files", "eval_files"):
        rows += _files_rows(exp, field)
    return rows


def demo_data_row(exp: Experiment) -> Row:
    """The embedded demo set is for the demo: a run that would pass over it more than
    `DEMO_EPOCHS` times (the reference pretraining without data files: a million steps of 128
    on 150 papers) has forgotten to configure its data."""
    papers = len(open_split(exp.data, "train"))
    epochs = exp.run.train_steps * exp.data.batch_size / papers
    detail = f"aclsum, the embedded demo set ({papers} training papers, {epochs:.0f} epochs)"
    if epochs > DEMO_EPOCHS:
        return fail(
            "storage",
            "data",
            detail,
            "set DataConfig.task='files' and "
            "DataConfig.train_files (configs/data/files_16k.gin), or train the demo "
            "(configs/demo.gin)",
        )
    return ok("storage", "data", detail)


def _files_rows(exp: Experiment, field: str) -> list[Row]:
    given = getattr(exp.data, field)
    name = f"DataConfig.{field}"
    if not given:
        if field == "eval_files":
            return [ok("storage", name, "none (no evaluation data)")]
        return [fail("storage", name, "empty", f"set {name} to the run's data files")]
    rows = []
    for pattern in given:
        try:
            for path in expand([pattern]):
                source = open_source([path], exp.data.input_field, exp.data.target_field)
                source[0]  # noqa: B018  (read the first record)
                rows.append(ok("storage", name, f"{path}: {len(source)} records, the first reads"))
        except (UsageError, OSError, IndexError) as e:
            rows.append(
                fail(
                    "storage",
                    name,
                    f"{pattern}: {_line(e)}",
                    f"fix {name} (a readable file or glob)",
                )
            )
    return rows


def _line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or e}"
    return " ".join(str(e).split()) or type(e).__name__
