"""Model structure: presets, parameter counts, logical axes, remat, dropout, sharded execution."""

import dataclasses
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_rel, padded_batch, random_params
from jax.sharding import Mesh, PartitionSpec

from longt5_jax.model import LongT5, LongT5Config, count_params
from longt5_jax.model.layers import Dropout, Projection, Rows, normal
from longt5_jax.model.loss import cross_entropy

LOGICAL_AXES = {
    "batch",
    "length",
    "embed",
    "heads",
    "kv",
    "mlp",
    "vocab",
    "relpos_buckets",
    "layers",
}


def _abstract_params(config):
    ids = jnp.ones((1, 1), jnp.int32)
    return jax.eval_shape(lambda: LongT5(config).init(jax.random.key(0), ids, None, ids))


# The spec's counts (untied embedding and LM head, no biases).
@pytest.mark.parametrize(
    "name,attention,count",
    [
        ("base", "local", 247_577_856),
        ("base", "transient-global", 247_587_456),
        ("large", "local", 783_150_080),
        ("large", "transient-global", 783_175_168),
        ("xl", "local", 2_849_757_184),
        ("xl", "transient-global", 2_849_807_360),
    ],
)
def test_preset_parameter_counts_match_the_spec(name, attention, count):
    assert count_params(_abstract_params(LongT5Config.preset(name, attention))) == count


@pytest.mark.parametrize("name", ["tiny", "small", "base", "large", "xl", "xxl"])
@pytest.mark.parametrize("attention", ["local", "transient-global", "tglobal"])
def test_presets_build_for_both_attention_types(name, attention):
    config = LongT5Config.preset(name, attention)
    assert config.attention in ("local", "transient-global")
    assert count_params(_abstract_params(config)) > 0


def test_every_parameter_has_logical_axis_names():
    tree = _abstract_params(LongT5Config.preset("tiny"))["params"]
    boxes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert boxes and all(isinstance(b, nn.LogicallyPartitioned) for b in boxes)
    for b in boxes:
        assert len(b.names) == b.value.ndim and set(b.names) <= LOGICAL_AXES, b.names
    stacked = [b for b in boxes if b.names[0] == "layers"]
    assert len(stacked) == len(boxes) - 7  # all but embedding, 3 relpos tables, 2 norms, logits


def test_the_model_never_sees_a_mesh():
    for f in pathlib.Path("longt5_jax/model").glob("*.py"):
        text = f.read_text()
        for word in ("jax.sharding", "PartitionSpec", "NamedSharding", "Mesh("):
            assert word not in text, f"{f} mentions {word}"


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("attention", "global", "attention='global'"),
        ("remat", "some", "remat='some'"),
        ("dtype", "int8", "dtype='int8'"),
        ("d_model", 0, "d_model=0"),
        ("dropout_rate", 1.5, "dropout_rate=1.5"),
    ],
)
def test_bad_config_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        LongT5Config(**{field: value})
    with pytest.raises(ValueError, match="unknown LongT5 preset 'huge'"):
        LongT5Config.preset("huge")


def _loss_fn(params, config, batch, deterministic=True, rngs=None):
    logits = LongT5(config).apply(
        {"params": params},
        batch.input_ids,
        batch.attention_mask,
        batch.decoder_input_ids,
        batch.decoder_attention_mask,
        deterministic=deterministic,
        rngs=rngs,
    )
    per_token, _ = cross_entropy(logits, jnp.asarray(batch.labels), z_loss=1e-4)
    return jnp.sum(per_token * batch.decoder_attention_mask)


_loss = jax.jit(_loss_fn, static_argnames=("config", "deterministic"))


@pytest.mark.parametrize("remat, scan", [("full", True), ("save_dots", True), ("full", False)])
def test_remat_and_unrolled_layers_change_memory_not_gradients(remat, scan):
    """Unrolled layers (scan_layers=False) run on the same [layers, ...] parameters; their
    dropout masks are the scan's (test_pipeline's dropout test)."""
    config = LongT5Config.preset("tiny")
    params = random_params(config)
    batch = padded_batch(config, [21, 9], [5, 3], 21, 5)
    want = jax.grad(_loss)(params, config, batch)
    changed = dataclasses.replace(config, remat=remat, scan_layers=scan)
    got = jax.grad(_loss)(params, changed, batch)
    # Recomputation may fuse float ops differently, so equal up to float32 rounding (5.4e-7
    # measured for both policies, unrolled or not).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert max_rel(a, b)[1] <= 1e-6


