"""Tokenizer, batching and packing, the grain pipeline (sharding, exact resume), gin and preview."""

import dataclasses
import json
import pickle

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from longt5_jax import configuration
from longt5_jax import data_preview as preview
from longt5_jax.data import batching
from longt5_jax.data.pipeline import DataConfig, load_tokenizer, make_dataset, open_split
from longt5_jax.data.sources import DataError
from longt5_jax.data.tokenizer import EOS_ID, Tokenizer, train_tokenizer

SMALL = DataConfig(input_length=256, target_length=64, batch_size=4, tokenizer_vocab_size=2000)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    import os

    os.environ["LONGT5_JAX_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    return load_tokenizer(SMALL)


def test_tokenizer_has_t5_layout_and_round_trips(tokenizer):
    assert tokenizer.vocab_size == tokenizer.piece_count + 100
    assert tokenizer.padded_vocab_size % 128 == 0 and tokenizer.padded_vocab_size >= 2100
    sentinels = tokenizer.sentinel_ids()
    assert sentinels[0] == tokenizer.vocab_size - 1 and sentinels[-1] == tokenizer.piece_count
    text = "Transient-global attention scales to long documents."
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and (ids > EOS_ID).all()
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([*ids[:2], sentinels[3], EOS_ID, *ids]).endswith("<extra_id_3>")
    copy = pickle.loads(pickle.dumps(tokenizer))  # grain workers get pickled copies
    np.testing.assert_array_equal(copy.encode(text), ids)


def test_trained_tokenizer_is_cached_by_content(tokenizer):
    again = load_tokenizer(SMALL)
    assert again.path == tokenizer.path
    other = train_tokenizer(
        ["a different corpus entirely"] * 50 + ["with more words"] * 50, 40, "t"
    )
    assert other != tokenizer.path


def test_bad_tokenizer_files_are_named(tmp_path):
    with pytest.raises(DataError, match="missing.model: SentencePiece model not found"):
        Tokenizer(tmp_path / "missing.model")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="bad.model: not a SentencePiece model"):
        Tokenizer(tmp_path / "bad.model")


def test_shift_right_restarts_each_segment():
    targets = np.array([[5, 6, 1, 7, 1, 0]])
    seg = np.array([[1, 1, 1, 2, 2, 0]])
    assert batching.shift_right(targets, seg).tolist() == [[0, 5, 6, 0, 7, 0]]


def _examples(ds, n):
    out = []
    for batch in ds:
        for r in range(batch["encoder_input_tokens"].shape[0]):
            for s in np.unique(batch["encoder_segment_ids"][r]):
                if s == 0:
                    continue
                enc = batch["encoder_input_tokens"][r][batch["encoder_segment_ids"][r] == s]
                dec = batch["decoder_target_tokens"][r][batch["decoder_segment_ids"][r] == s]
                out.append((tuple(enc), tuple(dec)))
        if len(out) >= n:
            return out
    return out


@pytest.mark.parametrize("objective", ["summarization", "span_corruption", "gap_sentences"])
def test_packing_loses_no_token_and_marks_segments(tokenizer, objective):
    cfg = dataclasses.replace(
        SMALL, objective=objective, shuffle=False, num_epochs=1, input_length=512, target_length=128
    )
    padded = _examples(make_dataset(cfg, tokenizer, "val", 0, 1), 10**6)
    packed_ds = make_dataset(dataclasses.replace(cfg, pack=True), tokenizer, "val", 0, 1)
    packed = _examples(packed_ds, 10**6)
    assert sorted(padded) == sorted(packed) and len(padded) == len(open_split(cfg, "val"))
    for batch in make_dataset(dataclasses.replace(cfg, pack=True), tokenizer, "val", 0, 1):
        seg, pos = batch["encoder_segment_ids"], batch["encoder_positions"]
        for row_seg, row_pos, row_tok in zip(seg, pos, batch["encoder_input_tokens"], strict=True):
            for s in np.unique(row_seg[row_seg > 0]):
                where = np.flatnonzero(row_seg == s)
                assert (np.diff(where) == 1).all()  # contiguous
                assert row_pos[where].tolist() == list(range(len(where)))
                assert row_tok[where[-1]] == EOS_ID
        weights = batch["decoder_loss_weights"]
        assert ((weights > 0) == (batch["decoder_segment_ids"] > 0)).all()


