"""One run's whole configuration as one frozen, typed object: what every command is given.

`configuration.from_args` fills it from gin; everything below the commands reads its typed
sections, never a dict of configs. It lives at the top of the library (it names each layer's
config) so that the loop can take it without reaching up to gin.
"""

from __future__ import annotations

import dataclasses
import typing

from longt5_jax.data.pipeline import DataConfig
from longt5_jax.infer.decode import DecodeConfig
from longt5_jax.infer.evaluation import EvalConfig
from longt5_jax.model.config import LongT5Config
from longt5_jax.parallel.mesh import ParallelConfig, check_fits
from longt5_jax.training.checkpoint import CheckpointConfig
from longt5_jax.training.optim import OptimizerConfig
from longt5_jax.training.run_config import RunConfig
from longt5_jax.training.step import StepConfig


@dataclasses.dataclass(frozen=True)
class Experiment:
    """The sections of a run. A command that needs only some (the data preview: `data`) builds
    those; the others are None."""

    run: RunConfig | None = None
    model: LongT5Config | None = None
    data: DataConfig | None = None
    parallel: ParallelConfig | None = None  # the mesh, ZeRO stage, pipeline and offload
    optim: OptimizerConfig | None = None
    step: StepConfig | None = None
    ckpt: CheckpointConfig | None = None
    eval: EvalConfig | None = None
    decode: DecodeConfig | None = None

    @classmethod
    def section_types(cls) -> dict[str, type]:
        """Each section's name and its config class (gin binds the class by its name)."""
        hints = typing.get_type_hints(cls)
        return {f.name: typing.get_args(hints[f.name])[0] for f in dataclasses.fields(cls)}

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

    def hparams(self) -> dict[str, str | int | float | bool]:
        """Every scalar setting of the built sections as 'section.field' (for TensorBoard's
        HParams tab, where runs are compared by them)."""
        return {
            f"{f.name}.{key}": value
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
            for key, value in dataclasses.asdict(getattr(self, f.name)).items()
            if isinstance(value, str | int | float | bool)
        }

    def summary(self) -> str:
        """One line per built section, for `--print_config` when gin has no operative text."""
        return "\n".join(
            f"{f.name}: {getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        )
