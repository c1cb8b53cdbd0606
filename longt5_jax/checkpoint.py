"""Orbax checkpoints of a run: train state, the data iterator's position and the gin config.

Saves are asynchronous and atomic (orbax writes to a temporary directory and renames it when
complete, so an interrupted save is never taken for a checkpoint); the run resumes from the
latest complete one in MODEL_DIR/checkpoints.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 1000  # steps; the last step is always saved
    keep: int = 3  # the most recent checkpoints kept
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this (0: none)

    def __post_init__(self):
        if self.save_every < 1 or self.keep < 1 or self.keep_every < 0:
            raise ValueError(f"{self}: expected save_every >= 1, keep >= 1, keep_every >= 0")


class Checkpoints:
    """Periodic saves and resume for one MODEL_DIR."""

    def __init__(self, model_dir: str | Path, cfg: CheckpointConfig):
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=cfg.save_every,
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_every or None,
            enable_async_checkpointing=True,
        )
        self.manager = ocp.CheckpointManager(
            (Path(model_dir) / "checkpoints").absolute(),
            options=options,
            item_names=("state", "data", "config"),
        )

    def save(
        self, step: int, state: Any, data_iterator: Any, config: str, force: bool = False
    ) -> bool:
        """Start saving `step` if it is due (or `force`); returns whether a save started."""
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(data_iterator),
                config=ocp.args.JsonSave({"gin": config}),
            ),
            force=force,
        )

    def due(self, step: int) -> bool:
        return self.manager.should_save(step)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int, abstract_state: Any, data_iterator: Any) -> Any:
        """The state at `step`, laid out as `abstract_state`; moves `data_iterator` there too."""
        where = Path(self.manager.directory) / str(step)
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=grain.checkpoint.CheckpointRestore(data_iterator),
                ),
            )
        except (ValueError, TypeError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"{where}: a checkpoint of another model or optimizer, which this "
                f"run cannot restore ({first[:300]})"
            ) from None
        return restored["state"]

    def close(self) -> None:
        """Wait for the last save to be complete on disk."""
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(state: Any) -> Any:
    """Shape, dtype and sharding of every array: the target a restore fills in place."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
