"""Orbax checkpoints of a run: train state, the data stream's position and the gin config.

Saves are asynchronous and atomic (orbax writes to a temporary directory and renames it when
complete, so an interrupted save is never taken for a checkpoint); the run resumes from the
latest complete one in MODEL_DIR/checkpoints. A checkpoint's tree is read from its metadata
alone, so a restore that cannot fit names every differing path before touching an array.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from longt5_jax.errors import RunFault
from longt5_jax.formats.native import (
    UNREADABLE,
    CheckpointError,
    DamagedCheckpoint,
    array_infos,
    check_tree,
    is_complete,
    quiet_failed_reads,
    step_dirs,
    unreadable,
)
from longt5_jax.training.distributed import agree


class DiskFull(RunFault):
    """A save that ran out of space: the run stops; its last complete checkpoint is intact."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 1000  # steps; the last step is always saved
    keep: int = 3  # the most recent checkpoints kept
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this (0: none)
    # A fresh run (no checkpoint in MODEL_DIR yet) takes its parameters from this checkpoint or
    # MODEL_DIR; the optimizer and the step start anew. This is how fine-tuning starts.
    init_from: str = ""

    def __post_init__(self):
        if self.save_every < 1 or self.keep < 1 or self.keep_every < 0:
            raise ValueError(f"{self}: expected save_every >= 1, keep >= 1, keep_every >= 0")


class Checkpoints:
    """Periodic saves and resume for one MODEL_DIR."""

    def __init__(self, model_dir: str | Path, cfg: CheckpointConfig, tokenizer: bytes = b""):
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=cfg.save_every,
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_every or None,
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,  # what a killed save left behind
            create=False,  # made by the first save: a run that cannot start writes nothing
        )
        self.manager = ocp.CheckpointManager(
            (Path(model_dir) / "checkpoints").absolute(),
            options=options,
            item_names=("state", "data", "config", "tokenizer"),
        )
        # The SentencePiece model travels in every checkpoint, so that evaluate and predict
        # decode with the ids it was trained on, wherever the step directory is copied.
        self.tokenizer = {"sentencepiece_model": base64.b64encode(tokenizer).decode("ascii")}
        self._saving: tuple[int, int] | None = None  # (step, state bytes) of the newest save
        self._stopped = False

    def save(self, step: int, state: Any, data_iterator: Any, config: dict, force=False) -> bool:
        """Start saving `step` if it is due (or `force`); returns whether a save started.

        `config` is the config item: {'gin': operative config text, 'model': LongT5Config dict}.
        """
        items = {
            "state": ocp.args.StandardSave(state),
            # Where the data stream stands, in global terms (every process takes part).
            "data": ocp.args.JsonSave(data_iterator.state()),
            "config": ocp.args.JsonSave(config),
        }
        if self.tokenizer["sentencepiece_model"]:
            items["tokenizer"] = ocp.args.JsonSave(self.tokenizer)
        Path(self.manager.directory).mkdir(parents=True, exist_ok=True)
        # A save that failed in the background (a full disk) is raised here, by the next one.
        with self._failed_saves():
            started = self.manager.save(step, args=ocp.args.Composite(**items), force=force)
        if started:
            self._saving = (step, sum(x.nbytes for x in jax.tree.leaves(state)))
        return started

    def due(self, step: int) -> bool:
        return self.manager.should_save(step)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int, abstract_state: Any, data_iterator: Any) -> Any:
        """The state at `step`, laid out as `abstract_state`; moves `data_iterator` there too."""
        where = Path(self.manager.directory) / str(step)
        saved = array_infos(where)
        hint = ""
        if not any(p.startswith("opt_state/") for p in saved):
            hint = "; it holds parameters only: start from it with CheckpointConfig.init_from"
        check_tree(where, saved, abstract_state, hint)
        if not (where / "data" / "metadata").exists():
            raise CheckpointError(
                f"{where}: no data position in global terms (a checkpoint of an earlier "
                "version); start from it with CheckpointConfig.init_from"
            )
        items = {"state": ocp.args.StandardRestore(abstract_state), "data": ocp.args.JsonRestore()}
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # orbax passes on tensorstore's read errors as bare Exceptions
            raise DamagedCheckpoint(f"{where}: {unreadable(e)}") from None
        try:
            data_iterator.restore(restored["data"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{where / 'data'}: {e}") from None
        return restored["state"]

    def resume(self, abstract_state: Any, data_iterator: Any) -> tuple[int, Any]:
        """(step, state) of the newest readable checkpoint, or (0, None) where there is none.

        Damaged newer ones are set aside as STEP.unreadable, their files untouched, each with
        a one-line warning; where none is readable, nothing moves and one line says why.
        Every process agrees on each outcome.
        """
        quiet_failed_reads()
        damaged: dict[int, str] = {}  # step -> why it is unreadable
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                error, state = None, self.restore(step, abstract_state, data_iterator)
            except DamagedCheckpoint as e:
                error, state = str(e), None
            if agree(error is None):
                for bad, why in damaged.items():
                    self._set_aside(bad)
                    if jax.process_index() == 0:
                        print(
                            f"warning: checkpoint {why}; resuming from step {step}", file=sys.stderr
                        )
                return step, state
            damaged[step] = error or f"{step}: unreadable on another process"
        if damaged:
            raise CheckpointError(f"no readable checkpoint: {' | '.join(damaged.values())}")
        return 0, None

    def _set_aside(self, step: int) -> None:
        """Rename a damaged step directory so that no save or clean-up ever touches it."""
        where = Path(self.manager.directory) / str(step)
        if jax.process_index() == 0:
            aside, k = where.with_name(f"{step}{UNREADABLE}"), 1
            while aside.exists():  # set aside at this step before
                aside, k = where.with_name(f"{step}.{k}{UNREADABLE}"), k + 1
            where.rename(aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        self.manager.reload()

    def close(self) -> None:
        """Wait for the last save to be complete on disk."""
        if not self._stopped:
            with self._failed_saves():
                self.manager.wait_until_finished()
        with contextlib.suppress(Exception):  # after a failed save, its error is already said
            self.manager.close()

    @contextlib.contextmanager
    def _failed_saves(self):
        """A save that ran out of space becomes one `DiskFull` line; its partial directory
        is removed (orbax would remove it on the next start too)."""
        try:
            yield
        except Exception as e:
            if not _no_space(e) or self._saving is None:
                raise
            self._stopped = True
            raise self._disk_full(*self._saving) from None

    def _disk_full(self, step: int, needed: int) -> DiskFull:
        directory = Path(self.manager.directory)
        with contextlib.suppress(Exception):  # the save's other writers end, failing too
            self.manager.wait_until_finished()
        if jax.process_index() == 0:
            for partial in directory.glob(f"{step}.*orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        complete = [p.name for p in step_dirs(directory) if is_complete(p)]
        free = shutil.disk_usage(directory).free
        last = (
            f"step {complete[-1]} is the last complete checkpoint" if complete else "no step saved"
        )
        return DiskFull(
            f"{directory}: no space left on device saving step {step} (about "
            f"{needed / 2**20:,.1f} MiB needed, {free / 2**20:,.1f} MiB free); {last}: free "
            "space and rerun the same command to resume"
        )


def _no_space(e: BaseException | None) -> bool:
    """Whether `e` or what caused it is a full disk (tensorstore says it in its message)."""
    while e is not None:
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False
