"""What the analytic models need of a model: its parameters' paths, shapes and logical axes, and
how a layout splits them (the rule table's answer, without building a mesh)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from longt5_jax.formats.keypath import path_text
from longt5_jax.model import LongT5, LongT5Config, abstract_params
from longt5_jax.parallel.rules import Use, rules


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical, one per dim

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def stacked(self) -> bool:
        """A layer of a scanned stack (cut into stages by a pipeline)."""
        return "layers" in self.axes

    @property
    def matmul_kernel(self) -> bool:
        """A projection the layers run in the compute dtype (the LM head runs in float32)."""
        return self.path.endswith("kernel") and "logits_dense" not in self.path


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    config: LongT5Config
    leaves: tuple[Leaf, ...]
    opt_bytes_per_param_byte: float  # optimizer state bytes / parameter bytes

    @classmethod
    def of(cls, config: LongT5Config, optimizer: Any) -> ModelShapes:
        boxed = abstract_params(LongT5(config))
        specs = jax.tree.leaves(
            nn.get_partition_spec(boxed),
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
        )
        params = nn.unbox(boxed)
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        leaves = tuple(
            Leaf(
                path_text(path),
                tuple(x.shape),
                tuple(s) + (None,) * (len(x.shape) - len(s)),
            )
            for (path, x), s in zip(flat, specs, strict=True)
        )
        opt = jax.eval_shape(optimizer.init, params)
        opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt))
        return cls(config, leaves, opt_bytes / sum(4 * leaf.size for leaf in leaves))

    def split(
        self, leaf: Leaf, sizes: dict[str, int], use: Use, zero_stage: int, pipelined: bool
    ) -> int:
        """How many ways the rule table splits `leaf` for `use` on a mesh of `sizes`."""
        table: dict[str | None, str | None] = dict(rules(use, zero_stage, pipelined=pipelined))
        used, split = set(), 1
        for dim, axis in zip(leaf.shape, leaf.axes, strict=True):
            mesh_axis = table.get(axis)
            if mesh_axis and mesh_axis not in used and dim % sizes[mesh_axis] == 0:
                used.add(mesh_axis)
                split *= sizes[mesh_axis]
        return split

    def sharded_bytes(
        self,
        sizes: dict[str, int],
        use: Use,
        zero_stage: int,
        itemsize: int = 4,
        stack: str | None = None,
    ) -> float:
        """Per-device bytes of a parameter-shaped tree (or of the scanned layers of `stack`:
        "encoder" or "decoder") under the rule table for `use`."""
        pipelined = sizes.get("pipeline", 1) > 1
        return sum(
            itemsize * leaf.size / self.split(leaf, sizes, use, zero_stage, pipelined)
            for leaf in self.leaves
            if stack is None or (leaf.stacked and leaf.path.startswith(stack + "/"))
        )
