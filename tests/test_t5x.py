"""Reading and writing T5X / flaxformer LongT5 checkpoints (msgpack + tensorstore zarr arrays)."""

import os

import flax.serialization
import flax.traverse_util
import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from helpers import logits, padded_batch

from longt5_jax.formats import t5x
from longt5_jax.model import LongT5Config

# What T5X does not store; the tiny preset differs from LongT5Config's defaults in all three.
UNSTORED = dict(local_radius=3, global_block_size=4, relpos_max_distance=16)

# The T5X tree of spec §7.1, written out independently of the module's name table.
TOP = [
    "token_embedder/embedding",
    "encoder/relpos_bias/rel_embedding",
    "encoder/encoder_norm/scale",
    "decoder/relpos_bias/rel_embedding",
    "decoder/decoder_norm/scale",
    "decoder/logits_dense/kernel",
]
ATTN = [f"{p}/kernel" for p in ("query", "key", "value", "out")]
MLP = ["mlp/wi_0/kernel", "mlp/wi_1/kernel", "mlp/wo/kernel", "pre_mlp_layer_norm/scale"]
ENC_LAYER = ["pre_attention_layer_norm/scale", *(f"attention/{a}" for a in ATTN), *MLP]
DEC_LAYER = [
    "pre_self_attention_layer_norm/scale",
    *(f"self_attention/{a}" for a in ATTN),
    "pre_cross_attention_layer_norm/scale",
    *(f"encoder_decoder_attention/{a}" for a in ATTN),
    *MLP,
]


def _t5x_names(config):
    names = list(TOP)
    names += [
        f"encoder/layers_{i}/{n}" for i in range(config.num_encoder_layers) for n in ENC_LAYER
    ]
    names += [
        f"decoder/layers_{i}/{n}" for i in range(config.num_decoder_layers) for n in DEC_LAYER
    ]
    if config.attention == "transient-global":
        names.append("encoder/side_relpos_bias/rel_embedding")
        names += [
            f"encoder/layers_{i}/attention/T5LayerNorm_0/scale"
            for i in range(config.num_encoder_layers)
        ]
    return set(names)


def _random_params(config, seed=7):
    """Every leaf random (norm scales around 1), drawn with numpy: helpers.random_params runs
    the model's init op by op, which takes seconds on 2 cores; the shapes are the same."""
    rng = np.random.default_rng(seed)
    flat = {
        path: (float("scale" in path) + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        for path, shape in t5x._shapes(config).items()
    }
    return flax.traverse_util.unflatten_dict(flat, sep="/")


@pytest.fixture(scope="module", params=["local", "transient-global"])
def setup(request):
    config = LongT5Config.preset("tiny", request.param)
    params = _random_params(config)
    batch = padded_batch(config, [19, 11], [6, 4], 19, 6, seed=1)
    return config, params, batch


@pytest.fixture(scope="module")
def saved(setup, tmp_path_factory):
    config, params, _ = setup
    path = tmp_path_factory.mktemp(config.attention) / "checkpoint_1000"
    t5x.save(config, params, path, step=1000)
    return path


def _assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert y.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(x), y)


def _contents(path):
    return flax.serialization.msgpack_restore((path / "checkpoint").read_bytes())


def _write_contents(path, contents):
    (path / "checkpoint").write_bytes(flax.serialization.msgpack_serialize(contents))


def _flat_target(contents):
    is_spec = lambda x: isinstance(x, dict) and "kvstore" in x  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(contents["optimizer"]["target"], is_leaf=is_spec)
    return {"/".join(k.key for k in path): leaf for path, leaf in flat[0]}


def _read_like_t5x(ckpt_dir, spec):
    """T5X's `_read_ts`: drop chunks and compressor, resolve the relative path, open, read."""
    spec = {**spec, "metadata": dict(spec["metadata"]), "kvstore": dict(spec["kvstore"])}
    del spec["metadata"]["chunks"], spec["metadata"]["compressor"]
    spec["kvstore"]["path"] = os.path.join(ckpt_dir, spec["kvstore"]["path"])
    return ts.open(spec, open=True).result().read().result()


def test_save_then_load_is_exact(setup, saved):
    config, params, _ = setup
    loaded_config, loaded = t5x.load(saved, **UNSTORED)
    assert loaded_config == config
    _assert_same_tree(params, loaded)
    _assert_same_tree(params, t5x.load(saved / "checkpoint", **UNSTORED)[1])  # the msgpack file
    # Without overrides, what T5X does not store takes LongT5Config's (the released) defaults.
    default = t5x.load(saved)[0]
    assert (default.local_radius, default.global_block_size) == (127, 16)


