"""The train step as a pure function, and its sharded, jitted form.

Loss: token cross-entropy plus T5X's z-loss over `decoder_loss_weights`. Gradients of
microbatches are summed in a scan and normalised once by the whole batch's weight, so k
microbatches equal one big batch up to float rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, NotRequired, TypedDict, cast

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from longt5_jax.data.pipeline import GlobalBatch
from longt5_jax.model import LongT5, abstract_params, init_params
from longt5_jax.model.loss import eval_stats, summed_loss
from longt5_jax.parallel.mesh import ParallelConfig
from longt5_jax.parallel.offload import StateMemory, check_host_memory
from longt5_jax.parallel.region import ShardRegion
from longt5_jax.parallel.sharding import (
    activation_context,
    for_devices,
    kernels_interpreted,
    optimizer_shardings,
    placed,
    tree_shardings,
)
from longt5_jax.parallel.xla_options import compiler_options
from longt5_jax.training.loss_scale import LossScale
from longt5_jax.training.optim import moment_axes


class StepStats(TypedDict):
    """What a train step returns besides the state: its statistics, scalars on the devices."""

    loss: jax.Array  # per target token ('tokens' normalisation) or summed ('none')
    z_loss: jax.Array  # its z-loss part, normalised alike
    accuracy: jax.Array  # of the target tokens
    tokens: jax.Array  # the target tokens (loss weights) of the batch
    grad_norm: jax.Array
    nonfinite: jax.Array  # 1 where the step went bad (a NaN or Inf the scale does not explain)
    loss_scale: NotRequired[jax.Array]  # where the loss is scaled: the scale the step ran with
    skipped_steps: NotRequired[jax.Array]  # where the loss is scaled: updates skipped so far


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """How the loss is formed and accumulated."""

    z_loss: float = 1e-4
    # 'tokens': mean over target tokens; 'none': T5X's summed loss (loss_normalizing_factor=None).
    loss_normalization: Literal["tokens", "none"] = "tokens"
    microbatches: int = 1
    # 'bfloat16': differentiate w.r.t. bfloat16 copies of the parameters, so the cross-device
    # gradient reductions move half the bytes (the paper's half-precision gradient compression);
    # accumulation and the optimizer stay float32.
    grad_dtype: Literal["float32", "bfloat16"] = "float32"
    # A NaN/Inf loss or gradient stops the run (naming the step) unless updates are skipped.
    skip_nonfinite: bool = False
    # Dynamic loss scaling (training/loss_scale.py), which float16 needs: 'auto' scales when
    # LongT5Config.dtype is float16. A step whose gradients overflow is skipped and the scale
    # divided by the factor; after `loss_scale_period` finite steps it is multiplied by it. The
    # loss scaled is the token sum, so each token's cotangent is about the scale itself (a mean
    # loss would divide it by the tokens): 2^12 leaves float16's 2^16 a margin of 16.
    loss_scale: Literal["auto", "dynamic", "none"] = "auto"
    loss_scale_initial: float = 2.0**12
    loss_scale_period: int = 1000
    loss_scale_factor: int = 2

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise ValueError(f"StepConfig.microbatches={self.microbatches}: expected >= 1")
        if self.loss_scale not in ("auto", "dynamic", "none"):
            raise ValueError(
                f"StepConfig.loss_scale={self.loss_scale!r}: expected 'auto', 'dynamic' or 'none'"
            )
        for name, value, low in (
            ("loss_scale_initial", self.loss_scale_initial, 1),
            ("loss_scale_period", self.loss_scale_period, 1),
            ("loss_scale_factor", self.loss_scale_factor, 2),
        ):
            if not value >= low:
                raise ValueError(f"StepConfig.{name}={value!r}: expected >= {low}")

    def scales_loss(self, dtype: str) -> bool:
        """Whether a model computing in `dtype` trains with its loss scaled."""
        return self.loss_scale == "dynamic" or (self.loss_scale == "auto" and dtype == "float16")


@flax.struct.dataclass
class TrainState:
    """The state a step updates. The same tree holds its layout (shardings) and its abstract
    form (ShapeDtypeStructs), so its leaves are typed Any."""

    step: Any  # the updates made, a scalar int32
    params: Any
    opt_state: Any
    loss_scale: LossScale | None = None  # where the loss is scaled (float16)


def loss_and_grads(
    model: LongT5,
    cfg: StepConfig,
    params: Any,
    batch: GlobalBatch,
    rng: jax.Array | None,
    loss_scale: jax.Array | None = None,
) -> tuple[dict[str, jax.Array], Any]:
    """Summed statistics and summed gradients over `cfg.microbatches` slices of the batch; the
    gradients are of the loss times `loss_scale`, where one is given (the statistics are not)."""

    def loss(p: Any, b: GlobalBatch, r: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        total, stats = summed_loss(model, p, b, cfg.z_loss, r)
        return (total if loss_scale is None else total * loss_scale), stats

    raw_grad = jax.grad(loss, has_aux=True)

    def grad_fn(p: Any, b: GlobalBatch, r: jax.Array | None) -> tuple[Any, dict[str, jax.Array]]:
        if cfg.grad_dtype == "bfloat16":
            p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
        grads, stats = raw_grad(p, b, r)
        return jax.tree.map(lambda g: g.astype(jnp.float32), grads), stats

    if cfg.microbatches == 1:
        grads, stats = grad_fn(params, batch, rng)
        return stats, grads
    k = cfg.microbatches
    # Microbatch i is rows i, i + k, ...: each keeps its share of every shard of the rows, so
    # splitting moves nothing between devices.
    micro = jax.tree.map(
        lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch
    )

    def body(carry: Any, b: GlobalBatch) -> tuple[Any, None]:
        # Every microbatch reads the step's key: its rows' ids tell them apart.
        grads, stats = grad_fn(params, b, rng)
        return jax.tree.map(jnp.add, carry, (stats, grads)), None

    sums = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro), rng)[::-1]
    (stats, grads), _ = jax.lax.scan(body, jax.tree.map(_zeros, sums), micro)
    return stats, grads


def _zeros(like: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of `like`'s shape and type; inside a manual region, varying over the same axes
    (a sum carried through a loop must be typed like what is added to it)."""
    zeros = jnp.zeros(like.shape, like.dtype)
    manual = getattr(like, "manual_axis_type", None)
    vma: Any = getattr(like, "vma", None) or getattr(manual, "varying", ())
    varying = tuple(sorted(vma))
    return jax.lax.pcast(zeros, varying, to="varying") if varying else zeros


