"""Reading and writing transformers LongT5 directories."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import safetensors
import torch
import transformers
from helpers import logits, padded_batch, random_params, torch_model

from longt5_jax.formats import hf
from longt5_jax.model import LongT5Config


@pytest.fixture(scope="module", params=["local", "transient-global"])
def setup(request):
    config = LongT5Config.preset("tiny", request.param)
    params = random_params(config, seed=7)
    batch = padded_batch(config, [19, 11], [6, 4], 19, 6, seed=1)
    return config, params, batch


def _torch_logits(model, batch):
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(batch.input_ids).long(),
            attention_mask=torch.tensor(batch.attention_mask),
            decoder_input_ids=torch.tensor(batch.decoder_input_ids).long(),
        ).logits.numpy()


def _assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_then_load_is_exact(setup, tmp_path):
    config, params, _ = setup
    hf.save(config, params, tmp_path)
    loaded_config, loaded = hf.load(tmp_path)
    assert loaded_config == config
    _assert_same_tree(params, loaded)


def test_transformers_loads_our_save_with_the_same_logits(setup, tmp_path):
    config, params, batch = setup
    hf.save(config, params, tmp_path)
    model, info = transformers.LongT5ForConditionalGeneration.from_pretrained(
        tmp_path, output_loading_info=True
    )
    # The stacks' embeddings are shared.weight, stored once: transformers calls them missing
    # (as it does reading its own save of this model), then ties them to it.
    aliases = ["decoder.embed_tokens.weight", "encoder.embed_tokens.weight"]
    assert info == {**dict.fromkeys(info, []), "missing_keys": aliases}, info
    assert model.encoder.embed_tokens.weight is model.shared.weight
    assert model.decoder.embed_tokens.weight is model.shared.weight
    assert model.num_parameters() == sum(x.size for x in jax.tree.leaves(params))
    assert not model.config.tie_word_embeddings
    theirs = _torch_logits(model.eval(), batch)
    np.testing.assert_allclose(logits(config, params, batch), theirs, rtol=1e-5, atol=1e-4)


def test_our_save_is_the_size_of_transformers_own(setup, tmp_path):
    """Each tensor once: the same tensors as save_pretrained writes for a model transformers
    builds from our config.json and fills with our weights, model.safetensors within 1% of its
    size (transformers' metadata header differs by a few bytes)."""
    config, params, _ = setup
    hf.save(config, params, tmp_path / "ours")
    model = transformers.LongT5ForConditionalGeneration(
        transformers.LongT5Config.from_pretrained(tmp_path / "ours")
    )
    state = {k: torch.tensor(v) for k, v in hf.to_hf(config, params).items()}
    model.load_state_dict(state, strict=False)  # the stacks' embed_tokens are shared.weight
    model.save_pretrained(tmp_path / "theirs")
    ours, theirs = (tmp_path / d / "model.safetensors" for d in ("ours", "theirs"))
    assert ours.stat().st_size == pytest.approx(theirs.stat().st_size, rel=0.01)
    assert sorted(safetensors.safe_open(ours, "np").keys()) == sorted(
        safetensors.safe_open(theirs, "np").keys()
    )


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_load_reads_transformers_saves_including_shards(setup, tmp_path, safe):
    config, params, _ = setup
    torch_model(config, params).save_pretrained(
        tmp_path, safe_serialization=safe, max_shard_size="40KB"
    )
    assert list(tmp_path.glob("*.index.json"))  # sharded
    loaded_config, loaded = hf.load(tmp_path)
    assert loaded_config == dataclasses.replace(config, dropout_rate=loaded_config.dropout_rate)
    _assert_same_tree(params, loaded)


def test_tied_checkpoints_load_with_the_output_scale_folded_in(setup, tmp_path):
    config, params, batch = setup
    hf_config = transformers.LongT5Config(
        **{**hf.config_to_hf(config), "tie_word_embeddings": True}
    )
    model = transformers.LongT5ForConditionalGeneration(hf_config).eval()
    model.save_pretrained(tmp_path)
    loaded_config, loaded = hf.load(tmp_path)
    np.testing.assert_allclose(
        logits(loaded_config, loaded, batch), _torch_logits(model, batch), rtol=1e-5, atol=1e-4
    )


def test_bad_directories_give_one_clear_error(setup, tmp_path):
    config, params, _ = setup
    with pytest.raises(FileNotFoundError, match="config.json: missing"):
        hf.load(tmp_path)
    hf.save(config, params, tmp_path)
    config_file = tmp_path / "config.json"
    good = json.loads(config_file.read_text())

    config_file.write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        hf.load(tmp_path)
    config_file.write_text(json.dumps({**good, "model_type": "t5"}))
    with pytest.raises(ValueError, match="model_type is 't5', expected 'longt5'"):
        hf.load(tmp_path)
    config_file.write_text(json.dumps({**good, "feed_forward_proj": "relu"}))
    with pytest.raises(ValueError, match="feed_forward_proj is 'relu'"):
        hf.load(tmp_path)
    other = "local" if config.attention == "transient-global" else "transient-global"
    config_file.write_text(json.dumps({**good, "encoder_attention_type": other}))
    with pytest.raises(ValueError, match=f"not a {other} LongT5 checkpoint"):
        hf.load(tmp_path)
    config_file.write_text(json.dumps({**good, "num_layers": 3}))
    with pytest.raises(ValueError, match="missing .*encoder.block.2"):
        hf.load(tmp_path)

    config_file.write_text(json.dumps(good))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        hf.load(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or pytorch_model.bin"):
        hf.load(tmp_path)


def test_a_failed_save_keeps_what_was_there(setup, tmp_path):
    config, params, _ = setup
    hf.save(config, params, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    broken = {k: v for k, v in params.items() if k != "decoder"}
    with pytest.raises(ValueError, match="params are not a .* LongT5 tree"):
        hf.save(config, broken, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
