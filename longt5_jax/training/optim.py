"""Optimizers and learning-rate schedules: AdamW, and Adafactor with T5X's settings.

Scanned stacks give their parameters a leading layers axis: every leaf with a `layers` key in its
path is [layers, ...]. T5X treats that axis as a BATCH factor dim, so Adafactor's per-parameter
statistics (factored second moments, update clipping RMS, parameter scale) are taken per layer
here too, and a stacked [L, ...] leaf is updated exactly as L separate leaves would be.

Factoring rule (T5X's `standard_logical_factor_rules` for our kernels, read from shapes): the
non-layer axes are viewed as a matrix whose one side is the largest axis and whose other side is
all the remaining axes; the side holding the first non-layer axis is the rows. So [L, d, f] is
factored as d x f, q/k/v kernels [L, d, h, k] as d x (h k) and out kernels [L, h, k, d] as
(h k) x d: the 2-D [d, heads * d_kv] kernels T5X trained LongT5 with. The second moment is the
rank-1 estimate v_row v_col / mean(v_row) of that matrix, per layer; `v_row` keeps the layer and
row axes, `v_col` the layer and column axes. Leaves with fewer than two non-layer axes, or whose
matrix view has a side shorter than `adafactor_min_dim_size_to_factor`, keep a full second moment.

Params are plain arrays (unboxed); the optimizer reads only key names and shapes from the tree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.tree_util import PyTreeDef

from longt5_jax.formats.keypath import KeyPath, key_names

PyTree = Any

# The scan module name in model/transformer.py; leaves below it carry a leading layers axis.
STACKED_KEY = "layers"
# Relative-position bias tables: T5X keeps them out of weight decay like the norm scales.
RELPOS_KEY = "rel_embedding"
Name = Literal["adamw", "adafactor"]
NAMES: tuple[Name, ...] = ("adamw", "adafactor")
SCHEDULES = ("rsqrt", "constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule; the defaults are LongT5's T5X pretraining setup."""

    name: Name = "adafactor"
    learning_rate: float = 1.0  # the peak (or base) value the schedule scales
    schedule: Literal["rsqrt", "constant", "linear", "cosine"] = "rsqrt"
    warmup_steps: int = 10_000
    total_steps: int = 0  # where linear and cosine decay end
    end_learning_rate_fraction: float = 0.0  # linear/cosine floor as a fraction of the peak
    weight_decay: float = 0.0  # AdamW only; never on norm scales or relpos tables
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    adafactor_decay_rate: float = 0.8
    adafactor_clipping_threshold: float | None = 1.0
    adafactor_multiply_by_parameter_scale: bool = True
    adafactor_epsilon1: float = 1e-30
    adafactor_epsilon2: float = 1e-3
    adafactor_momentum: float | None = None
    adafactor_min_dim_size_to_factor: int = 128
    grad_clip_norm: float = 0.0  # global-norm clipping of gradients; 0 = off

    def __post_init__(self):
        for ok, field, expected in self._checks():
            if not ok:
                raise ValueError(f"OptimizerConfig.{field}={getattr(self, field)!r}: {expected}")

    def _checks(self) -> list[tuple[bool, str, str]]:
        """(holds, field, what was expected), checked in order."""
        s, warmup, total = self.schedule, self.warmup_steps, self.total_steps
        decays = s in ("linear", "cosine")
        clip, momentum = self.adafactor_clipping_threshold, self.adafactor_momentum
        return [
            (self.name in NAMES, "name", f"expected one of {NAMES}"),
            (s in SCHEDULES, "schedule", f"expected one of {SCHEDULES}"),
            (self.learning_rate > 0, "learning_rate", "expected > 0"),
            (warmup >= 0, "warmup_steps", "expected >= 0"),
            # 1/sqrt(max(step, warmup)) is infinite at step 0 without a warm-up floor.
            (
                s != "rsqrt" or warmup >= 1,
                "warmup_steps",
                "schedule 'rsqrt' needs warmup_steps >= 1",
            ),
            (not decays or total > 0, "total_steps", f"schedule {s!r} needs total_steps > 0"),
            (
                not decays or total > warmup,
                "total_steps",
                f"schedule {s!r} needs total_steps > warmup_steps={warmup}",
            ),
            (
                0 <= self.end_learning_rate_fraction <= 1,
                "end_learning_rate_fraction",
                "expected in [0, 1]",
            ),
            (self.weight_decay >= 0, "weight_decay", "expected >= 0"),
            (
                self.name == "adamw" or self.weight_decay == 0,
                "weight_decay",
                "only name='adamw' applies weight decay",
            ),
            (0 <= self.b1 < 1, "b1", "expected in [0, 1)"),
            (0 <= self.b2 < 1, "b2", "expected in [0, 1)"),
            (self.eps > 0, "eps", "expected > 0"),
            (0 < self.adafactor_decay_rate <= 1, "adafactor_decay_rate", "expected in (0, 1]"),
            (clip is None or clip > 0, "adafactor_clipping_threshold", "expected > 0 or None"),
            (self.adafactor_epsilon1 > 0, "adafactor_epsilon1", "expected > 0"),
            (self.adafactor_epsilon2 > 0, "adafactor_epsilon2", "expected > 0"),
            (
                momentum is None or 0 <= momentum < 1,
                "adafactor_momentum",
                "expected in [0, 1) or None",
            ),
            (
                self.adafactor_min_dim_size_to_factor >= 1,
                "adafactor_min_dim_size_to_factor",
                "expected >= 1",
            ),
            (self.grad_clip_norm >= 0, "grad_clip_norm", "expected >= 0 (0 = off)"),
        ]


def schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """The learning rate as a function of the step (0-based, the optimizer's update count)."""
    peak, warmup = cfg.learning_rate, cfg.warmup_steps
    end = cfg.end_learning_rate_fraction * peak
    if cfg.schedule == "rsqrt":
        # T5X `rsqrt_decay`: flat at 1/sqrt(warmup) during warm-up, then 1/sqrt(step).
        return lambda step: peak / jnp.sqrt(jnp.maximum(jnp.asarray(step, jnp.float32), warmup))
    if cfg.schedule == "constant":
        return optax.linear_schedule(0.0, peak, warmup) if warmup else optax.constant_schedule(peak)
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, cfg.total_steps, end)
    decay = optax.linear_schedule(peak, end, cfg.total_steps - warmup)
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def learning_rate_at(cfg: OptimizerConfig, step: int) -> float:
    """The scheduled learning rate at `step`, for logging."""
    return float(schedule(cfg)(step))


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """Global-norm clipping (if set), then AdamW or T5X's Adafactor, both on `schedule(cfg)`."""
    lr = schedule(cfg)
    if cfg.name == "adamw":
        opt = optax.adamw(
            lr, cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay, mask=weight_decay_mask
        )
    else:
        opt = adafactor(cfg, lr)
    if cfg.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), opt)
    return opt


def weight_decay_mask(params: PyTree) -> PyTree:
    """True where AdamW decays: leaves with >= 2 non-layer axes, except relpos tables."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: RELPOS_KEY not in key_names(path) and len(_layer_axes(path, p.ndim)) >= 2,
        params,
    )


def adafactor(cfg: OptimizerConfig, lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    """optax.adafactor's chain, with the factoring, clipping and parameter scale taken per layer."""
    parts = [
        scale_by_layer_factored_rms(
            cfg.adafactor_decay_rate, cfg.adafactor_epsilon1, cfg.adafactor_min_dim_size_to_factor
        )
    ]
    if cfg.adafactor_clipping_threshold is not None:
        parts.append(clip_by_layer_rms(cfg.adafactor_clipping_threshold))
    parts.append(optax.scale_by_learning_rate(lr, flip_sign=False))
    if cfg.adafactor_multiply_by_parameter_scale:
        parts.append(scale_by_layer_param_rms(cfg.adafactor_epsilon2))
    if cfg.adafactor_momentum is not None:
        # T5X keeps momentum of the scaled step (after lr and parameter scale), undebiased.
        parts.append(optax.ema(cfg.adafactor_momentum, debias=False, accumulator_dtype=jnp.float32))
    parts.append(optax.scale(-1.0))
    return optax.chain(*parts)