Gradients = Callable[
    [Any, GlobalBatch, "jax.Array | None", "jax.Array | None"], tuple[dict[str, jax.Array], Any]
]


def train_step(
    gradients: Gradients,
    cfg: StepConfig,
    optimizer: optax.GradientTransformation,
    grad_constraint: Callable[[Any], Any],
    memory: StateMemory,
    state: TrainState,
    batch: GlobalBatch,
    rng: jax.Array | None,
) -> tuple[TrainState, StepStats]:
    """One optimizer update. `gradients(params, batch, rng, loss_scale)` gives the summed
    statistics and gradients; `grad_constraint` lays gradients out (ZeRO-2 reduce-scatter);
    `memory` moves offloaded state to the device and back. Where the state has a loss scale,
    the gradients are unscaled with the normalisation, and an overflow skips the update."""
    old_params = memory.params_in(state.params)
    if rng is not None:  # dropout masks are drawn per row, from its index in the global batch
        rows = next(iter(batch.values())).shape[0]
        batch = dict(batch, row_ids=jnp.arange(rows, dtype=jnp.int32))
    scaler = state.loss_scale
    stats, grads = gradients(old_params, batch, rng, None if scaler is None else scaler.scale)
    scale = 1.0 / stats["weight"] if cfg.loss_normalization == "tokens" else 1.0
    unscale = scale if scaler is None else scale / scaler.scale
    grads = grad_constraint(jax.tree.map(lambda g: g * unscale, grads))
    old_opt, grads = memory.opt_in(state.opt_state, after=grads)
    updates, opt_state = optimizer.update(grads, old_opt, old_params)
    params = optax.apply_updates(old_params, updates)
    grad_norm = optax.tree.norm(grads)
    loss = stats["loss_sum"] * scale
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if cfg.skip_nonfinite or scaler is not None:  # keep the old state: nothing is poisoned
        params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (params, opt_state),
            (old_params, old_opt),
        )
    params, opt_state = memory.params_out(params), memory.opt_out(opt_state)
    metrics: StepStats = {
        "loss": loss,
        "z_loss": stats["z_loss_sum"] * scale,
        "accuracy": stats["correct"] / stats["weight"],
        "tokens": stats["weight"],
        "grad_norm": grad_norm,
        "nonfinite": 1 - finite.astype(jnp.int32),
    }
    if scaler is not None:
        # An overflow is the scale's business (skip, shrink), unless the loss itself is not
        # finite or the scale is at its floor: then the run has gone bad.
        bad = ~jnp.isfinite(loss) | (~finite & scaler.at_floor())
        metrics["nonfinite"] = bad.astype(jnp.int32)
        metrics["loss_scale"] = scaler.scale  # the scale this step ran with
        scaler = scaler.after(finite, cfg.loss_scale_period, cfg.loss_scale_factor)
        metrics["skipped_steps"] = scaler.skipped
    return TrainState(state.step + 1, params, opt_state, scaler), metrics


