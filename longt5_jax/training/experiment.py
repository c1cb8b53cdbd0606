"""One run's whole configuration as one frozen, typed object: what every command is given.

`configuration.from_args` fills it from gin; everything below the commands reads its typed
sections, never a dict of configs. It lives at the top of the library (it names each layer's
config) so that the loop can take it without reaching up to gin. A command that builds fewer
sections declares its own frozen record of exactly those (evaluate's, the data preview's): any
dataclass whose fields are sections works with `section_types`, `hparams` and `summary`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, Protocol

from longt5_jax.data.pipeline import DataConfig
from longt5_jax.infer.decode import DecodeConfig
from longt5_jax.infer.evaluation import EvalConfig
from longt5_jax.model.config import LongT5Config
from longt5_jax.parallel.mesh import ParallelConfig, check_fits
from longt5_jax.training.checkpoint import CheckpointConfig
from longt5_jax.training.optim import OptimizerConfig
from longt5_jax.training.run_config import RunConfig
from longt5_jax.training.step import StepConfig


class Sections(Protocol):
    """A dataclass whose fields are config sections: `Experiment`, or a command's own record."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


@dataclasses.dataclass(frozen=True)
class Sizing:
    """The sections whose sizes a parallel layout must divide: the model, the batch, the
    layout itself and the step's accumulation."""

    model: LongT5Config
    data: DataConfig
    parallel: ParallelConfig
    step: StepConfig

    def check_fits(self, num_devices: int) -> None:
        """One line naming the setting when the parallel layout does not divide `num_devices`,
        the model (heads, MLP, vocabulary over tensor; layers over pipeline stages) or the batch
        (over data, accumulation and pipeline microbatches)."""
        model = self.model
        check_fits(
            self.parallel,
            num_devices,
            split={
                "LongT5Config.num_heads": model.num_heads,
                "LongT5Config.d_ff": model.d_ff,
                "LongT5Config.vocab_size": model.vocab_size,
            },
            batch=("DataConfig.batch_size", self.data.batch_size),
            stacks={
                "LongT5Config.num_encoder_layers": model.num_encoder_layers,
                "LongT5Config.num_decoder_layers": model.num_decoder_layers,
            },
            accumulation=("StepConfig.microbatches", self.step.microbatches),
        )


@dataclasses.dataclass(frozen=True)
class Experiment:
    """The sections of a run: what training (and the doctor, which checks a run) builds."""

    run: RunConfig
    model: LongT5Config
    data: DataConfig
    parallel: ParallelConfig  # the mesh, ZeRO stage, pipeline and offload
    optim: OptimizerConfig
    step: StepConfig
    ckpt: CheckpointConfig
    eval: EvalConfig
    decode: DecodeConfig

    def check_fits(self, num_devices: int) -> None:
        """`Sizing.check_fits` of the run's sections."""
        sizing = Sizing(model=self.model, data=self.data, parallel=self.parallel, step=self.step)
        sizing.check_fits(num_devices)


def section_types(record: type[Sections]) -> dict[str, type]:
    """Each section's name and its config class (gin binds the class by its name)."""
    hints = typing.get_type_hints(record)
    return {f.name: hints[f.name] for f in dataclasses.fields(record)}


def hparams(sections: Sections) -> dict[str, str | int | float | bool]:
    """Every scalar setting of the sections as 'section.field' (for TensorBoard's HParams tab,
    where runs are compared by them); a list of names, which the tab cannot show, as one
    comma-joined string."""
    found: dict[str, str | int | float | bool] = {}
    for f in dataclasses.fields(sections):
        for key, value in dataclasses.asdict(getattr(sections, f.name)).items():
            if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
                value = ",".join(value)
            if isinstance(value, str | int | float | bool):
                found[f"{f.name}.{key}"] = value
    return found


def summary(sections: Sections) -> str:
    """One line per section, for `--print_config` when gin has no operative text."""
    return "\n".join(f"{f.name}: {getattr(sections, f.name)}" for f in dataclasses.fields(sections))
