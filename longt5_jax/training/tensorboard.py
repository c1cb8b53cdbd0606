"""TensorBoard laid out as T5X lays it out: training and each evaluated split are runs of their own
(`MODEL_DIR/tensorboard/train`, `.../training_eval/<split>`) writing the same tag names, so eval
loss overlays train loss in one chart; the operative gin config is a text summary at step 0 and
the run's hyperparameters are in TensorBoard's HParams tab.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

TRAIN = "train"
EVAL = "training_eval"


class TensorBoard:
    """The run's TensorBoard writers, one per run directory, opened as they are first needed."""

    def __init__(
        self,
        model_dir: str | Path,
        resume_step: int = 0,
        config_text: str = "",
        hparams: dict[str, Any] | None = None,
    ):
        self.root = Path(model_dir) / "tensorboard"
        # A resumed run drops what an interrupted one logged after the step it resumes from,
        # as metrics.jsonl does: TensorBoard would otherwise draw both.
        self._purge = resume_step + 1 if resume_step else None
        self._writers: dict[str, Any] = {}
        train = self._writer(TRAIN)
        if not resume_step:
            if config_text:
                # Markdown: indented as code, so gin's lines keep their layout.
                text = "\n".join("    " + line for line in config_text.splitlines())
                train.add_text("config", text, 0)
            if hparams:
                _add_hparams(train, hparams)
        train.flush()

    def train(self, step: int, row: dict[str, float]) -> None:
        self._scalars(TRAIN, step, row)

    def eval(self, step: int, split: str, metrics: dict[str, float]) -> None:
        """`metrics` of an evaluation of `split`, under the training tags ('eval/loss' is 'loss'
        in the split's run)."""
        scalars = {k.removeprefix("eval/"): v for k, v in metrics.items()}
        self._scalars(f"{EVAL}/{split}", step, scalars)

    def close(self) -> None:
        """Close every writer; the first that cannot write what it holds (a full disk) raises
        its error once all are closed."""
        failed = None
        for writer in self._writers.values():
            try:
                writer.close()
            except OSError as e:
                failed = failed or e
                _abandon(writer)
        if failed is not None:
            raise failed

    def _scalars(self, run: str, step: int, values: dict[str, float]) -> None:
        writer = self._writer(run)
        for tag, value in values.items():
            if tag != "step":
                writer.add_scalar(tag, value, step)
        writer.flush()

    def _writer(self, run: str) -> Any:
        if run not in self._writers:
            writer = _summary_writer()(str(self.root / run), purge_step=self._purge)
            self._writers[run] = _synchronous(writer)
        return self._writers[run]


def _synchronous(writer: Any) -> Any:
    """`writer` writing each event in the calling thread. tensorboardX writes from a thread of
    its own, where a full disk is a traceback that stops the thread (and then every later event
    blocks on its full queue); here it is an OSError the metrics writer turns into one line.
    Every row is flushed as it is written anyway, so the thread saved nothing."""
    events = writer._get_file_writer().event_writer
    events._worker.stop()  # after writing what is queued (the run's start event)
    events.add_event = events._ev_writer.write_event
    return writer


def _abandon(writer: Any) -> None:
    """A writer whose events cannot be written: its file closed with what did fit, and marked
    closed, so that tensorboardX's exit hook does not try again (a traceback after our line)."""
    events = writer.file_writer.event_writer
    events._closed = True
    with contextlib.suppress(OSError):  # the file is closed even where its last flush fails
        events._ev_writer._py_recordio_writer._writer.close()


def _add_hparams(writer: Any, hparams: dict[str, Any]) -> None:
    """The HParams tab's session for this run, its metric the training loss (logged as 'loss'
    by the same run, so the tab reads it from there). Written into the run's own events file:
    `add_hparams` would open a run of its own and log the metric again there."""
    file_writer = writer._get_file_writer()
    for summary in _tensorboardx().summary.hparams(hparams, {"loss": None}):
        file_writer.add_summary(summary)


def _summary_writer() -> type:
    return _tensorboardx().SummaryWriter


def _tensorboardx() -> Any:
    """tensorboardX, imported without torch: where torch is installed, tensorboardX imports it
    only to accept its tensors (we log floats), which costs every training process seconds of
    start-up."""
    hidden = "torch" not in sys.modules
    if hidden:
        # `import torch` raises ImportError while this is set (typeshed allows modules only)
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import tensorboardX
        import tensorboardX.summary
    finally:
        if hidden:
            del sys.modules["torch"]
    return tensorboardX