@dataclasses.dataclass
class ShardedStep:
    """A jitted train step and sharded initialiser for a model on a mesh, per a ParallelConfig."""

    model: LongT5
    step_cfg: StepConfig
    optimizer: optax.GradientTransformation
    mesh: Mesh
    parallel: ParallelConfig

    def __post_init__(self) -> None:
        self.model = cast(LongT5, for_devices(self.model, self.mesh))
        boxed = abstract_params(self.model)
        zero = self.parallel.zero_stage
        self.param_shardings = tree_shardings(boxed, self.mesh, "params", zero)
        self.grad_shardings = tree_shardings(boxed, self.mesh, "grads", zero)
        opt_layout = tree_shardings(boxed, self.mesh, "opt_state", zero)
        params = nn.unbox(boxed)
        opt_state = jax.eval_shape(self.optimizer.init, params)
        if self.parallel.offload != "none":
            check_host_memory(self.mesh.devices.flat[0])
        self.memory = StateMemory(
            self.param_shardings,
            optimizer_shardings(opt_state, params, opt_layout, self.mesh, moment_axes),
            self.parallel.offload,
        )
        replicated = NamedSharding(self.mesh, PartitionSpec())
        scaled = self.step_cfg.scales_loss(self.model.config.dtype)
        loss_scale = jax.eval_shape(self._loss_scale) if scaled else None
        # Between steps each part of the state lives where the plan says: device or host.
        self.state_shardings = TrainState(
            step=replicated,
            params=self.memory.params_home,
            opt_state=self.memory.opt_home,
            loss_scale=jax.tree.map(lambda _: replicated, loss_scale),
        )
        # The state as sharded ShapeDtypeStructs: what a restore fills in place and a compile
        # ahead of time takes, with nothing allocated.
        self.abstract_state = placed(
            TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state, loss_scale),
            self.state_shardings,
        )
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("data"))
        self._step: jax.stages.Wrapped | None = None
        # Accumulation and pipelines reduce once, from a region manual over data (and
        # pipeline); a plain step lets XLA reduce each layer's gradients as the backward pass
        # produces them, overlapping the reduction with the layers still to come.
        self.region = None
        if self.step_cfg.microbatches > 1 or self.parallel.pipeline > 1:
            reduce = jnp.bfloat16 if self.step_cfg.grad_dtype == "bfloat16" else jnp.float32
            pallas = self.model.config.attention_kernel == "pallas"
            self.region = ShardRegion(
                self.mesh,
                self.param_shardings,
                self.grad_shardings,
                self.parallel.pipeline_schedule(),
                reduce,
                # Interpreted kernels cannot run typed (region.py).
                typed=not (pallas and kernels_interpreted(self.mesh)),
            )
        offloaded = self.param_shardings if self.memory.params_offloaded else None
        self.evaluate = Evaluator(self.model, self.mesh, self.parallel, self.region, offloaded)

    def init(self, key: jax.Array) -> TrainState:
        """Parameters and optimizer state created directly in their shards."""

        def init(key: jax.Array) -> TrainState:
            params = nn.unbox(init_params(self.model, key))
            scale = None if self.abstract_state.loss_scale is None else self._loss_scale()
            return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params), scale)

        with self._context():
            state: TrainState = jax.jit(init, out_shardings=self.state_shardings)(key)
        return state

    def _loss_scale(self) -> LossScale:
        return LossScale.initial(self.step_cfg.loss_scale_initial)

    def _context(self) -> contextlib.ExitStack:
        return activation_context(self.mesh, self.parallel)

    def _constrain_grads(self, grads: Any) -> Any:
        return jax.lax.with_sharding_constraint(grads, self.grad_shardings)

    def _gradients(
        self, params: Any, batch: GlobalBatch, rng: jax.Array | None, scale: Any
    ) -> tuple[dict[str, jax.Array], Any]:
        local = functools.partial(loss_and_grads, self.model, self.step_cfg)
        if self.region is None:
            return local(params, batch, rng, scale)
        return self.region.grads(local, params, batch, rng, scale)

    def _jitted(self) -> jax.stages.Wrapped:
        if self._step is None:
            fn = functools.partial(
                train_step,
                self._gradients,
                self.step_cfg,
                self.optimizer,
                self._constrain_grads,
                self.memory,
            )
            self._step = jax.jit(
                fn,
                in_shardings=(self.state_shardings, self.batch_sharding, None),
                out_shardings=(self.state_shardings, None),
                donate_argnums=0,
                compiler_options=compiler_options(self.mesh.devices.flat[0].platform),
            )
        return self._step

    def __call__(
        self, state: TrainState, batch: GlobalBatch, rng: jax.Array | None = None
    ) -> tuple[TrainState, StepStats]:
        # Logical rules are read while tracing, so every trace happens inside them.
        with self._context():
            out: tuple[TrainState, StepStats] = self._jitted()(state, batch, rng)
        return out

    def lower(
        self, state: TrainState, batch: GlobalBatch, rng: jax.Array | None = None
    ) -> jax.stages.Lowered:
        with self._context():
            return self._jitted().lower(state, batch, rng)


