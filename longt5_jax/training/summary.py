"""What a run ends with, on process 0: the steps it trained, in how long and at what rate, its
last training and evaluation figures, where its files are and the commands that use them."""

from __future__ import annotations

import dataclasses
import shlex

from longt5_jax.training.experiment import Experiment
from longt5_jax.training.metrics import MetricsWriter


@dataclasses.dataclass(frozen=True)
class Trained:
    """What one invocation of the loop did."""

    first: int  # the step it started from (0: a new run)
    last: int  # the last step it trained, saved
    seconds: float  # wall time, start-up, compiles and evaluations included
    writer: MetricsWriter  # its rates and last rows


def text(exp: Experiment, trained: Trained) -> str:
    """The run's summary, several lines headed 'run summary:'."""
    writer, run = trained.writer, exp.run
    rate = writer.tokens_per_second()
    lines = [
        f"run summary: trained steps {trained.first + 1}-{trained.last} of {run.train_steps} in "
        f"{_duration(trained.seconds)}"
        + (f", {rate:,.0f} tokens/s after the first step" if rate else "")
    ]
    row = writer.last_train
    if row:
        lines.append(
            f"  train        step {row['step']:.0f}: loss {row['loss']:.4f}  "
            f"grad_norm {row.get('grad_norm', 0):.3f}  lr {row.get('learning_rate', 0):.2e}"
        )
    if writer.last_eval:
        shown = "  ".join(
            f"{k.removeprefix('eval/')} {v:,.0f}" if k == "eval/tokens" else
            f"{k.removeprefix('eval/')} {v:.4f}"
            for k, v in writer.last_eval.items() if k != "step"
        )  # fmt: skip
        lines.append(
            f"  eval         {writer.eval_split} at step {writer.last_eval['step']:.0f}: {shown}"
        )
    return "\n".join([*lines, files(exp, trained.last)])


def files(exp: Experiment, step: int) -> str:
    """Where the run's files are, and the commands to evaluate, predict with and export it."""
    model_dir = shlex.quote(exp.run.model_dir)
    return "\n".join(
        [
            f"  checkpoints  {exp.run.model_dir}/checkpoints (newest: step {step})",
            f"  metrics      {exp.run.model_dir}/metrics.jsonl",
            f"  TensorBoard  tensorboard --logdir {model_dir}/tensorboard",
            f"  evaluate     python -m longt5_jax.evaluate --gin_file={model_dir}/config.gin "
            f"--checkpoint={model_dir}",
            f"  predict      python -m longt5_jax.predict --checkpoint={model_dir} "
            "--input=DOCS.jsonl --output=PREDICTIONS.jsonl",
            f"  export       python -m longt5_jax.ckpt convert native-to-hf {model_dir} HF_DIR",
        ]
    )


def _duration(seconds: float) -> str:
    """'42.1 s', '12 min 5 s' or '3 h 20 min'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest} s"
    return f"{minutes // 60} h {minutes % 60} min"
