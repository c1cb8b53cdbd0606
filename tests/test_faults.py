"""Faults a run meets, each ending in one line with what was saved kept: a full disk during a
save, a signal at any moment (start-up and the first compile included), the data running out.

Signals at a chosen moment are raised by the process itself (deterministic, in this process);
the full disk and a signal at a moment the clock picks run as a user runs them, in processes of
their own (slow).
"""

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from test_safety import STEPS, _run, _start
from test_train import TINY_RUN, child_env, train_command

from longt5_jax import train
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
    return [*TINY_RUN, *STEPS, *extra, f"--gin.MODEL_DIR='{model_dir}'"]


def test_a_signal_during_start_up_ends_cleanly_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """SIGTERM after the state is built and before any step (the eval data being read): the
    run stops before its first step and MODEL_DIR is as it was (here: never made)."""
    _raise_before(monkeypatch, PeriodicEval, "open", signal.SIGTERM)
    assert train.main(_tiny(tmp_path / "run")) == 0
    out = capsys.readouterr()
    assert "SIGTERM: stopped before step 1; nothing new to save" in out.out
    assert "Traceback" not in out.err and not (tmp_path / "run").exists()


def test_a_signal_during_the_first_compile_saves_the_first_step(tmp_path, monkeypatch, capsys):
    """SIGTERM as the first step is being compiled: that step finishes, is saved, and the run
    exits 0; the same command resumes from it."""
    _raise_before(monkeypatch, ShardedStep, "__call__", signal.SIGTERM)
    assert train.main(_tiny(tmp_path / "run")) == 0
    out = capsys.readouterr()
    assert "SIGTERM: saved step 1; rerun the same command to resume" in out.out, out.out
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
    command = train_command(run, *STEPS, "--gin.CheckpointConfig.save_every=2")
    failed = _run(command, env)
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert len(lines) == 1, failed.stderr[-3000:]
    assert lines[0].startswith(f"error: {run}/checkpoints: no space left on device saving step ")
    assert "MiB needed, " in lines[0] and lines[0].endswith("to resume")
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept and all(name.isdigit() for name in kept), kept  # no partial save left
    assert all((run / "checkpoints" / k / "commit_success.txt").is_file() for k in kept)
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = _run(command, env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {kept[-1]} " in again.stdout  # the checkpoint before is whole
    assert _steps(run)[-1] == 4 and (run / "checkpoints" / "4" / "state").is_dir()


@pytest.mark.slow
def test_a_signal_at_a_moment_the_clock_picks_ends_cleanly(tmp_path, env):
    """SIGTERM to a real run as soon as it holds MODEL_DIR (start-up, then the first compile):
    exit 0 and either nothing written or the first step saved, never anything in between."""
    run = tmp_path / "run"
    proc = _start(train_command(run, *STEPS), env)
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
