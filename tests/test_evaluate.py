"""Evaluation and inference end to end on a short run's checkpoint: periodic eval during
training, `evaluate` (loss, ROUGE, predictions), `predict` on user files, and bad input."""

import contextlib
import io
import json
import shutil

import numpy as np
import pytest
from helpers import TINY_RUN

from longt5_jax import evaluate, predict, train
from longt5_jax.data.aclsum import aclsum_source
from longt5_jax.data.pipeline import DataConfig, load_tokenizer
from longt5_jax.infer.decode import DecodeConfig
from longt5_jax.infer.generator import from_checkpoint
from longt5_jax.infer.rouge import rouge
from longt5_jax.parallel.mesh import ParallelConfig

# One short training run feeds every test here; together they take about a minute: slow run.
pytestmark = pytest.mark.slow

EVAL = [
    "--gin.EvalConfig.loss_every=4",
    "--gin.EvalConfig.loss_examples=4",
    "--gin.EvalConfig.rouge_every=4",
    "--gin.EvalConfig.rouge_examples=4",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("run")
    assert train.main([*TINY_RUN, *EVAL, f"--gin.MODEL_DIR='{model_dir}'"]) == 0
    return model_dir


def _rows(model_dir):
    return [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_logs_eval_loss_and_rouge(run):
    (row,) = [r for r in _rows(run) if "eval/loss" in r]
    assert row["step"] == 4
    assert 0 < row["eval/loss"] < 20 and row["eval/tokens"] > 0
    assert {"eval/rouge1", "eval/rouge2", "eval/rougeL", "eval/rougeLsum"} <= row.keys()
    train_rows = [r for r in _rows(run) if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def evaluated(run):
    """`evaluate` of the run's checkpoint over what a killed earlier evaluate (or a copy cut
    short) leaves: half a predictions file and a leftover partial. Its output directory and
    what it printed."""
    argv = [f"--gin_file={run}/config.gin", f"--checkpoint={run}", "--limit=4"]
    out = run / "eval" / "step_4"
    out.mkdir(parents=True, exist_ok=True)
    (out / "val_predictions.jsonl").write_text('{"id": "0", "prediction": "a ha')
    (out / ".val_predictions.jsonl.x1y2.partial").write_text('{"id": "0", "predi')
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert evaluate.main([*argv, "--gin.RunConfig.cpu_devices=0"]) == 0
    return out, printed.getvalue()


def test_evaluate_writes_predictions_and_metrics_equal_to_the_periodic_eval(run, evaluated):
    out, printed = evaluated
    assert not list(out.glob(".*.partial"))
    metrics = json.loads((out / "val_metrics.json").read_text())
    records = [json.loads(x) for x in (out / "val_predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["0", "1", "2", "3"]
    assert records[0]["reference"] == aclsum_source("val")[0]["targets"]
    (periodic,) = [r for r in _rows(run) if "eval/loss" in r]
    # The same examples and parameters: the training-time numbers, from another code path.
    np.testing.assert_allclose(metrics["eval_loss"], periodic["eval/loss"], rtol=1e-5)
    assert metrics["rouge1"] == pytest.approx(periodic["eval/rouge1"], rel=1e-9)
    scores = rouge([r["reference"] for r in records], [r["prediction"] for r in records])
    assert {k: metrics[k] for k in scores} == scores
    assert metrics["examples"] == 4 and metrics["truncated_inputs"] == 4
    # Four inputs of 256 tokens in one batch of 8 rows at 256: grouping saves nothing here.
    assert metrics["input_padding"] == metrics["input_padding_file_order"] == 0.5
    assert "rouge1" in printed
    assert "padding: 50.0% of input positions (file order at full length: 50.0%)" in printed


def test_predict_on_user_files_gives_the_evaluate_predictions(run, evaluated, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    val = aclsum_source("val")
    # A short document first: decoded after the two long ones (longest first), written first.
    short = "Local attention makes long inputs cheap."
    texts = [short, val[0]["inputs"], val[1]["inputs"]]
    docs.write_text("".join(json.dumps({"article": t}) + "\n" for t in texts))
    out = tmp_path / "pred.jsonl"
    argv = ["--checkpoint", str(run), "--input", str(docs), "--output", str(out)]
    assert predict.main([*argv, "--max_length", "32"]) == 0
    printed = capsys.readouterr()
    assert "truncated to the first 255 and EOS" in printed.err
    # One batch of 8 rows (one a device) padded to 256, the long documents' length.
    tokenizer = load_tokenizer(DataConfig(tokenizer_vocab_size=2000))
    padding = 1 - (2 * 256 + len(tokenizer.encode(short)) + 1) / (8 * 256)
    line = f"padding: {padding:.1%} of input positions (file order at full length: {padding:.1%})"
    assert line in printed.out.splitlines()
    ours = [json.loads(x) for x in out.read_text().splitlines()]
    records = (evaluated[0] / "val_predictions.jsonl").read_text().splitlines()
    assert [r["id"] for r in ours] == ["1", "2", "3"]  # line numbers when records have no id
    assert [r["prediction"] for r in ours[1:]] == [json.loads(x)["prediction"] for x in records[:2]]

    # A checkpoint without a tokenizer (converted, or copied without it) says what to pass.
    bare = tmp_path / "bare" / "4"
    shutil.copytree(run / "checkpoints" / "4", bare)
    shutil.rmtree(bare / "tokenizer")
    text = tmp_path / "doc.txt"
    text.write_text(val[0]["inputs"])
    argv = ["--checkpoint", str(bare), "--input", str(text), "--output", str(tmp_path / "t.jsonl")]
    assert predict.main(argv) == 2
    assert "holds no tokenizer" in capsys.readouterr().err
    assert predict.main([*argv, "--tokenizer", str(tokenizer.path), "--max_length", "32"]) == 0
    (row,) = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert row == {"id": "doc", "prediction": ours[1]["prediction"]}


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"article": "text"}', '{"article": "  "}'], "empty documents on line(s) 2"),
        (['{"text": "a"}'], "expected a JSON object with a text field 'article'"),
        (["not json"], "expected a JSON object"),
    ],
)
def test_predict_bad_documents_are_one_line(run, tmp_path, capsys, lines, message):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    argv = ["--checkpoint", str(run), "--input", str(docs), "--output", str(out)]
    assert predict.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert out.read_text() == "kept\n"  # a failed run leaves what was there


def test_evaluate_bad_arguments_are_one_line(run, tmp_path, capsys):
    assert evaluate.main(["--checkpoint", str(tmp_path / "none")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert evaluate.main(["--checkpoint", str(run)]) == 2
    assert "--gin_file is required" in capsys.readouterr().err
    argv = [f"--gin_file={run}/config.gin", f"--checkpoint={run}", "--split=nope"]
    assert evaluate.main([*argv, "--gin.RunConfig.cpu_devices=0"]) == 2
    assert "aclsum has no split 'nope'" in capsys.readouterr().err


def test_a_checkpoint_trained_with_the_kernels_decodes_with_what_runs_here(run, tmp_path):
    """The training run's attention_kernel was for its devices: decoding takes what these
    CPUs run (XLA's attention, not interpreted kernels)."""
    copy = tmp_path / "run"
    shutil.copytree(run / "checkpoints" / "4", copy)
    saved = json.loads((copy / "config" / "metadata").read_text())
    saved["model"]["attention_kernel"] = "pallas"
    (copy / "config" / "metadata").write_text(json.dumps(saved))
    generator, config = from_checkpoint(copy, ParallelConfig(data=1), DecodeConfig(), 4)
    assert config.attention_kernel == "auto"
    assert generator.model.config.attention_kernel == "xla"
