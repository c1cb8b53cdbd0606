"""Faults a run meets, each ending in one line with what was saved kept: a full disk during a
save or under the logs, a signal at any moment (start-up and the first compile included; a
closed terminal's SIGHUP as SLURM's SIGTERM), the data running out, bad gin files, another
model's parameters, and a command line the checkpoint it names contradicts.

Signals at a chosen moment are raised by the process itself (deterministic, in this process);
the full disk and a signal at a moment the clock picks run as a user runs them, in processes of
their own (slow).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import (
    NO_EVAL,
    TINY_RUN,
    child_env,
    random_params,
    read_until,
    run_process,
    snapshot,
    start_process,
    train_command,
)

from longt5_jax import configuration, train
from longt5_jax.ckpt.convert import write_native
from longt5_jax.model import LongT5Config
from longt5_jax.training.periodic_eval import PeriodicEval
from longt5_jax.training.step import ShardedStep


@pytest.fixture(scope="module")
def env():
    return child_env("JAX_PLATFORMS")


def _steps(model_dir: Path) -> list[int]:
    rows = map(json.loads, (model_dir / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in rows if "loss" in r]


def _raise_before(monkeypatch, cls, name: str, *signals: int) -> None:
    """cls.name raises `signals` in this process on its first call, then runs."""
    original, calls = getattr(cls, name), []

    def wrapped(self, *args, **kwargs):
        if not calls:
            calls.append(1)
            for sig in signals:
                signal.raise_signal(sig)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapped)


def _tiny(model_dir: Path, *extra: str) -> list[str]:
    return [*TINY_RUN, *NO_EVAL, *extra, f"--gin.MODEL_DIR='{model_dir}'"]


def test_a_signal_during_start_up_ends_cleanly_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """SIGTERM after the state is built and before any step (the eval data being read): the
    run stops before its first step and MODEL_DIR is as it was (here: never made)."""
    _raise_before(monkeypatch, PeriodicEval, "open", signal.SIGTERM)
    assert train.main(_tiny(tmp_path / "run")) == 0
    out = capsys.readouterr()
    assert "SIGTERM: stopped before step 1; nothing new to save" in out.out
    assert "Traceback" not in out.err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_during_the_first_compile_saves_the_first_step(tmp_path, monkeypatch, capsys, sig):
    """SIGTERM (or SIGHUP: the terminal closed) as the first step is being compiled: that step
    finishes, is saved, and the run exits 0; the same command resumes from it."""
    _raise_before(monkeypatch, ShardedStep, "__call__", sig)
    assert train.main(_tiny(tmp_path / "run")) == 0
    out = capsys.readouterr()
    name = signal.Signals(sig).name
    assert f"{name}: saved step 1; rerun the same command to resume" in out.out, out.out
    assert _steps(tmp_path / "run") == [1] and (tmp_path / "run" / "checkpoints" / "1").is_dir()
    monkeypatch.undo()
    assert train.main(_tiny(tmp_path / "run")) == 0
    assert "resumed from step 1 " in capsys.readouterr().out
    assert _steps(tmp_path / "run") == [1, 2, 3, 4]


def test_a_second_interrupt_stops_at_once_and_leaves_no_lock(tmp_path, monkeypatch, capsys):
    """Ctrl-C asks the run to stop after its step; a second Ctrl-C stops it at once (exit 130,
    one line), the lock released."""
    _raise_before(monkeypatch, ShardedStep, "__call__", signal.SIGINT, signal.SIGINT)
    assert train.main(_tiny(tmp_path / "run")) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "SIGINT: stopping after the step in flight, saving it",
        "interrupted",
    ]
    assert not (tmp_path / "run" / "train.lock").exists()


def test_the_data_running_out_saves_what_was_trained_in_one_line(tmp_path, capsys):
    """One epoch of the demo data holds 13 steps: step 13 is saved, one line says so, exit 1."""
    argv = _tiny(
        tmp_path / "run", "--gin.DataConfig.num_epochs=1", "--gin.RunConfig.train_steps=40"
    )
    assert train.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: the training data ran out after step 13 of 40 (DataConfig.num_epochs=1); step 13 "
        "is saved: rerun with more data, more epochs or RunConfig.train_steps <= 13"
    ]
    assert (tmp_path / "run" / "checkpoints" / "13" / "state").is_dir()


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs: one checkpoint of the tiny run (5.5 MiB) fits, a second does not."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", f"tmpfs-{uuid.uuid4().hex[:8]}", str(where)],
        capture_output=True,
        text=True,
    )
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
def test_a_full_disk_during_a_save_stops_in_one_line_and_a_rerun_resumes(small_disk, env):
    """A save that runs out of space: one line (the step, the space needed and free), exit 1,
    the partial save gone, the checkpoint before it untouched; with space back, the same
    command resumes from that checkpoint and finishes."""
    run = small_disk / "run"
    command = train_command(run, *NO_EVAL, "--gin.CheckpointConfig.save_every=2")
    failed = run_process(command, env)
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert len(lines) == 1, failed.stderr[-3000:]
    assert lines[0].startswith(f"error: {run}/checkpoints: no space left on device saving step ")
    assert "MiB needed, " in lines[0] and lines[0].endswith("to resume")
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept and all(name.isdigit() for name in kept), kept  # no partial save left
    assert all((run / "checkpoints" / k / "commit_success.txt").is_file() for k in kept)
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = run_process(command, env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {kept[-1]} " in again.stdout  # the checkpoint before is whole
    assert _steps(run)[-1] == 4 and (run / "checkpoints" / "4" / "state").is_dir()


@pytest.mark.slow
def test_a_signal_at_a_moment_the_clock_picks_ends_cleanly(tmp_path, env):
    """SIGTERM to a real run as soon as it holds MODEL_DIR (start-up, then the first compile):
    exit 0 and either nothing written or the first step saved, never anything in between."""
    run = tmp_path / "run"
    proc = start_process(train_command(run, *NO_EVAL), env)
    try:
        while proc.poll() is None and not (run / "train.lock").exists():
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    if "stopped before step 1" in out:
        assert not run.exists()
    else:
        assert "SIGTERM: saved step 1; rerun the same command to resume" in out, out
        assert _steps(run) == [1] and (run / "checkpoints" / "1" / "state").is_dir()


@pytest.mark.slow
def test_a_closed_terminal_saves_the_step_and_exits_0(tmp_path, env):
    """SIGHUP to a real run (its terminal closed, its ssh session dropped) mid-training: the
    step in flight is saved, exit 0, and the same command resumes from it."""
    run = tmp_path / "run"
    proc = start_process(train_command(run, *NO_EVAL, "--gin.RunConfig.train_steps=400"), env)
    try:
        read_until(proc, "step      2/400")
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("SIGHUP: saved step ")]
    saved = int(line.split()[3].rstrip(";"))
    assert (run / "checkpoints" / str(saved) / "state").is_dir()
    assert _steps(run) == list(range(1, saved + 1))


def _fill(where: Path) -> None:
    """Write to `where` until its filesystem is full."""
    with (where / "filler").open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


@pytest.mark.slow
@pytest.mark.parametrize("log", ["tensorboard", "metrics.jsonl"])
def test_a_full_disk_under_the_logs_saves_the_step_in_one_line(small_disk, tmp_path, env, log):
    """The disk under TensorBoard's events (or metrics.jsonl) fills mid-run, the checkpoints'
    has room: the step is saved there, one line names the log and the step, exit 1; with room
    again the same command resumes from that step."""
    if log == "tensorboard":  # the run's directory has room, its TensorBoard files do not
        run = tmp_path / "run"
        run.mkdir()
        (small_disk / "tensorboard").mkdir()
        (run / "tensorboard").symlink_to(small_disk / "tensorboard")
        path = run / "tensorboard"
    else:  # the run's directory has no room, its checkpoints and TensorBoard files do
        run = small_disk / "run"
        run.mkdir()
        for name in ("checkpoints", "tensorboard"):
            (tmp_path / name).mkdir()
            (run / name).symlink_to(tmp_path / name)
        path = run / "metrics.jsonl"
    command = train_command(run, *NO_EVAL, "--gin.RunConfig.train_steps=400")
    proc = start_process(command, env)
    try:
        read_until(proc, "step      2/400")
        _fill(small_disk)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, err[-3000:]
    head = f"error: {path}: No space left on device; step "
    assert lines[0].startswith(head) and lines[0].endswith(
        f" is saved in {run}/checkpoints: make room there and rerun the same command to resume"
    ), lines[0]
    saved = int(lines[0].removeprefix(head).split()[0])
    assert saved > 2 and (run / "checkpoints" / str(saved) / "state").is_dir()
    if log == "tensorboard":  # every step trained is logged up to the one saved
        assert _steps(run) == list(range(1, saved + 1))
    (small_disk / "filler").unlink()
    again = run_process(
        [*command[:-2], f"--gin.RunConfig.train_steps={saved + 1}", command[-1]], env
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {saved} " in again.stdout
    assert _steps(run)[-1] == saved + 1


BAD_GIN = {  # file -> its text; each includes the next where it says so
    "syntax.gin": "MODEL_DIR = '/tmp/x'\nRunConfig.train_steps = 3 4\n",
    "outer.gin": "include '{tmp}/syntax.gin'\n",
    "missing.gin": "MODEL_DIR = '/tmp/x'\ninclude '{tmp}/absent.gin'\n",
}


@pytest.mark.parametrize("name", ["syntax.gin", "outer.gin"])
def test_a_gin_syntax_error_is_one_line_naming_the_file_and_line(tmp_path, capsys, name):
    """A gin syntax error names the file (an included one's own, not the file given) and the
    line; nothing is written."""
    for file, text in BAD_GIN.items():
        (tmp_path / file).write_text(text.format(tmp=tmp_path))
    assert train.main([f"--gin_file={tmp_path / name}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path}/syntax.gin, line 2: not valid gin (Expected newline.)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(BAD_GIN)


def test_a_missing_gin_include_is_our_one_line_only(tmp_path, env):
    """gin logs 'ERROR:root:Path not found' before raising; only our line is printed."""
    (tmp_path / "missing.gin").write_text(BAD_GIN["missing.gin"].format(tmp=tmp_path))
    command = [sys.executable, "-m", "longt5_jax.train", f"--gin_file={tmp_path}/missing.gin"]
    done = run_process(command, env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: Unable to open file: {tmp_path}/absent.gin. ")
    assert [p.name for p in tmp_path.iterdir()] == ["missing.gin"]


def _tiny_config(*bindings: str) -> LongT5Config:
    """The tiny run's model (demo.gin with TINY_RUN's bindings), with `bindings` besides."""
    tiny = [a.removeprefix("--gin.").replace("=", " = ", 1) for a in TINY_RUN[1:]]
    configuration.parse(["configs/demo.gin"], [*tiny, "MODEL_DIR = '/tmp/x'", *bindings])
    return configuration.build(LongT5Config)


def test_init_from_another_model_is_one_line_with_the_count(tmp_path, capsys):
    """`init_from` a checkpoint of another width: every array differs; one line counts them
    and names the first few, naming the setting; nothing is written to MODEL_DIR."""
    narrow = _tiny_config("LongT5Config.d_model = 32")
    write_native(tmp_path / "narrow", narrow, random_params(narrow), "test")
    run = tmp_path / "run"
    argv = _tiny(run, f"--gin.CheckpointConfig.init_from='{tmp_path / 'narrow'}'")
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {tmp_path}/narrow/checkpoints/0: a checkpoint of another ")
    assert "params/decoder/decoder_norm/scale (32,) vs (64,), " in err
    assert err.count(" vs (") == 6 and " and 22 more (28 arrays differ): " in err, err
    assert err.endswith(f"init_from='{tmp_path / 'narrow'}' holds another model's parameters")
    assert not run.exists()


def test_evaluate_refuses_a_model_binding_the_checkpoint_contradicts(tmp_path, env):
    """`evaluate --gin.LongT5Config.d_model=32` on a checkpoint of width 64: one line naming
    the binding and the checkpoint's value, exit 2, nothing written."""
    config = _tiny_config()
    write_native(tmp_path / "ckpt", config, random_params(config), "test")
    before = snapshot(tmp_path)
    tiny = [a for a in TINY_RUN if a.startswith(("--gin_file", "--gin.LongT5Config"))]
    done = run_process(
        [sys.executable, "-m", "longt5_jax.evaluate", *tiny, f"--checkpoint={tmp_path / 'ckpt'}",
         "--gin.LongT5Config.d_model=32"],
        env,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        f"error: LongT5Config.d_model = 32 contradicts --checkpoint={tmp_path}/ckpt/checkpoints/0"
        ", whose d_model is 64: "
    ), done.stderr
    assert snapshot(tmp_path) == before
