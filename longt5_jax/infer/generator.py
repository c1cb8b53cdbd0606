"""A checkpoint made ready to decode on a mesh: its model, sharded parameters and tokenizer.

Decoding runs on the same mesh and rule table as training: rows over `data`, heads, MLP and
vocabulary over `tensor`. Parameters are laid out per the ZeRO stage given (0 keeps a full
replica per data rank, the fastest for decoding).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from longt5_jax.data.tokenizer import Tokenizer
from longt5_jax.formats.native import CheckpointError, model_config, restore_params, saved_tokenizer
from longt5_jax.infer.decode import DecodeConfig, generate
from longt5_jax.model import LongT5, LongT5Config, abstract_params
from longt5_jax.parallel.mesh import ParallelConfig, make_mesh
from longt5_jax.parallel.sharding import activation_context, for_devices, placed, tree_shardings


def load_tokenizer_for(step_dir: Path, override: str = "") -> Tokenizer:
    """The tokenizer saved in the checkpoint, or `override` (a SentencePiece model file)."""
    if override:
        return Tokenizer(override)
    proto = saved_tokenizer(step_dir)
    if proto is None:
        raise CheckpointError(
            f"{step_dir}: holds no tokenizer (a converted checkpoint, or saved before tokenizers "
            "were saved): pass --tokenizer=PATH to its SentencePiece model"
        )
    try:
        return Tokenizer(step_dir / "tokenizer", proto)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def param_shardings(config: LongT5Config, mesh: Mesh, zero_stage: int) -> Any:
    """How the parameters lie on `mesh` per the rule table."""
    return tree_shardings(abstract_params(LongT5(config)), mesh, "params", zero_stage)


def restore_target(config: LongT5Config, mesh: Mesh, zero_stage: int) -> Any:
    """Shapes, dtypes and shardings of the parameters: the target a restore fills."""
    boxed = abstract_params(LongT5(config))
    return placed(nn.unbox(boxed), tree_shardings(boxed, mesh, "params", zero_stage))


@dataclasses.dataclass
class Generator:
    """Decodes batches of token ids with `params` laid out on `mesh`."""

    model: LongT5
    params: Any
    mesh: Mesh
    parallel: ParallelConfig
    decode: DecodeConfig
    length: int  # decoded tokens at most

    def __post_init__(self):
        self.model = for_devices(self.model, self.mesh)
        self.rows = NamedSharding(self.mesh, PartitionSpec("data"))

    def __call__(
        self, ids: np.ndarray, mask: np.ndarray, rng: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """([B, length] tokens, [B] scores) for this process's rows `ids`, `mask` [b, L]."""
        rows, masks = (jax.make_array_from_process_local_data(self.rows, x) for x in (ids, mask))
        with activation_context(self.mesh, self.parallel):
            return generate(self.model, self.params, rows, masks, self.decode, self.length, rng)

    def tokens(self, ids: np.ndarray, mask: np.ndarray) -> jax.Array:
        return self(ids, mask)[0]


def for_decoding(parallel: ParallelConfig) -> ParallelConfig:
    """`plan` for decoding: the cache-driven decoder is not pipelined, so stages become data."""
    return dataclasses.replace(parallel, data=-1, pipeline=1, pipeline_microbatches=0)


def from_checkpoint(
    step_dir: Path, parallel: ParallelConfig, decode: DecodeConfig, length: int
) -> tuple[Generator, LongT5Config]:
    """A generator holding the checkpoint's parameters on a mesh of all devices per `plan`,
    with the attention that runs on them: the training run chose its own for its devices (a
    GPU's kernels would run interpreted on CPUs, and not at all on a V100), and either gives
    the same values to float rounding (`identity.FREE_FIELDS`)."""
    config = dataclasses.replace(model_config(step_dir), attention_kernel="auto")
    parallel = for_decoding(parallel)
    mesh = make_mesh(parallel)
    params = restore_params(step_dir, restore_target(config, mesh, parallel.zero_stage))
    return Generator(LongT5(config), params, mesh, parallel, decode, length), config