def test_parameters_cast_at_use_train_as_those_cast_once():
    """cast_params changes where the bf16 copies live, not what a layer computes: each use reads
    the same bf16 values and its gradient is rounded to bf16 once either way, so the loss and
    every gradient are bitwise equal (measured here, with recomputation and without)."""
    config = LongT5Config.preset("tiny", dtype="bfloat16", remat="full")
    params = random_params(config)
    batch = padded_batch(config, [21, 9], [5, 3], 21, 5)
    loss, grads = jax.value_and_grad(_loss)(params, config, batch)
    at_use = dataclasses.replace(config, cast_params="at_use")
    loss_at_use, grads_at_use = jax.value_and_grad(_loss)(params, at_use, batch)
    # Both ran in bf16 (float32's loss differs), so the equality says something.
    float32 = dataclasses.replace(at_use, dtype="float32")
    assert float(_loss(params, float32, batch)) != float(loss_at_use)
    assert float(loss_at_use) == float(loss)
    for a, b in zip(jax.tree.leaves(grads_at_use), jax.tree.leaves(grads), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_kernel_used_twice_sums_its_gradients_in_float32_and_rounds_once():
    """TGlobal's key and value kernels project the tokens and the global aggregates, and reach
    the layer already in bfloat16 (a stack casts its parameters once a step): their gradient is
    the two uses' sum in float32, rounded to bfloat16 once, not a sum of two rounded halves."""
    proj = Projection((4, 8), ("embed",), ("heads", "kv"), normal(1.0), jnp.bfloat16)
    k = jax.random.split(jax.random.key(3), 5)
    shapes = [(2, 300, 16), (2, 19, 16), (2, 300, 4, 8), (2, 19, 4, 8)]
    x1, x2, dy1, dy2 = (
        jax.random.normal(key, shape).astype(jnp.bfloat16)
        for key, shape in zip(k, shapes, strict=False)
    )
    kernel = nn.unbox(proj.init(k[4], x1, x2))["params"]["kernel"].astype(jnp.bfloat16)

    def project(k, *xs):
        return proj.apply({"params": {"kernel": k}}, *xs)

    (y1, y2), vjp = jax.vjp(project, kernel, x1, x2)
    dkernel, *dxs = vjp((dy1, dy2))
    # The outputs and the inputs' gradients are each use's own.
    for x, y, dy, dx in zip([x1, x2], [y1, y2], [dy1, dy2], dxs, strict=True):
        one, one_vjp = jax.vjp(lambda x: project(kernel, x), x)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(one, np.float32))
        np.testing.assert_array_equal(
            np.asarray(dx, np.float32), np.asarray(one_vjp(dy)[0], np.float32)
        )
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    exact = sum(np.einsum("bld,blhk->dhk", f64(x), f64(dy)) for x, dy in [(x1, dy1), (x2, dy2)])
    nearest = np.asarray(exact.astype(np.float32).astype(jnp.bfloat16), np.float64)

    def rounded_right(g):  # the share of entries that are the exact sum's nearest bfloat16
        return np.mean(f64(g) == nearest)

    # Measured: every entry is the exact sum's nearest bfloat16; of the two rounded gradients
    # summed in bfloat16, 69% are.
    assert dkernel.dtype == jnp.bfloat16 and rounded_right(dkernel) == 1.0
    halves = [jnp.einsum("bld,blhk->dhk", x, dy) for x, dy in [(x1, dy1), (x2, dy2)]]
    assert rounded_right(halves[0] + halves[1]) < 0.8