def test_loaded_params_give_the_same_logits(setup, saved):
    config, params, batch = setup
    loaded_config, loaded = t5x.load(saved, **UNSTORED)
    ours = logits(config, params, batch)
    assert np.isfinite(ours).all() and ours.std() > 0.1
    np.testing.assert_array_equal(logits(loaded_config, loaded, batch), ours)


def test_the_layout_on_disk_is_t5x(setup, saved):
    config, params, _ = setup
    contents = _contents(saved)
    assert contents["version"] == 3
    assert set(contents["optimizer"]) == {"target", "state"}
    assert contents["optimizer"]["state"]["step"] == 1000
    flat = _flat_target(contents)
    assert set(flat) == _t5x_names(config)
    for name, spec in flat.items():
        directory = "target." + name.replace("/", ".")
        assert spec["driver"] == "zarr" and spec["dtype"] == "float32"
        assert spec["kvstore"]["driver"] == "file"
        assert spec["kvstore"]["path"].rstrip("/") == directory
        assert spec["metadata"]["compressor"]["id"] == "gzip"
        assert spec["metadata"]["chunks"] == spec["metadata"]["shape"]  # all under 64 MiB
        assert (saved / directory / ".zarray").is_file()
    assert {p.name for p in saved.iterdir()} == {"checkpoint"} | {
        "target." + n.replace("/", ".") for n in flat
    }

    d, hk = config.d_model, config.num_heads * config.d_kv
    query = flat["encoder/layers_1/attention/query/kernel"]
    out = flat["decoder/layers_0/encoder_decoder_attention/out/kernel"]
    assert query["metadata"]["shape"] == [d, hk] and out["metadata"]["shape"] == [hk, d]
    # Heads flattened head-major: column h*d_kv + k of the T5X kernel is ours [d, h, k].
    ours_q = np.asarray(params["encoder"]["layers"]["attention"]["query"]["kernel"][1])
    theirs_q = _read_like_t5x(saved, query)
    np.testing.assert_array_equal(theirs_q[:, 2 * config.d_kv + 3], ours_q[:, 2, 3])
    ours_o = np.asarray(params["decoder"]["layers"]["encoder_decoder_attention"]["out"]["kernel"])
    np.testing.assert_array_equal(_read_like_t5x(saved, out), ours_o[0].reshape(hk, d))
    rel = flat["encoder/relpos_bias/rel_embedding"]
    np.testing.assert_array_equal(
        _read_like_t5x(saved, rel), np.asarray(params["encoder"]["relpos_bias"]["rel_embedding"])
    )


def test_chunks_follow_t5x_for_large_arrays():
    # 32128 x 1024 float32 is 125.5 MiB: T5X halves the longest side (32128 -> 16064).
    assert t5x._chunks((32128, 1024)) == [16064, 1024]
    assert t5x._chunks((4096, 10240)) == [4096, 2560]  # 10240 -> 5120 -> 2560 (not 4096)
    assert t5x._chunks(()) == []


def _as_released_bfloat16(saved, dst):
    """The checkpoint as T5X writes it to GCS with save_dtype=bfloat16, plus optimizer state.

    Arrays go through tensorstore's cast driver onto bfloat16 zarr arrays, specs keep the `gcs`
    kvstore with T5X's dummy bucket; one small array is inline in the msgpack, as T5X stores
    unpartitioned values; `state` holds Adafactor slots whose arrays do not exist here.
    """
    dst.mkdir()
    contents = _contents(saved)
    target = contents["optimizer"]["target"]
    for name, spec in _flat_target(contents).items():
        x = _read_like_t5x(saved, spec)
        path = spec["kvstore"]["path"].rstrip("/")
        new = {**spec, "dtype": "bfloat16"}
        new["kvstore"] = {"driver": "gcs", "bucket": "t5x-dummy-bucket", "path": path}
        local = {**new, "kvstore": {"driver": "file", "path": str(dst / path)}}
        cast = {"driver": "cast", "dtype": "float32", "base": local}
        ts.open(cast, create=True).result().write(x).result()
        *parents, leaf = name.split("/")
        node = target
        for p in parents:
            node = node[p]
        node[leaf] = new
    target["encoder"]["encoder_norm"]["scale"] = (
        _read_like_t5x(saved, _flat_target(_contents(saved))["encoder/encoder_norm/scale"])
    ).astype(ml_dtypes.bfloat16)
    missing = {"driver": "zarr", "kvstore": {"driver": "file", "path": "state.param_states.x"}}
    contents["optimizer"]["state"]["param_states"] = {"x": {"v_row": missing}}
    _write_contents(dst, contents)


