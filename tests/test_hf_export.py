"""A checkpoint exported for transformers with its tokenizer and generation defaults
(`ckpt convert native-to-hf`), and such a directory read back (`hf-to-native`): transformers'
tokenizers give our ids, its `generate` and summarization pipeline give `predict`'s text, and
`predict` runs on the converted-back checkpoint without --tokenizer."""

import dataclasses
import json

import numpy as np
import pytest
import transformers
from helpers import random_params

from longt5_jax import predict
from longt5_jax.ckpt.__main__ import main as ckpt
from longt5_jax.ckpt.convert import generation_settings, gin_lines, write_native
from longt5_jax.data.aclsum import aclsum_source
from longt5_jax.data.tokenizer import EOS_ID, EXTRA_IDS, UNK_ID, Tokenizer, train_tokenizer
from longt5_jax.formats.native import resolve, saved_tokenizer
from longt5_jax.model import LongT5Config
from longt5_jax.training.checkpoint import CheckpointConfig, Checkpoints

INPUT_LENGTH, TARGET_LENGTH = 64, 12
TEXTS = [
    "We propose a novel method for the summarization of long documents.",
    "  leading,   repeated  and trailing spaces  ",
    "Unknown characters: 日本語 😀 üñí ∮ ~~~",
    "tabs\tand\nnewlines, digits 12345 and (brackets) [x] {y}",
    "<extra_id_100> and <extra_id_05> are plain text, as is <extra_id_",
    "",
]
# transformers reads these strings typed in a text as the special ids; SentencePiece reads them
# as text, and so do we, as T5X and seqio do (their sentinels are inserted as ids, never typed).
SPECIAL_TEXTS = [
    "Sentinels <extra_id_0> inside<extra_id_1>. and <extra_id_99>",
    "a<extra_id_5>b <extra_id_3> . y </s> <pad> <unk> z",
]
DOCUMENTS = [
    "We present a dataset of scientific papers and their summaries.",
    "Our model outperforms the baselines on 日本語 text.",
    " ".join(["Long documents need long inputs, which local attention makes cheap."] * 12),
]


@pytest.fixture(scope="module")
def tokenizer():
    """A small T5-layout SentencePiece model: 300 pieces, 400 ids, a 512-row embedding."""
    source = aclsum_source("train")
    lines = [line for i in range(20) for line in source[i]["inputs"].split("\n") if line.strip()]
    return Tokenizer(train_tokenizer(lines, 300, "hf-export-test"))


def _words_only(params, tokenizer: Tokenizer):
    """The LM head with the unk, sentinel and padding ids' columns half an ordinary piece's:
    their logits stay below the top one (positive among hundreds), so greedy texts hold words
    only. transformers' decode(skip_special_tokens=True) drops those ids, where ours writes
    ' ⁇ ' and '<extra_id_i>'."""
    kernel = np.array(params["decoder"]["logits_dense"]["kernel"])  # [embed, vocab]
    special = [UNK_ID, *range(tokenizer.piece_count, kernel.shape[1])]
    kernel[:, special] = 0.5 * kernel[:, [tokenizer.piece_count - 1]]
    return {**params, "decoder": {**params["decoder"], "logits_dense": {"kernel": kernel}}}


class _Position:
    def state(self):
        return {"next": 0}


@pytest.fixture(scope="module")
def exported(tokenizer, tmp_path_factory):
    """(MODEL_DIR saved as a training run saves, with its tokenizer; its native-to-hf export)."""
    root = tmp_path_factory.mktemp("export")
    config = LongT5Config.preset("tiny", "transient-global", vocab_size=512)
    params = _words_only(random_params(config, seed=3), tokenizer)
    gin = f"DataConfig.input_length = {INPUT_LENGTH}\nDataConfig.target_length = {TARGET_LENGTH}\n"
    saves = Checkpoints(root / "run", CheckpointConfig(), tokenizer=tokenizer.proto)
    item = {"gin": gin + gin_lines(config), "model": dataclasses.asdict(config)}
    saves.save(0, {"params": params, "step": np.int32(0)}, _Position(), item, force=True)
    saves.close()
    assert ckpt(["convert", "native-to-hf", str(root / "run"), str(root / "hf")]) == 0
    return root / "run", root / "hf"