def test_dropout_is_active_only_when_not_deterministic():
    config = LongT5Config.preset("tiny", dropout_rate=0.3)
    params = random_params(config)
    batch = padded_batch(config, [21, 9], [5, 3], 21, 5)
    eval_loss = _loss(params, config, batch)
    a = _loss(params, config, batch, deterministic=False, rngs={"dropout": jax.random.key(1)})
    b = _loss(params, config, batch, deterministic=False, rngs={"dropout": jax.random.key(1)})
    c = _loss(params, config, batch, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert a == b and a != c and a != eval_loss
    assert eval_loss == _loss(params, dataclasses.replace(config, dropout_rate=0.0), batch)


def test_a_rows_dropout_masks_follow_its_global_index():
    """Rows 2-3 computed alone with their global ids (as another device or microbatch computes
    them) get the masks they get in the whole batch; given other ids, other masks."""
    config = LongT5Config.preset("tiny", "transient-global", dropout_rate=0.3)
    params = {"params": random_params(config)}
    b = padded_batch(config, [21, 9, 30, 17], [5, 3, 4, 6], 32, 6)
    model, key = LongT5(config), {"dropout": jax.random.key(3)}
    apply = jax.jit(model.apply, static_argnames="deterministic")  # op by op: 30 s, jitted 17

    def logits(rows, row_ids=None):
        return apply(
            params,
            b.input_ids[rows],
            b.attention_mask[rows],
            b.decoder_input_ids[rows],
            b.decoder_attention_mask[rows],
            deterministic=False,
            rngs=key,
            row_ids=row_ids,
        )

    whole, alone = logits(slice(None)), logits(slice(2, 4), jnp.array([2, 3]))
    # The same masks, so only float32 rounding, which the compiled batches of 4 and of 2 order
    # differently: measured 2.3e-6 (jax 0.10.2) and 2.8e-6 (0.12.0.1) of their largest logit (5.3).
    assert max_rel(alone, whole[2:])[1] <= 5e-6
    as_rows_0_1 = logits(slice(2, 4))
    assert np.abs(as_rows_0_1 - whole[2:]).max() > 1.0  # 8.3 measured


def test_dropout_keeps_one_minus_rate_and_rescales():
    """An independent look at one mask: the kept share is 1 - rate, kept values are x / (1 -
    rate), and rows and layers draw different masks."""
    drop = Dropout(0.25, deterministic=False)
    x = jnp.ones((3, 64, 64))

    def run(ids, layer):
        return drop.apply({}, x, Rows(jnp.asarray(ids), layer), rngs={"dropout": jax.random.key(0)})

    y = np.asarray(run([0, 1, 2], 0))
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.75)}
    # A sampled share: 0.01 is 2.6 standard deviations of 12288 draws (this key's is 3.3e-4
    # off; a bound fitted to one draw would fail for other keys).
    assert abs((y > 0).mean() - 0.75) < 0.01
    assert (y[0] != y[1]).any() and (y[0] != np.asarray(run([0, 1, 2], 1))[0]).any()
    np.testing.assert_array_equal(np.asarray(run([2, 0, 1], 0))[1], y[0])


@pytest.mark.parametrize(
    "attention", [pytest.param("local", marks=pytest.mark.slow), "transient-global"]
)
def test_logical_names_shard_over_a_mesh_without_changing_results(attention):
    """The logical names are consistent: a data x tensor mesh runs the same forward and grads."""
    config = LongT5Config.preset("tiny", attention)
    params = random_params(config)
    batch = padded_batch(config, [21, 9, 17, 4], [5, 3, 5, 1], 21, 5)
    want_loss, want_grads = jax.value_and_grad(_loss)(params, config, batch)

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    rules = (("batch", "data"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))
    axes = nn.get_partition_spec(_abstract_params(config))["params"]
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        shardings = nn.logical_to_mesh_sharding(axes, mesh, rules)
        sharded = jax.device_put(params, shardings)
        assert sharded["decoder"]["logits_dense"]["kernel"].sharding.spec == PartitionSpec(
            None, "tensor"
        )
        # A fresh jit: logical rules are read while tracing, so no trace from outside may be reused.
        step = jax.jit(jax.value_and_grad(_loss_fn), static_argnums=1)
        hlo = step.lower(sharded, config, batch).as_text()
        assert "sharding_constraint" in hlo  # the activation names took effect
        loss, grads = step(sharded, config, batch)
    # Measured: the loss within 9.3e-8 relative (1 float32 ulp), gradients within 3.1e-6 of
    # each leaf's largest (local; 2.1e-6 TGlobal).
    assert max_rel(loss, want_loss)[1] <= 5e-7
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert max_rel(a, b)[1] <= 1e-5