def _global_batches(cfg, tokenizer, count, steps, state=None):
    """`steps` global batches as `count` processes feed them (blocks of rows in process order),
    and the state they leave, in global terms."""
    streams = [make_dataset(cfg, tokenizer, "train", i, count) for i in range(count)]
    if state is not None:
        for s in streams:
            s.restore(state)
    batches = [
        {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
        for blocks in ([next(s) for s in streams] for _ in range(steps))
    ]
    position = [x for s in streams for x in s.position()]
    return batches, {"batch_size": cfg.batch_size, "next": position}


def _assert_same(want, got):
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("objective", ["summarization", "span_corruption", "gap_sentences"])
@pytest.mark.parametrize("pack", [False, True])
def test_a_position_saved_by_two_processes_resumes_on_one_and_four(tokenizer, objective, pack):
    cfg = dataclasses.replace(SMALL, objective=objective, pack=pack, batch_size=8)
    uninterrupted, _ = _global_batches(cfg, tokenizer, 1, 5)
    head, state = _global_batches(cfg, tokenizer, 2, 2)
    _assert_same(uninterrupted[:2], head)
    state = json.loads(json.dumps(state))  # survives a round trip through a file
    for count in (1, 2, 4):
        tail, _ = _global_batches(cfg, tokenizer, count, 3, state)
        _assert_same(uninterrupted[2:], tail)


@pytest.mark.parametrize("pack,workers", [(False, 2), (True, 3)])
def test_worker_processes_change_nothing_and_resume_exactly(tokenizer, pack, workers):
    cfg = dataclasses.replace(SMALL, pack=pack, objective="span_corruption", batch_size=8)
    want, _ = _global_batches(cfg, tokenizer, 1, 6)
    with_workers = dataclasses.replace(cfg, worker_count=workers)
    it = make_dataset(with_workers, tokenizer, "train", 0, 1)
    head = [next(it) for _ in range(3)]
    state = it.state()
    it.close()
    fresh = make_dataset(with_workers, tokenizer, "train", 0, 1)
    fresh.restore(state)
    _assert_same(want, head + [next(fresh) for _ in range(3)])
    fresh.close()


def test_rows_read_every_example_of_an_epoch_once(tokenizer):
    cfg = dataclasses.replace(SMALL, num_epochs=1, batch_size=4)
    n = len(open_split(cfg, "val"))
    seen = _examples(make_dataset(cfg, tokenizer, "val", 0, 1), 10**6)
    shares = [_examples(make_dataset(cfg, tokenizer, "val", i, 2), 10**6) for i in range(2)]
    assert len(seen) == n and len(set(seen)) == len(set(shares[0]) | set(shares[1]))
    assert sorted(shares[0] + shares[1]) == sorted(seen)
    assert not set(shares[0]) & set(shares[1])


def test_a_position_for_another_batch_size_is_refused(tokenizer):
    it = make_dataset(SMALL, tokenizer, "train", 0, 1)
    with pytest.raises(ValueError, match="batch_size=8; this run has batch_size=4"):
        it.restore({"batch_size": 8, "next": [0] * 8})


def test_epochs_are_reshuffled_and_complete(tokenizer):
    cfg = dataclasses.replace(SMALL, batch_size=1, num_epochs=2)
    n = len(open_split(cfg, "val"))
    seen = _examples(make_dataset(cfg, tokenizer, "val", 0, 1), 2 * n)
    first, second = seen[:n], seen[n:]
    assert sorted(first) == sorted(second) and first != second


def test_global_batch_lays_rows_over_the_data_axis(tokenizer):
    from longt5_jax.data.pipeline import global_batch

    batch = next(
        iter(make_dataset(dataclasses.replace(SMALL, batch_size=8), tokenizer, "val", 0, 1))
    )
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    arrays = global_batch(batch, NamedSharding(mesh, PartitionSpec("data")))
    x = arrays["encoder_input_tokens"]
    assert x.shape == (8, 256) and len(x.addressable_shards) == 8
    assert x.addressable_shards[0].data.shape == (2, 256)
    np.testing.assert_array_equal(np.asarray(x), batch["encoder_input_tokens"])


def test_gin_binds_data_config_and_rejects_bad_bindings(tmp_path):
    gin_file = tmp_path / "d.gin"
    gin_file.write_text("DataConfig.input_length = 1024\nDataConfig.pack = True\n")
    configuration.parse([str(gin_file)], ["DataConfig.batch_size = 16"])
    cfg = configuration.build(DataConfig)
    assert (cfg.input_length, cfg.pack, cfg.batch_size) == (1024, True, 16)
    with pytest.raises(configuration.ConfigError, match="doesn't have a parameter named 'lenght'"):
        configuration.parse([str(gin_file)], ["DataConfig.lenght = 3"])
    with pytest.raises(configuration.ConfigError, match="missing.gin: gin file not found"):
        configuration.parse([str(tmp_path / "missing.gin")])
    configuration.parse([], ["DataConfig.input_length = 'long'"])
    with pytest.raises(configuration.ConfigError, match="input_length = 'long': expected int"):
        configuration.build(DataConfig)
    configuration.parse([], ["DataConfig.objective = 'mlm'"])
    with pytest.raises(configuration.ConfigError, match="objective = 'mlm': expected 'summ"):
        configuration.build(DataConfig)


@pytest.mark.parametrize("name", ["aclsum.gin", "aclsum_pretrain.gin", "files_16k.gin"])
def test_shipped_data_gin_files_parse(name):
    configuration.parse([f"configs/data/{name}"], ["DataConfig.train_files = 'x.jsonl'"])
    cfg = configuration.build(DataConfig)
    assert cfg.input_length in (4096, 16384)


def test_preview_prints_shapes_and_an_example(tokenizer, capsys):
    rc = preview.main(
        [
            "--gin_file=configs/data/aclsum.gin",
            "--gin.DataConfig.input_length=512",
            "--gin.DataConfig.tokenizer_vocab_size=2000",
            "--gin.DataConfig.pack=True",
            "--num_batches=2",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "batch 1: encoder (8, 512)" in out and "examples/row" in out
    assert "example 0 inputs (" in out and "example 0 targets (" in out
    assert preview.main(["--gin.DataConfig.nope=1"]) == 2
