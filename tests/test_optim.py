"""Schedules, AdamW and per-layer Adafactor against hand computations and optax on slices."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from longt5_jax.training.optim import (
    Factoring,
    OptimizerConfig,
    factoring,
    learning_rate_at,
    make_optimizer,
    schedule,
    weight_decay_mask,
)

TOL = dict(rtol=1e-5, atol=1e-7)


def _rms(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    return np.sqrt(np.mean(np.square(x), axis=axes))


# ---------------------------------------------------------------- schedules


@pytest.mark.parametrize("peak", [1.0, 0.5])
def test_rsqrt_is_flat_during_warmup_then_inverse_sqrt(peak: float):
    cfg = OptimizerConfig(learning_rate=peak, warmup_steps=10_000)
    for step in (0, 1, 5_000, 9_999, 10_000, 40_000, 1_000_000):
        assert learning_rate_at(cfg, step) == pytest.approx(peak / math.sqrt(max(step, 10_000)))
    # Jitted with a traced int32 step, as inside the optimizer.
    assert float(jax.jit(schedule(cfg))(jnp.int32(250_000))) == pytest.approx(peak / 500)


def test_constant_with_and_without_warmup():
    flat = OptimizerConfig(schedule="constant", learning_rate=1e-3, warmup_steps=0)
    assert [learning_rate_at(flat, s) for s in (0, 7, 10**6)] == pytest.approx([1e-3] * 3)
    warm = OptimizerConfig(schedule="constant", learning_rate=1e-3, warmup_steps=10)
    got = [learning_rate_at(warm, s) for s in (0, 5, 10, 11, 10**6)]
    assert got == pytest.approx([0.0, 5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_decaying_schedules_warm_up_then_reach_the_floor(kind: str):
    peak, end = 1e-3, 1e-4
    cfg = OptimizerConfig(
        schedule=kind,
        learning_rate=peak,
        warmup_steps=10,
        total_steps=110,
        end_learning_rate_fraction=0.1,
    )
    # Half-way through the decay both schedules sit at the mid-point of peak and floor.
    expected = [0.0, peak / 2, peak, (peak + end) / 2, end, end]
    got = [learning_rate_at(cfg, s) for s in (0, 5, 10, 60, 110, 1_000)]
    assert got == pytest.approx(expected, rel=1e-5)
    quarter = learning_rate_at(cfg, 35)
    if kind == "linear":
        assert quarter == pytest.approx(peak - 0.25 * (peak - end), rel=1e-5)
    else:
        shape = 0.5 * (1 + math.cos(math.pi * 0.25))
        assert quarter == pytest.approx(end + (peak - end) * shape, rel=1e-5)


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(schedule="cosine", total_steps=0),
            "OptimizerConfig.total_steps=0: schedule 'cosine' needs total_steps > 0",
        ),
        (
            dict(schedule="linear", warmup_steps=10, total_steps=5),
            "OptimizerConfig.total_steps=5: schedule 'linear' needs total_steps > warmup_steps=10",
        ),
        (dict(warmup_steps=0), "OptimizerConfig.warmup_steps=0: schedule 'rsqrt' needs"),
        (dict(name="sgd"), "OptimizerConfig.name='sgd': expected one of"),
        (dict(schedule="step"), "OptimizerConfig.schedule='step': expected one of"),
        (dict(learning_rate=0.0), "OptimizerConfig.learning_rate=0.0: expected > 0"),
        (dict(weight_decay=0.1), "OptimizerConfig.weight_decay=0.1: only name='adamw'"),
        (dict(adafactor_momentum=1.5), "OptimizerConfig.adafactor_momentum=1.5: expected in"),
        (dict(name="adamw", b2=1.0), "OptimizerConfig.b2=1.0: expected in [0, 1)"),
        (dict(grad_clip_norm=-1.0), "OptimizerConfig.grad_clip_norm=-1.0: expected >= 0"),
    ],
)
def test_bad_configs_name_the_field_in_one_line(fields: dict, message: str):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        OptimizerConfig(**fields)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- AdamW


def _tiny_tree(rng: np.random.Generator) -> dict:
    """Our model's naming: stacked leaves live under 'layers' with a leading layers axis."""

    def arr(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    return {
        "encoder": {
            "layers": {"mlp": {"wi_0": {"kernel": arr(2, 3, 4)}}, "norm": {"scale": arr(2, 3)}},
            "relpos_bias": {"rel_embedding": arr(2, 5)},
            "encoder_norm": {"scale": arr(3)},
        },
        "token_embedder": {"embedding": arr(6, 3)},
    }


def test_weight_decay_mask_skips_norms_and_relpos_tables():
    mask = weight_decay_mask(_tiny_tree(np.random.default_rng(0)))
    assert mask == {
        "encoder": {
            "layers": {"mlp": {"wi_0": {"kernel": True}}, "norm": {"scale": False}},
            "relpos_bias": {"rel_embedding": False},
            "encoder_norm": {"scale": False},
        },
        "token_embedder": {"embedding": True},
    }


def test_adamw_first_step_matches_hand_computation():
    rng = np.random.default_rng(1)
    params, grads = _tiny_tree(rng), _tiny_tree(rng)
    lr, wd, eps = 0.1, 0.01, 1e-8
    cfg = OptimizerConfig(
        name="adamw", schedule="constant", learning_rate=lr, warmup_steps=0, weight_decay=wd
    )
    opt = make_optimizer(cfg)
    updates, _ = opt.update(grads, opt.init(params), params)
    mask = weight_decay_mask(params)

    # Step 1 of Adam: the bias-corrected moments are g and g^2, so the step is g / (|g| + eps).
    def expected(g: jax.Array, p: jax.Array, decays: bool) -> np.ndarray:
        g, p = np.asarray(g), np.asarray(p)
        return -lr * (g / (np.abs(g) + eps) + (wd * p if decays else 0.0))

    want = jax.tree.map(expected, grads, params, mask)
    jax.tree.map(lambda u, w: np.testing.assert_allclose(u, w, **TOL), updates, want)
    # The decay term is really there for kernels and really absent for the norm scale.
    kernel = updates["encoder"]["layers"]["mlp"]["wi_0"]["kernel"]
    g = np.asarray(grads["encoder"]["layers"]["mlp"]["wi_0"]["kernel"])
    assert np.abs(np.asarray(kernel) + lr * g / (np.abs(g) + eps)).max() > 1e-4
    scale_g = np.asarray(grads["encoder"]["encoder_norm"]["scale"])
    np.testing.assert_allclose(
        updates["encoder"]["encoder_norm"]["scale"], -lr * np.sign(scale_g), rtol=1e-5
    )


# ---------------------------------------------------------------- Adafactor


def _adafactor_cfg(**overrides) -> OptimizerConfig:
    fields = dict(
        schedule="constant", learning_rate=0.01, warmup_steps=0, adafactor_min_dim_size_to_factor=1
    )
    return OptimizerConfig(**{**fields, **overrides})


def _optax_reference(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """optax's own Adafactor with the same settings, for one unstacked 2-D slice."""
    return optax.adafactor(
        learning_rate=schedule(cfg),
        min_dim_size_to_factor=cfg.adafactor_min_dim_size_to_factor,
        decay_rate=cfg.adafactor_decay_rate,
        multiply_by_parameter_scale=cfg.adafactor_multiply_by_parameter_scale,
        clipping_threshold=cfg.adafactor_clipping_threshold,
        momentum=cfg.adafactor_momentum,
        eps=cfg.adafactor_epsilon1,
        factored=True,
    )


def _layered_steps(shape: tuple[int, ...], num_steps: int) -> tuple[jax.Array, list[jax.Array]]:
    """Params and gradients whose scale differs by orders of magnitude between layers.

    Layer 0's gradient jumps 1000x after the first step, so only its update gets clipped.
    """
    rng = np.random.default_rng(2)
    layers = shape[0]
    per_layer = np.array([0.01, 0.1, 1.0])[:layers].reshape(-1, *[1] * (len(shape) - 1))
    params = jnp.asarray(rng.normal(size=shape) * per_layer, jnp.float32)
    grads = []
    for step in range(num_steps):
        g = rng.normal(size=shape) * per_layer[::-1]
        if step > 0:
            g[0] *= 1000.0
        grads.append(jnp.asarray(g, jnp.float32))
    return params, grads


def _run(opt: optax.GradientTransformation, params, grads: list) -> list:
    state, outs = opt.init(params), []
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
        outs.append(updates)
    return outs


@pytest.mark.parametrize(
    "name, shape, as_matrix",
    [
        ("mlp/wi_0", (3, 6, 10), (6, 10)),
        ("attention/query", (3, 8, 2, 6), (8, 12)),  # [layers, d, heads, kv] -> d x (heads kv)
        ("attention/out", (3, 2, 6, 8), (12, 8)),  # [layers, heads, kv, d] -> (heads kv) x d
    ],
)
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_stacked_adafactor_equals_independent_layers(name, shape, as_matrix, momentum):
    cfg = _adafactor_cfg(adafactor_momentum=momentum)
    params, grads = _layered_steps(shape, num_steps=3)
    module, leaf = name.split("/")
    wrap = lambda x: {"decoder": {"layers": {module: {leaf: {"kernel": x}}}}}  # noqa: E731
    ours = _run(make_optimizer(cfg), wrap(params), [wrap(g) for g in grads])

    reference = _optax_reference(cfg)
    for layer in range(shape[0]):
        flat = lambda x, i=layer: x[i].reshape(as_matrix)  # noqa: E731
        want = _run(reference, flat(params), [flat(g) for g in grads])
        for got, w in zip(ours, want, strict=True):
            got_layer = got["decoder"]["layers"][module][leaf]["kernel"][layer]
            np.testing.assert_allclose(got_layer, np.asarray(w).reshape(shape[1:]), **TOL)

    # optax.adafactor on the whole stack mixes layers (block RMS over all of them), so differs.
    stacked = _run(reference, params, grads)[-1]
    got = ours[-1]["decoder"]["layers"][module][leaf]["kernel"]
    assert not np.allclose(got, stacked, rtol=1e-2)


def _model_like_tree() -> dict:
    """The tiny model's parameter shapes (2 layers, d=32, ff=64, 4 heads of 8)."""
    z = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    return {
        "encoder": {
            "layers": {
                "mlp": {"wi_0": {"kernel": z(2, 32, 64)}, "wo": {"kernel": z(2, 64, 32)}},
                "attention": {
                    "query": {"kernel": z(2, 32, 4, 8)},
                    "out": {"kernel": z(2, 4, 8, 32)},
                },
                "pre_mlp_layer_norm": {"scale": z(2, 32)},
            },
            "relpos_bias": {"rel_embedding": z(4, 8)},
        },
        "token_embedder": {"embedding": z(256, 32)},
    }


def test_adafactor_moments_are_factored_per_layer():
    opt = make_optimizer(_adafactor_cfg(adafactor_min_dim_size_to_factor=16))
    state = jax.eval_shape(opt.init, _model_like_tree())
    shapes = {
        key: jax.tree.map(lambda x: x.shape, optax.tree_utils.tree_get(state, key))
        for key in ("v_row", "v_col", "v")
    }
    layers = {k: v["encoder"]["layers"] for k, v in shapes.items()}
    # The layers axis is never averaged over: each of v_row and v_col keeps it.
    assert layers["v_row"]["mlp"]["wi_0"]["kernel"] == (2, 32)
    assert layers["v_col"]["mlp"]["wi_0"]["kernel"] == (2, 64)
    assert layers["v_row"]["mlp"]["wo"]["kernel"] == (2, 64)
    assert layers["v_col"]["mlp"]["wo"]["kernel"] == (2, 32)
    assert layers["v_row"]["attention"]["query"]["kernel"] == (2, 32)
    assert layers["v_col"]["attention"]["query"]["kernel"] == (2, 4, 8)
    assert layers["v_row"]["attention"]["out"]["kernel"] == (2, 4, 8)
    assert layers["v_col"]["attention"]["out"]["kernel"] == (2, 32)
    assert layers["v"]["attention"]["query"]["kernel"] == (1,)
    # Norm scales and the small relpos table keep full second moments.
    assert layers["v"]["pre_mlp_layer_norm"]["scale"] == (2, 32)
    assert layers["v_row"]["pre_mlp_layer_norm"]["scale"] == (1,)
    assert shapes["v"]["encoder"]["relpos_bias"]["rel_embedding"] == (4, 8)
    assert shapes["v_row"]["token_embedder"]["embedding"] == (256,)
    assert shapes["v_col"]["token_embedder"]["embedding"] == (32,)


def test_factoring_rule_at_base_size_with_t5x_min_dim():
    path = [jax.tree_util.DictKey(k) for k in ("encoder", "layers", "attention", "out", "kernel")]
    assert factoring(path, (12, 12, 64, 768), 128) == Factoring((0,), (1, 2), (3,))
    assert factoring(path[:3] + path[4:], (12, 768, 12, 64), 128) == Factoring((0,), (1,), (2, 3))
    # Unstacked: no batch axis; a [heads, buckets] table is too small to factor at 128.
    assert factoring([jax.tree_util.DictKey("x")], (768, 2048), 128) == Factoring((), (0,), (1,))
    assert factoring([jax.tree_util.DictKey("x")], (12, 32), 128) == Factoring((), (), ())


def test_adafactor_update_clipping_bounds_each_layer():
    lr = 0.01
    params, grads = _layered_steps((3, 6, 10), num_steps=2)
    wrap = lambda x: {"layers": {"w": x}}  # noqa: E731
    clipped = _run(make_optimizer(_adafactor_cfg()), wrap(params), [wrap(g) for g in grads])
    # Per layer, rms(update) <= lr * max(rms(param), eps2) * threshold, with the params the
    # second update is applied to; layer 0's 1000x gradient jump makes it hit the bound.
    seen = np.asarray(params) + np.asarray(clipped[0]["layers"]["w"])
    bound = lr * np.maximum(_rms(seen, (1, 2)), 1e-3)
    rms = _rms(np.asarray(clipped[-1]["layers"]["w"]), (1, 2))
    assert np.all(rms <= bound * (1 + 1e-5))
    np.testing.assert_allclose(rms[0], bound[0], rtol=1e-5)
    free_cfg = _adafactor_cfg(adafactor_clipping_threshold=None)
    free = _run(make_optimizer(free_cfg), wrap(params), [wrap(g) for g in grads])
    assert _rms(np.asarray(free[-1]["layers"]["w"]), (1, 2))[0] > 1.2 * bound[0]


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_global_norm_clipping_rescales_the_gradient_first(name: str):
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)}
    g = rng.normal(size=(4, 5)) * 1e6
    cfg_fields = dict(name=name, schedule="constant", warmup_steps=0, grad_clip_norm=2.0)
    opt = make_optimizer(OptimizerConfig(**cfg_fields))
    updates, state = opt.update({"w": jnp.asarray(g, jnp.float32)}, opt.init(params), params)
    clipped = g * 2.0 / np.linalg.norm(g)
    if name == "adamw":
        # The first moment saw the clipped gradient: mu = (1 - b1) * g * clip / |g|.
        mu = optax.tree_utils.tree_get(state, "mu")["w"]
        np.testing.assert_allclose(mu, 0.1 * clipped, rtol=1e-5)
        assert np.linalg.norm(mu) == pytest.approx(0.2, rel=1e-5)
    else:
        # [4, 5] is below the factoring size: v is the clipped gradient squared (decay 0 at step 0).
        v = optax.tree_utils.tree_get(state, "v")["w"]
        np.testing.assert_allclose(v, clipped**2, rtol=1e-5)
    assert np.all(np.isfinite(updates["w"]))