class Factoring(NamedTuple):
    """How Adafactor sees one leaf: its stacked axes and the row and column axes it factors."""

    batch: tuple[int, ...]
    rows: tuple[int, ...]  # empty when the leaf keeps a full second moment
    cols: tuple[int, ...]


def factoring(path: KeyPath, shape: Sequence[int], min_dim_size_to_factor: int) -> Factoring:
    """The module docstring's rule; `v_row` keeps axes batch + rows, `v_col` batch + cols."""
    inner = _layer_axes(path, len(shape))
    batch = tuple(range(len(shape) - len(inner)))
    if len(inner) < 2:
        return Factoring(batch, (), ())
    largest = max(inner, key=lambda a: shape[a])
    others = tuple(a for a in inner if a != largest)
    rows, cols = ((largest,), others) if largest == inner[0] else (others, (largest,))
    side = min(math.prod(shape[a] for a in rows), math.prod(shape[a] for a in cols))
    if side < min_dim_size_to_factor:
        return Factoring(batch, (), ())
    return Factoring(batch, rows, cols)


class FactoredMomentsState(NamedTuple):
    """Adafactor's second moments: v_row, v_col where factored, else v (unused ones are [1])."""

    # Named as optax's states name it (checkpoints hold the name); shadows `tuple.count`.
    count: jax.Array  # type: ignore[assignment]
    v_row: PyTree
    v_col: PyTree
    v: PyTree


def scale_by_layer_factored_rms(
    decay_rate: float = 0.8, epsilon: float = 1e-30, min_dim_size_to_factor: int = 128
) -> optax.GradientTransformation:
    """Adafactor's scaling by a factored second-moment estimate, per layer of stacked leaves."""

    def init_fn(params: PyTree) -> FactoredMomentsState:
        def zeros(which: int) -> Callable[[KeyPath, jax.Array], jax.Array]:
            return lambda path, p: jnp.zeros(
                _moment_shapes(path, p.shape, min_dim_size_to_factor)[which]
            )

        trees = [jax.tree_util.tree_map_with_path(zeros(i), params) for i in range(3)]
        return FactoredMomentsState(jnp.zeros([], jnp.int32), *trees)

    def update_fn(
        updates: PyTree, state: FactoredMomentsState, params: PyTree = None
    ) -> tuple[PyTree, FactoredMomentsState]:
        del params
        # Adafactor's decay 1 - (t + 1)^-0.8: no averaging at the first step, then slowly more.
        beta = 1.0 - (state.count.astype(jnp.float32) + 1.0) ** -decay_rate
        treedef: PyTreeDef  # (jaxlib's own type has no stubs: named, it is Any to mypy)
        flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
        moments = [treedef.flatten_up_to(t) for t in (state.v_row, state.v_col, state.v)]
        out = [
            _scale_leaf(g, r, c, v, beta, epsilon, factoring(path, g.shape, min_dim_size_to_factor))
            for (path, g), r, c, v in zip(flat, *moments, strict=True)
        ]
        new = [treedef.unflatten(list(t)) for t in zip(*out, strict=True)]
        count = optax.safe_int32_increment(state.count)
        return new[0], FactoredMomentsState(count, *new[1:])

    return optax.GradientTransformation(init_fn, update_fn)


def moment_axes(state_path: KeyPath, path: KeyPath, shape: Sequence[int]) -> tuple[int, ...]:
    """The axes of a parameter (at `path`, of `shape`) that the optimizer-state leaf at
    `state_path` keeps, in order: a factored moment keeps the batch axes and its side's axes
    (`v_row`: rows, `v_col`: columns); any other field keeps them all. Whether the leaf is
    factored at all is its shape's business: a placeholder [1] keeps none, and the caller sees
    the mismatch."""
    return _kept_axes((key_names(state_path) or ("",))[-1], path, shape)