@pytest.fixture(scope="module")
def predicted(exported, tmp_path_factory):
    """`predict`'s summaries of DOCUMENTS from the native checkpoint."""
    root = tmp_path_factory.mktemp("predict")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"article": d}) + "\n" for d in DOCUMENTS))
    argv = ["--checkpoint", str(exported[0]), "--input", str(docs)]
    assert (
        predict.main(
            [*argv, "--output", str(root / "out.jsonl"), "--max_length", str(TARGET_LENGTH)]
        )
        == 0
    )
    return docs, [
        json.loads(x)["prediction"] for x in (root / "out.jsonl").read_text().splitlines()
    ]


def test_the_export_holds_the_tokenizer_and_generation_defaults(exported, tokenizer):
    _, out = exported
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "spiece.model",
        "tokenizer_config.json",
    ]
    assert (out / "spiece.model").read_bytes() == tokenizer.proto
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.decoder_start_token_id, generation.eos_token_id) == (0, 1)
    assert (generation.pad_token_id, generation.max_length) == (0, TARGET_LENGTH + 1)
    assert (generation.num_beams, generation.do_sample) == (1, False)  # DecodeConfig's defaults
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(theirs, transformers.T5TokenizerFast)
    assert len(theirs) == tokenizer.vocab_size == 400  # the model's 512 rows: T5's padding
    assert theirs.model_max_length == INPUT_LENGTH


def test_the_runs_decode_settings_become_transformers_generation_settings():
    gin = (
        "DataConfig.target_length = 64\nDecodeConfig.max_length = 0\n"
        "DecodeConfig.num_beams = 4\nDecodeConfig.length_penalty = 0.6\n"
        "DecodeConfig.early_stopping = 'finished'\nDecodeConfig.temperature = 0.0\n"
    )
    settings, note = generation_settings(gin)
    assert settings == {
        "num_beams": 4,
        "do_sample": False,
        "max_length": 65,  # target_length, when DecodeConfig.max_length is 0
        "length_penalty": 0.6,
        "early_stopping": True,
    }
    assert note == ""
    sampled, _ = generation_settings("DecodeConfig.temperature = 0.7\nDecodeConfig.top_p = 0.9\n")
    assert sampled == {
        "num_beams": 1,
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 0,
        "top_p": 0.9,
    }
    t5x = "DecodeConfig.num_beams = 2\nDecodeConfig.length_penalty_style = 't5x'\n"
    assert "not by the run's t5x penalty" in generation_settings(t5x)[1]
    # What transformers reads back from these settings, without complaint.
    transformers.GenerationConfig(**settings).validate(strict=True)


@pytest.mark.parametrize("fast", [True, False], ids=["T5TokenizerFast", "T5Tokenizer"])
def test_transformers_tokenizers_give_our_ids(exported, tokenizer, fast):
    theirs = transformers.AutoTokenizer.from_pretrained(exported[1], use_fast=fast)
    for text in TEXTS:
        assert theirs(text).input_ids == [*tokenizer.encode(text).tolist(), EOS_ID], text
    sentinels = [f"<extra_id_{i}>" for i in range(EXTRA_IDS)]
    assert theirs.convert_tokens_to_ids(sentinels) == tokenizer.sentinel_ids().tolist()
    assert UNK_ID in tokenizer.encode(TEXTS[2])
    for text in SPECIAL_TEXTS:  # the one documented difference (docs/checkpoints.md)
        special = set(theirs(text).input_ids) & {*tokenizer.sentinel_ids().tolist(), 0, UNK_ID}
        assert special and not special & set(tokenizer.encode(text).tolist()), text


@pytest.mark.slow  # with the predict run it compares with: 10-20 s
def test_generate_and_the_pipeline_give_predicts_text(exported, predicted):
    _, out = exported
    _, ours = predicted
    assert all(ours)  # summaries to compare, not EOS at once
    model = transformers.LongT5ForConditionalGeneration.from_pretrained(out).eval()
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    # truncation: at the trained input length, EOS kept, as predict truncates
    batch = theirs(DOCUMENTS, truncation=True, padding=True, return_tensors="pt")
    assert batch.input_ids.shape[1] == INPUT_LENGTH
    tokens = model.generate(**batch)  # greedy, TARGET_LENGTH tokens at most: generation_config
    assert theirs.batch_decode(tokens, skip_special_tokens=True) == ours
    summarize = transformers.pipeline("summarization", model=str(out))
    short = DOCUMENTS[:2]  # the pipeline does not truncate
    (beams,) = summarize(short[0])  # its own default, which no generation_config overrides
    assert summarize.generation_config.num_beams == 4 and beams["summary_text"]
    assert [r["summary_text"] for r in summarize(short, num_beams=1)] == ours[:2]


