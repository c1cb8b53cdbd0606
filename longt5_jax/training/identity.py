"""What a run is: its tokenizer (by content), model config and data objective, pinned at start.

A run that resumes with another tokenizer goes on training embeddings whose ids now mean other
pieces, and its later checkpoints carry another SentencePiece model than its earlier ones;
another objective or model is another run too. So a fresh run records all three in
MODEL_DIR/run.json, and a resume (a checkpoint in MODEL_DIR) with a different one is refused,
naming each difference, before any state is built. Starting a new run from this one's
parameters (`CheckpointConfig.init_from`) is how to change them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

from longt5_jax.errors import UsageError
from longt5_jax.formats.atomic import write_atomic
from longt5_jax.formats.native import (
    CheckpointError,
    is_complete,
    saved_config,
    saved_tokenizer,
    step_dirs,
)

IDENTITY_NAME = "run.json"  # one of cli.RUN_FILES: no command writes over it
# How the same values are computed, not which: remat recomputes activations in the backward
# pass (a resume may switch it to fit memory on other devices), attention_kernel picks the XLA
# path or the fused kernels (equal to float rounding), scan_layers a scan over the layers or the
# layers unrolled, cast_params where the layers' parameters become the compute dtype. A resume
# may change them and still be the same run.
FREE_FIELDS = ("remat", "attention_kernel", "scan_layers", "cast_params")


class IdentityError(UsageError):
    """A resume whose tokenizer, model or objective is not the run's."""


def of(tokenizer_proto: bytes, tokenizer_path: str, model, objective: str) -> dict:
    """The identity of a run with this tokenizer (its serialized model), LongT5Config and
    objective."""
    fields = {k: v for k, v in dataclasses.asdict(model).items() if k not in FREE_FIELDS}
    return {
        "tokenizer_sha256": hashlib.sha256(tokenizer_proto).hexdigest(),
        "tokenizer": tokenizer_path,
        "model": fields,
        "objective": objective,
    }


def check(model_dir: str | Path, current: dict) -> None:
    """Refuse to resume the run in `model_dir` as another run; nothing to check where it has
    no checkpoint (a fresh start, or one whose saves never finished)."""
    model_dir = Path(model_dir)
    steps = [d for d in step_dirs(model_dir) if is_complete(d)] if model_dir.is_dir() else []
    if not steps:
        return
    saved = _recorded(model_dir) or _from_checkpoint(steps[-1])
    differences = _differences(saved, current)
    if differences:
        raise IdentityError(
            f"MODEL_DIR={model_dir} holds a run with {'; '.join(differences)}: resuming it so "
            "would train another run into its checkpoints; restore the run's settings, or start "
            f"a new MODEL_DIR from it with CheckpointConfig.init_from='{model_dir}'"
        )


def record(model_dir: str | Path, current: dict) -> None:
    """Pin `current` as the run's identity (a fresh run, or one started before runs had one)."""
    write_atomic(Path(model_dir) / IDENTITY_NAME, json.dumps(current, indent=1) + "\n")


def recorded(model_dir: str | Path) -> bool:
    return (Path(model_dir) / IDENTITY_NAME).is_file()


def _recorded(model_dir: Path) -> dict | None:
    path = model_dir / IDENTITY_NAME
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise IdentityError(f"{path}: unreadable ({e}); it pins the run's identity") from None
    if not isinstance(saved, dict):
        raise IdentityError(f"{path}: not a JSON object; it pins the run's identity")
    return saved


def _from_checkpoint(step_dir: Path) -> dict:
    """What a checkpoint of a run without run.json says of it: its tokenizer and model, and the
    objective where its gin text binds one."""
    try:
        config = saved_config(step_dir)
        proto = saved_tokenizer(step_dir)
    except CheckpointError:
        return {}  # said in full by the resume, which reads the same files
    found = re.findall(r"^DataConfig\.objective\s*=\s*'(\w+)'", config.get("gin", ""), re.M)
    saved = {"model": config.get("model")}
    if proto is not None:
        saved |= {"tokenizer_sha256": hashlib.sha256(proto).hexdigest(), "tokenizer": str(step_dir)}
    return saved | ({"objective": found[-1]} if found else {})


def _differences(saved: dict, current: dict) -> list[str]:
    """Each difference in one phrase: what the run was started with, and what is given now."""
    out = []
    if saved.get("tokenizer_sha256") not in (None, current["tokenizer_sha256"]):
        out.append(
            f"another tokenizer (sha256 {saved['tokenizer_sha256'][:12]}, from "
            f"{saved.get('tokenizer')}; now {current['tokenizer_sha256'][:12]}, from "
            f"{current['tokenizer']}: DataConfig.tokenizer)"
        )
    if saved.get("objective") not in (None, current["objective"]):
        out.append(f"DataConfig.objective={saved['objective']!r} (now {current['objective']!r})")
    model = saved.get("model")
    model = model if isinstance(model, dict) else {}
    for field, value in model.items():
        now = current["model"].get(field, value)
        if field not in FREE_FIELDS and now != value:
            out.append(f"LongT5Config.{field}={value!r} (now {now!r})")
    return out