def _kept_axes(field: str, path: KeyPath, shape: Sequence[int]) -> tuple[int, ...]:
    f = factoring(path, shape, 1)
    if field == "v_row" and f.rows:
        return tuple(a for a in range(len(shape)) if a not in f.cols)
    if field == "v_col" and f.rows:
        return tuple(a for a in range(len(shape)) if a not in f.rows)
    return tuple(range(len(shape)))


def _moment_shapes(
    path: KeyPath, shape: Sequence[int], min_dim: int
) -> tuple[tuple[int, ...], ...]:
    """Shapes of (v_row, v_col, v) for one leaf."""
    if not factoring(path, shape, min_dim).rows:
        return (1,), (1,), tuple(shape)
    keep_rows, keep_cols = (
        tuple(shape[a] for a in _kept_axes(field, path, shape)) for field in ("v_row", "v_col")
    )
    return keep_rows, keep_cols, (1,)


def _scale_leaf(
    g: jax.Array,
    v_row: jax.Array,
    v_col: jax.Array,
    v: jax.Array,
    beta: jax.Array,
    epsilon: float,
    f: Factoring,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(scaled gradient, v_row, v_col, v) for one leaf, as T5X's `apply_param_gradient`."""
    g = g.astype(jnp.float32)
    g2 = jnp.square(g) + epsilon
    if not f.rows:
        v = beta * v + (1.0 - beta) * g2
        return g * v**-0.5, v_row, v_col, v
    v_row = beta * v_row + (1.0 - beta) * jnp.mean(g2, axis=f.cols)
    v_col = beta * v_col + (1.0 - beta) * jnp.mean(g2, axis=f.rows)
    # The rank-1 estimate v_row v_col / mean(v_row); the mean is per layer (v_row's row axes).
    row_mean = jnp.mean(v_row, axis=tuple(range(len(f.batch), v_row.ndim)), keepdims=True)
    row_factor = jnp.expand_dims((v_row / row_mean) ** -0.5, f.cols)
    col_factor = jnp.expand_dims(v_col**-0.5, f.rows)
    return g * row_factor * col_factor, v_row, v_col, v


def clip_by_layer_rms(threshold: float) -> optax.GradientTransformation:
    """Divide each leaf (each layer of a stacked leaf) by max(1, rms / threshold)."""

    def update_fn(updates: PyTree, state: optax.EmptyState, params: PyTree = None):
        del params

        def clip(path: KeyPath, u: jax.Array) -> jax.Array:
            return u / jnp.maximum(1.0, _layer_rms(path, u) / threshold)

        return jax.tree_util.tree_map_with_path(clip, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def scale_by_layer_param_rms(min_scale: float) -> optax.GradientTransformation:
    """Multiply by the parameter rms per layer, at least `min_scale`: Adafactor's relative step."""

    def update_fn(updates: PyTree, state: optax.EmptyState, params: PyTree = None):
        if params is None:
            raise ValueError("scale_by_layer_param_rms needs params in update()")

        def scale(path: KeyPath, u: jax.Array, p: jax.Array) -> jax.Array:
            return u * jnp.maximum(_layer_rms(path, p), min_scale)

        return jax.tree_util.tree_map_with_path(scale, updates, params), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _layer_rms(path: KeyPath, x: jax.Array) -> jax.Array:
    """Root mean square over the non-layer axes, kept as size-1 axes for broadcasting."""
    axes = _layer_axes(path, x.ndim)
    return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), axis=axes, keepdims=True))


def _layer_axes(path: KeyPath, ndim: int) -> tuple[int, ...]:
    """The axes of one layer: all but a leading layers axis when the leaf is stacked."""
    stacked = ndim >= 1 and STACKED_KEY in key_names(path)
    return tuple(range(int(stacked), ndim))