def test_bfloat16_checkpoints_load_as_float32(setup, saved, tmp_path):
    config, params, _ = setup
    _as_released_bfloat16(saved, tmp_path / "bf16")
    loaded_config, loaded = t5x.load(tmp_path / "bf16", **UNSTORED)
    assert loaded_config == config
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), params)
    _assert_same_tree(jax.tree.map(lambda x: x.astype(np.float32), rounded), loaded)
    # Our own bfloat16 save reads back the same.
    t5x.save(config, params, tmp_path / "ours", dtype="bfloat16")
    specs = _flat_target(_contents(tmp_path / "ours"))
    assert {spec["dtype"] for spec in specs.values()} == {"bfloat16"}
    _assert_same_tree(loaded, t5x.load(tmp_path / "ours", **UNSTORED)[1])


def test_bad_checkpoints_give_one_clear_error(saved, tmp_path):
    with pytest.raises(ValueError, match="nowhere: does not exist"):
        t5x.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not a T5X checkpoint .no `checkpoint` msgpack"):
        t5x.load(tmp_path)
    with pytest.raises(ValueError, match=r"pass one of its step directories \['checkpoint_1000'"):
        t5x.load(saved.parent)

    def broken(name, edit=None, raw=None):
        path = tmp_path / name
        path.mkdir()
        for p in saved.iterdir():
            if p.is_dir():
                os.symlink(p, path / p.name)
        if raw is not None:
            (path / "checkpoint").write_bytes(raw)
        else:
            contents = _contents(saved)
            edit(contents["optimizer"]["target"])
            _write_contents(path, contents)
        return path

    good = (saved / "checkpoint").read_bytes()
    with pytest.raises(ValueError, match="checkpoint: not a readable msgpack file"):
        t5x.load(broken("truncated", raw=good[: len(good) // 2]))
    with pytest.raises(ValueError, match="checkpoint: not a readable msgpack file"):
        t5x.load(broken("garbage", raw=b"\xc1\xc1 not msgpack"))
    with pytest.raises(ValueError, match="no optimizer/target tree"):
        t5x.load(broken("flax", raw=flax.serialization.msgpack_serialize({"params": {}})))

    def drop_wo(t):
        del t["decoder"]["layers_1"]["mlp"]["wo"]

    with pytest.raises(ValueError, match=r"missing \['decoder/layers_1/mlp/wo/kernel'\]"):
        t5x.load(broken("missing", drop_wo))

    def add_extra(t):
        t["encoder"]["extra"] = {"scale": np.zeros(3, np.float32)}

    with pytest.raises(ValueError, match=r"unexpected \['encoder/extra/scale'\]"):
        t5x.load(broken("extra", add_extra))

    def bad_shape(t):
        t["decoder"]["decoder_norm"]["scale"] = np.zeros(7, np.float32)

    with pytest.raises(ValueError, match=r"decoder/decoder_norm/scale has shape \(7,\)"):
        t5x.load(broken("shape", bad_shape))

    def point_elsewhere(t):
        t["encoder"]["encoder_norm"]["scale"]["kvstore"]["path"] = "target.gone"

    with pytest.raises(ValueError, match="target.gone: missing or unreadable array"):
        t5x.load(broken("gone", point_elsewhere))
    unreadable = broken("unreadable", raw=good)
    (unreadable / "target.encoder.encoder_norm.scale").unlink()
    (unreadable / "target.encoder.encoder_norm.scale").mkdir()
    (unreadable / "target.encoder.encoder_norm.scale" / ".zarray").write_text("{not json")
    with pytest.raises(ValueError, match="encoder_norm.scale: missing or unreadable array"):
        t5x.load(unreadable)

    with pytest.raises(ValueError, match="override num_heads=2, but the checkpoint's is 4"):
        t5x.load(saved, num_heads=2)
    with pytest.raises(ValueError, match="bad LongT5Config override"):
        t5x.load(saved, no_such_field=1)


def _snapshot(root):
    return {p.relative_to(root): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


def test_a_failed_save_keeps_what_was_there(setup, saved, tmp_path):
    config, params, _ = setup
    before = _snapshot(saved.parent)
    with pytest.raises(ValueError, match="already exists and is not empty"):
        t5x.save(config, params, saved)
    broken = {k: v for k, v in params.items() if k != "decoder"}
    with pytest.raises(ValueError, match=r"not a .* LongT5 tree of this config: missing"):
        t5x.save(config, broken, saved.parent / "checkpoint_2000")
    with pytest.raises(ValueError, match="save dtype 'float16'"):
        t5x.save(config, params, saved.parent / "checkpoint_2000", dtype="float16")
    # A failure after the arrays are written (here: a step that is no integer) cleans up too.
    with pytest.raises(ValueError, match="invalid literal"):
        t5x.save(config, params, saved.parent / "checkpoint_2000", step="two thousand")
    assert _snapshot(saved.parent) == before  # no partial checkpoint, no temporary left behind

    # An existing empty directory is filled (replaced by the rename).
    (tmp_path / "empty").mkdir()
    t5x.save(config, params, tmp_path / "empty")
    assert (tmp_path / "empty" / "checkpoint").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]
