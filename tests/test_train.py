"""The training entry point: gin handling, a short real run, and the shipped gin files."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_RUN, child_env, train_command

from longt5_jax import configuration, train
from longt5_jax.data.pipeline import DataConfig
from longt5_jax.model import LongT5Config
from longt5_jax.parallel.mesh import ParallelConfig
from longt5_jax.training.checkpoint import CheckpointConfig
from longt5_jax.training.optim import OptimizerConfig
from longt5_jax.training.run_config import RunConfig
from longt5_jax.training.step import StepConfig


def test_a_short_run_writes_metrics_config_and_a_checkpoint(tmp_path, capsys):
    auto = "--gin.LongT5Config.attention_kernel='auto'"  # as the run files: XLA's on CPUs
    rc = train.main([*TINY_RUN, auto, f"--gin.MODEL_DIR='{tmp_path}'"])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"loss", "learning_rate", "grad_norm", "tokens_per_second"} <= r.keys()
    assert "ParallelConfig.zero_stage" in (tmp_path / "config.gin").read_text()
    assert (tmp_path / "checkpoints" / "4").is_dir()
    assert list((tmp_path / "tensorboard").iterdir())
    out = capsys.readouterr().out
    assert "step      4/4  loss" in out
    assert " devices, attention_kernel=xla\n" in out
    summary = out[out.index("run summary: ") :].splitlines()
    assert summary[0].startswith("run summary: trained steps 1-4 of 4 in ")
    assert " tokens/s after the first step" in summary[0]
    assert summary[1].startswith(f"  train        step 4: loss {rows[-1]['loss']:.4f}  grad_norm ")
    assert summary[2:] == _files(tmp_path, 4)


def _files(model_dir: Path, step: int) -> list[str]:
    """The summary's lines on where a run's files are and the commands that use them."""
    return [
        f"  checkpoints  {model_dir}/checkpoints (newest: step {step})",
        f"  metrics      {model_dir}/metrics.jsonl",
        f"  TensorBoard  tensorboard --logdir {model_dir}/tensorboard",
        f"  evaluate     python -m longt5_jax.evaluate --gin_file={model_dir}/config.gin "
        f"--checkpoint={model_dir}",
        f"  predict      python -m longt5_jax.predict --checkpoint={model_dir} "
        "--input=DOCS.jsonl --output=PREDICTIONS.jsonl",
        f"  export       python -m longt5_jax.ckpt convert native-to-hf {model_dir} HF_DIR",
    ]


def _files_on_disk(model_dir: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `model_dir`: when it was last written, and what it holds."""
    return {
        str(p.relative_to(model_dir)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(model_dir.rglob("*"))
        if p.is_file()
    }


def test_a_rerun_of_a_finished_run_says_so_and_fewer_steps_are_refused(tmp_path, capsys):
    """The same command again: nothing left to train, said with where the files are; with
    RunConfig.train_steps below the saved step: refused in one line. Neither writes anything
    (config.gin, TensorBoard, metrics.jsonl and the checkpoints as they were)."""
    argv = [*TINY_RUN, "--gin.RunConfig.train_steps=2", f"--gin.MODEL_DIR='{tmp_path}'"]
    assert train.main(argv) == 0
    capsys.readouterr()
    before = _files_on_disk(tmp_path)
    assert train.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [
        f"nothing left to train: step 2 of RunConfig.train_steps=2 is saved in {tmp_path}/"
        "checkpoints; raise RunConfig.train_steps to train on",
        *_files(tmp_path, 2),
    ]
    assert _files_on_disk(tmp_path) == before
    assert train.main([*argv, "--gin.RunConfig.train_steps=1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: RunConfig.train_steps=1 is below step 2 saved in {tmp_path}/checkpoints: nothing "
        "was changed; set RunConfig.train_steps >= 2 to train on, or another MODEL_DIR to start "
        "anew"
    ]
    assert _files_on_disk(tmp_path) == before


@pytest.mark.slow
def test_a_resumed_run_repeats_the_uninterrupted_losses_exactly(tmp_path):
    """Stop after 3 steps (saved), rerun to 6: the same batches and bitwise the same losses."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = [*TINY_RUN, "--gin.CheckpointConfig.save_every=2"]
    assert train.main([*common, "--gin.RunConfig.train_steps=6", f"--gin.MODEL_DIR='{whole}'"]) == 0
    assert train.main([*common, "--gin.RunConfig.train_steps=3", f"--gin.MODEL_DIR='{split}'"]) == 0
    assert train.main([*common, "--gin.RunConfig.train_steps=6", f"--gin.MODEL_DIR='{split}'"]) == 0

    def losses(d):
        return [
            (r["step"], r["loss"], r["grad_norm"])
            for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
        ]

    assert losses(split) == losses(whole) and len(losses(whole)) == 6
    saved = sorted(int(p.name) for p in (split / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [4, 6]  # saves at 2, 3 (forced), 4, 6 (forced); demo.gin keeps the last 2


@pytest.mark.parametrize("skip", [pytest.param(False, marks=pytest.mark.slow), True])
def test_nonfinite_steps_stop_the_run_or_are_skipped(tmp_path, capsys, skip):
    # A learning rate of 1e30 sends the parameters to Inf after the first update.
    args = [
        *TINY_RUN,
        "--gin.OptimizerConfig.learning_rate=1e30",
        f"--gin.MODEL_DIR='{tmp_path}'",
        "--gin.OptimizerConfig.grad_clip_norm=0.0",
        f"--gin.StepConfig.skip_nonfinite={skip}",
    ]
    rc = train.main(args)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    bad = [r["step"] for r in rows if not math.isfinite(r["loss"] + r["grad_norm"])]
    assert bad and bad[0] > 1
    if not skip:
        assert rc == 1
        err = capsys.readouterr().err
        assert f"step {bad[0]}: the loss or gradient is NaN/Inf; stopping" in err
        assert not (tmp_path / "checkpoints" / "4").exists()  # no non-finite state was saved
        return
    assert rc == 0 and rows[-1]["nonfinite_steps"] == len(bad)  # skipped, and the run finished
    assert (tmp_path / "checkpoints" / "4").is_dir()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--gin.LongT5Config.d_modle=3"], "doesn't have a parameter named 'd_modle'"),
        ([], "MODEL_DIR is required: set it in a gin file or with --gin.MODEL_DIR=VALUE"),
        (
            ["--gin.MODEL_DIR='/tmp/x'", "--gin.ParallelConfig.tensor=3"],
            "mesh data=4 x tensor=3 x pipeline=1 does not match 8 devices",
        ),
        (
            ["--gin.MODEL_DIR='/tmp/x'", "--gin.OptimizerConfig.learning_rate='fast'"],
            "learning_rate = 'fast': expected float",
        ),
        (["--gin.MODEL_DIR='/tmp/x'", "--steps=3"], "unknown arguments"),
    ],
)
def test_bad_configuration_is_one_line_naming_the_binding(args, message, capsys):
    argv = ["--gin_file=configs/demo.gin", "--gin.RunConfig.cpu_devices=0", *args]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_print_config_shows_the_resolved_bindings(capsys):
    assert (
        train.main(["--gin_file=configs/demo.gin", "--gin.MODEL_DIR='/tmp/x'", "--print_config"])
        == 0
    )
    out = capsys.readouterr().out
    assert "ZERO_STAGE = 3" in out and "ParallelConfig.zero_stage = %ZERO_STAGE" in out
    assert "MODEL_DIR = '/tmp/x'" in out


def test_the_old_gin_name_of_the_parallel_config_still_binds_with_one_notice(tmp_path, capsys):
    configuration._WARNED.clear()
    # In a file, the old name fills what the new one leaves unset; the new name's own win.
    old = tmp_path / "old.gin"
    old.write_text("MeshConfig.offload = 'optimizer'\nMeshConfig.tensor = 4\n")
    configuration.parse(["configs/parallel/dp4_tp2.gin", str(old)])
    built = configuration.build(ParallelConfig)
    assert (built.data, built.tensor, built.offload) == (4, 2, "optimizer")
    configuration.build(ParallelConfig)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "warning: MeshConfig.offload: the gin name MeshConfig is deprecated, write "
        "ParallelConfig.offload (the old name works for this release only)"
    ]
    configuration.parse([], ["MeshConfig.tensor = 'two'"])
    with pytest.raises(configuration.ConfigError, match="tensor = 'two': expected int"):
        configuration.build(ParallelConfig)


@dataclasses.dataclass(frozen=True)
class _ParallelOnly:
    parallel: ParallelConfig


def test_an_old_gin_name_on_the_command_line_wins_over_the_files_new_one(capsys):
    """`--gin.MeshConfig.data=2` on the demo (whose file binds ParallelConfig.data = 4): the
    run's mesh is the one asked for, as with any command-line binding, and the old name is
    announced once."""
    configuration._WARNED.clear()
    argv = ["--gin_file=configs/demo.gin", "--gin.MODEL_DIR='/tmp/x'", "--gin.MeshConfig.data=2"]
    built, _ = configuration.from_args([*argv, "--gin.MeshConfig.tensor=4"], _ParallelOnly)
    assert (built.parallel.data, built.parallel.tensor) == (2, 4)
    assert capsys.readouterr().err.splitlines() == [
        "warning: MeshConfig.data: the gin name MeshConfig is deprecated, write "
        "ParallelConfig.data (the old name works for this release only)"
    ]


def test_data_files_bind_as_a_list_and_a_bad_value_is_one_line_naming_the_binding():
    """A list in gin, or one file alone as a string; the operative config keeps what was
    written (a run's config.gin is read again by evaluate and resumes)."""
    bindings = [
        "DataConfig.train_files = ['a/*.jsonl', 'b.parquet']",
        "DataConfig.eval_files = 'c'",
    ]
    configuration.parse([], bindings)
    data = configuration.build(DataConfig)
    assert (data.train_files, data.eval_files) == (("a/*.jsonl", "b.parquet"), ("c",))
    assert "DataConfig.train_files = ['a/*.jsonl', 'b.parquet']" in configuration.operative_config()
    for value, expected in [
        ("3", "DataConfig.train_files = 3: expected a list of str"),
        ("['a', 3]", "DataConfig.train_files = ['a', 3]: expected a list of str"),
        ("'a,b'", "DataConfig.train_files = 'a,b': expected a list of str: write ['a', 'b']"),
    ]:
        configuration.parse([], [f"DataConfig.train_files = {value}"])
        with pytest.raises(configuration.ConfigError) as raised:
            configuration.build(DataConfig)
        assert str(raised.value) == expected


def _gin_files(folder):
    return sorted(str(p) for p in Path("configs", folder).glob("*.gin"))


@pytest.mark.parametrize("path", _gin_files("models"))
def test_model_gin_files_build(path):
    configuration.parse([path])
    config = configuration.build(LongT5Config)
    assert config.attention in path.replace("tglobal", "transient-global")


@pytest.mark.parametrize("path", _gin_files("parallel"))
@pytest.mark.parametrize("stage", [0, 3])
def test_parallel_gin_files_build(path, stage):
    configuration.parse([path], [f"ZERO_STAGE = {stage}"])
    mesh = configuration.build(ParallelConfig)
    devices = mesh.data * mesh.tensor * mesh.pipeline  # 8 (tests, the demo) or 32 (the cluster)
    assert mesh.zero_stage == stage and devices in (8, 32) and np.prod(mesh.shape(devices))


@pytest.mark.parametrize("path", [*_gin_files("runs"), "configs/demo.gin"])
def test_run_gin_files_build(path):
    configuration.parse(
        ["configs/models/base_tglobal.gin", "configs/parallel/dp8.gin", path],
        ["MODEL_DIR = '/tmp/x'", "INIT_FROM = '/tmp/y'", "DataConfig.train_files = ['x.jsonl']"],
    )
    for cls in (
        CheckpointConfig,
        RunConfig,
        DataConfig,
        OptimizerConfig,
        StepConfig,
        LongT5Config,
        ParallelConfig,
    ):
        configuration.build(cls)


# The README's main job, its first 6 steps: the same command and program as the whole 60,
# which take five minutes on 2 cores (the README reports their losses).
DEMO_STEPS = [
    "--gin.RunConfig.train_steps=6",
    "--gin.RunConfig.log_every=3",
    "--gin.EvalConfig.loss_every=3",
    "--gin.EvalConfig.loss_examples=8",
    "--gin.EvalConfig.rouge_every=6",
]
# ... and the evaluation command on as many papers: one batch of 8, the papers the run's ROUGE
# reads (the whole split of 50, in training's evaluations and this one, took about 30 s more
# here).
DEMO_EVAL = ["--limit=8"]


@pytest.mark.slow
def test_the_demo_command_as_a_new_user_runs_it(tmp_path):
    """The README's main job in a fresh process (shortened to 6 steps and evaluating 8 of the
    50 validation papers), then its evaluation command on the checkpoint; about 1.5 minutes on
    2 cores."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "longt5_jax.train",
            "--gin_file=configs/demo.gin",
            f"--gin.MODEL_DIR='{tmp_path}'",
            *DEMO_STEPS,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = {r["step"]: r for r in rows if "loss" in r}
    # Measured 9.45 -> 8.86 in the warm-up (demo.gin's 5 steps).
    assert sorted(train_rows) == [3, 6] and train_rows[6]["loss"] < train_rows[3]["loss"] - 0.5
    assert "8 devices" in out.stdout and (tmp_path / "checkpoints" / "6").is_dir()
    evals = {r["step"]: r for r in rows if "eval/loss" in r}
    assert sorted(evals) == [3, 6] and evals[6]["eval/loss"] < evals[3]["eval/loss"]
    assert "eval/rouge1" in evals[6] and evals[6]["eval/tokens"] > 500

    # Then the README's evaluation command on that checkpoint.
    evaluate = [sys.executable, "-m", "longt5_jax.evaluate", f"--gin_file={tmp_path}/config.gin"]
    out = subprocess.run(
        [*evaluate, f"--checkpoint={tmp_path}", *DEMO_EVAL],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads((tmp_path / "eval" / "step_6" / "val_metrics.json").read_text())
    assert metrics["examples"] == 8 and metrics["rougeLsum"] > 0
    np.testing.assert_allclose(metrics["eval_loss"], evals[6]["eval/loss"], rtol=1e-5)
    predictions = (tmp_path / "eval" / "step_6" / "val_predictions.jsonl").read_text()
    assert len(predictions.splitlines()) == 8


@pytest.mark.slow
def test_sigterm_saves_and_a_rerun_resumes(tmp_path):
    """SLURM's warning signal: finish the step, save, exit 0; the same command resumes."""
    env = child_env("JAX_PLATFORMS")
    cmd = train_command(tmp_path, "--gin.RunConfig.train_steps=400")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    for line in proc.stdout:
        if line.startswith("step      3/400"):
            proc.send_signal(signal.SIGTERM)
            break
    out = proc.stdout.read()
    assert proc.wait(timeout=300) == 0, out
    saved = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    last = max(saved)
    assert 3 <= last < 400 and f"SIGTERM: saved step {last};" in out
    again = subprocess.run(
        [*cmd[:-2], "--gin.RunConfig.train_steps=" + str(saved[0] + 2), cmd[-1]],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert again.returncode == 0 and f"resumed from step {saved[0]}" in again.stdout
