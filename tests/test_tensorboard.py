"""TensorBoard as T5X lays it out, read back with TensorBoard's own reader: training and the
evaluated split as two runs sharing tag names, the operative config as text at step 0, the
hyperparameters in the HParams plugin, and a resume that drops what it replays."""

import json
import shutil

import pytest
from helpers import TINY_RUN
from tensorboard.backend.event_processing import event_multiplexer
from tensorboard.plugins.hparams import plugin_data_pb2

from longt5_jax import train


def _runs(model_dir):
    reader = event_multiplexer.EventMultiplexer()
    reader.AddRunsFromDirectory(str(model_dir / "tensorboard"))
    reader.Reload()
    return reader


def _scalars(reader, run, tag):
    return {e.step: e.value for e in reader.Scalars(run, tag)}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("run")
    argv = [
        *TINY_RUN,
        "--gin.RunConfig.train_steps=4",
        "--gin.EvalConfig.loss_every=2",
        "--gin.EvalConfig.loss_examples=4",
        f"--gin.MODEL_DIR='{model_dir}'",
    ]
    assert train.main(argv) == 0
    return model_dir


def test_train_and_eval_are_runs_of_their_own_with_the_same_tags(run_dir):
    reader = _runs(run_dir)
    assert set(reader.Runs()) == {"train", "training_eval/val"}
    train_tags = set(reader.Runs()["train"]["scalars"])
    eval_tags = set(reader.Runs()["training_eval/val"]["scalars"])
    assert {"loss", "accuracy"} <= train_tags & eval_tags  # they overlay in one chart
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    logged = {r["step"]: r for r in rows if "loss" in r}
    evals = {r["step"]: r for r in rows if "eval/loss" in r}
    assert sorted(evals) == [2, 4]
    assert _scalars(reader, "train", "loss") == pytest.approx(
        {s: r["loss"] for s, r in logged.items()}, rel=1e-6
    )
    assert _scalars(reader, "training_eval/val", "loss") == pytest.approx(
        {s: r["eval/loss"] for s, r in evals.items()}, rel=1e-6
    )


def test_the_operative_config_and_the_hyperparameters_are_in_the_train_run(run_dir):
    reader = _runs(run_dir)
    (config,) = reader.Tensors("train", "config/text_summary")
    assert config.step == 0
    text = config.tensor_proto.string_val[0].decode()
    assert "ParallelConfig.zero_stage = %ZERO_STAGE" in text
    assert (run_dir / "config.gin").read_text().splitlines()[0].strip() in text
    content = reader.PluginRunToTagToContent("hparams")["train"]
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]
    ).session_start_info
    assert start.hparams["data.batch_size"].number_value == 8
    assert start.hparams["model.attention"].string_value == "transient-global"
    assert start.hparams["parallel.tensor"].number_value == 2


def test_a_resumed_run_replaces_the_steps_it_replays(tmp_path):
    argv = [*TINY_RUN, f"--gin.MODEL_DIR='{tmp_path}'", "--gin.CheckpointConfig.save_every=2"]
    assert train.main([*argv, "--gin.RunConfig.train_steps=3"]) == 0
    # As if the run had died after logging step 3 but before saving it: it resumes from step 2.
    shutil.rmtree(tmp_path / "checkpoints" / "3")
    assert train.main([*argv, "--gin.RunConfig.train_steps=4"]) == 0
    events = _runs(tmp_path).Scalars("train", "loss")
    assert [e.step for e in events] == [1, 2, 3, 4]  # step 3 once, from the resumed run