@pytest.mark.slow  # another predict run
def test_hf_to_native_keeps_the_tokenizer_for_predict(exported, predicted, tokenizer, tmp_path):
    _, out = exported
    docs, ours = predicted
    assert ckpt(["convert", "hf-to-native", str(out), str(tmp_path / "back")]) == 0
    assert saved_tokenizer(resolve(tmp_path / "back")) == tokenizer.proto
    argv = ["--checkpoint", str(tmp_path / "back"), "--input", str(docs)]
    argv += ["--output", str(tmp_path / "out.jsonl"), "--max_length", str(TARGET_LENGTH)]
    argv += ["--input_length", str(INPUT_LENGTH)]  # a converted checkpoint names none
    assert predict.main(argv) == 0  # no --tokenizer
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(x)["prediction"] for x in lines] == ours


def _converted(capsys, *argv) -> str:
    assert ckpt(["convert", *map(str, argv)]) == 0
    return capsys.readouterr().out.strip()


def test_a_source_without_a_tokenizer_says_how_to_add_one(exported, tokenizer, tmp_path, capsys):
    config = LongT5Config.preset("tiny", "local", vocab_size=512)
    write_native(tmp_path / "bare", config, random_params(config), "test")
    report = _converted(capsys, "native-to-hf", tmp_path / "bare", tmp_path / "hf")
    wrote, note = report.splitlines()
    assert note.startswith("no tokenizer written: ") and "--tokenizer PATH" in note
    assert not (tmp_path / "hf" / "spiece.model").exists()
    assert "max_length" not in json.loads((tmp_path / "hf" / "generation_config.json").read_text())

    report = _converted(capsys, "hf-to-native", tmp_path / "hf", tmp_path / "back")
    assert "no tokenizer written: " in report
    assert saved_tokenizer(resolve(tmp_path / "back")) is None

    argv = ["--tokenizer", tokenizer.path]
    report = _converted(capsys, "native-to-hf", tmp_path / "bare", tmp_path / "hf2", *argv)
    assert report == f"wrote {tmp_path / 'hf2'}"  # no note
    assert (tmp_path / "hf2" / "spiece.model").read_bytes() == tokenizer.proto
    report = _converted(capsys, "hf-to-native", tmp_path / "hf", tmp_path / "b2", *argv)
    assert report == f"wrote {tmp_path / 'b2'}"
    assert saved_tokenizer(resolve(tmp_path / "b2")) == tokenizer.proto


def _error(capsys, *argv) -> str:
    assert ckpt(["convert", *map(str, argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_bad_tokenizers_are_one_line_errors(exported, tokenizer, tmp_path, capsys):
    run, out = exported
    missing, bad = tmp_path / "missing.model", tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    small = LongT5Config.preset("tiny", "local")  # 256 rows: too few for 400 ids
    write_native(tmp_path / "small", small, random_params(small), "test")
    cases = [
        ("native-to-hf", run, missing, "missing.model: SentencePiece model not found"),
        ("hf-to-native", out, missing, "missing.model: SentencePiece model not found"),
        ("native-to-hf", run, bad, "bad.model: not a SentencePiece model"),
        ("native-to-hf", tmp_path / "small", tokenizer.path, "more ids than the model's vocab"),
    ]
    for direction, src, path, message in cases:
        assert message in _error(capsys, direction, src, tmp_path / "o", "--tokenizer", path)
    broken = tmp_path / "broken"  # a transformers directory whose spiece.model is damaged
    broken.mkdir()
    for f in out.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "spiece.model").write_bytes(b"\x00" * 16)
    assert "spiece.model: not a SentencePiece model" in _error(
        capsys, "hf-to-native", broken, tmp_path / "o"
    )
    assert not (tmp_path / "o").exists()