@dataclasses.dataclass
class Evaluator:
    """The one eval-loss path: summed loss (no z-loss), weight and correct tokens of a global
    batch, no dropout, for parameters laid out per `parallel` on `mesh`. Training evaluates
    through its step's (`ShardedStep.evaluate`: pipelined layers run in the step's region,
    parameters kept in host memory are read onto the devices); `evaluate` builds one for a
    checkpoint on the decoding layout."""

    model: LongT5
    mesh: Mesh
    parallel: ParallelConfig
    region: ShardRegion | None = None  # the step's region, where the layers are pipelined
    offloaded_to: Any = None  # the device shardings of parameters that live in host memory

    def __call__(self, params: Any, batch: GlobalBatch) -> dict[str, jax.Array]:
        if self.offloaded_to is not None:
            params = jax.device_put(params, self.offloaded_to)
        with activation_context(self.mesh, self.parallel):
            stats: dict[str, jax.Array]
            if self.parallel.pipeline > 1:  # the pipeline runs in the region's stage axis
                stats = self._in_region(params, batch)
            else:
                stats = eval_stats(self.model, params, batch)
        return stats

    @functools.cached_property
    def _in_region(self) -> Callable[[Any, GlobalBatch], dict[str, jax.Array]]:
        def stats(params: Any, batch: GlobalBatch) -> dict[str, jax.Array]:
            return summed_loss(self.model, params, batch, 0.0, None)[1]

        assert self.region is not None  # a pipelined layout evaluates in the step's region
        return jax.jit(functools.partial(self.region.stats, stats))
