"""The MODEL_DIR lock itself: who holds it, what is stale, what a release leaves (in this
process and in real processes that hold it or die holding it)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import hold_lock

from longt5_jax.training import run_lock
from longt5_jax.training.run_lock import LockedError, RunLock


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _record(model_dir: Path, **fields) -> bytes:
    """A lock file as a run that is no longer watched left it."""
    model_dir.mkdir(parents=True, exist_ok=True)
    data = json.dumps({"host": socket.gethostname(), "started": 0.0, **fields}).encode()
    (model_dir / run_lock.LOCK_NAME).write_bytes(data)
    return data


def _take(model_dir: Path) -> str:
    """Take the lock and give it back; the warning its taking said."""
    lock = RunLock(model_dir)
    warning = lock.acquire()
    lock.release()
    return warning


def test_a_held_lock_refuses_another_taker_naming_its_holder(tmp_path):
    lock = RunLock(tmp_path / "run")
    assert lock.acquire() == ""
    held = (tmp_path / "run" / "train.lock").read_bytes()
    assert json.loads(held)["pid"] == os.getpid()
    with pytest.raises(LockedError, match=f"is in use by pid {os.getpid()} on host "):
        RunLock(tmp_path / "run").acquire()  # another open file: flock tells them apart
    assert (tmp_path / "run" / "train.lock").read_bytes() == held  # the refusal wrote nothing
    lock.release()
    assert not (tmp_path / "run").exists()  # it made MODEL_DIR, and nothing else was written


def test_a_release_keeps_what_the_run_wrote(tmp_path):
    (tmp_path / "run").mkdir()
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]


def test_a_live_process_holds_it_and_its_death_frees_it(tmp_path):
    proc = hold_lock(tmp_path)
    try:
        with pytest.raises(LockedError, match=f"pid {proc.pid} on host {socket.gethostname()}"):
            RunLock(tmp_path).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lock = RunLock(tmp_path)
    warning = lock.acquire()  # the record is left, its holder gone: taken over, said once
    assert warning.startswith(f"warning: {tmp_path}/train.lock: taking over from pid {proc.pid}")
    assert warning.endswith(f"pid {proc.pid} is no longer running") and "\n" not in warning
    assert json.loads((tmp_path / "train.lock").read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no-flock"])
def test_staleness_is_decided_by_the_record_where_flock_cannot(tmp_path, monkeypatch, flock):
    """Without flock (a shared file system that does not honour it), the record alone decides:
    a live pid on this host holds it, a dead or reused one does not, a record of another host
    holds it until its renewals stop for STALE_S."""
    if not flock:
        monkeypatch.setattr(run_lock, "_flock", lambda fd: None)
    proc = hold_lock(tmp_path / "live")
    try:
        with pytest.raises(LockedError, match=f"pid {proc.pid}"):
            RunLock(tmp_path / "live").acquire()
    finally:
        proc.kill()
        proc.wait()
    _record(tmp_path / "dead", pid=_dead_pid())
    assert "is no longer running" in _take(tmp_path / "dead")
    _record(tmp_path / "reused", pid=os.getpid(), process_start=1)  # our pid, another start
    assert "is no longer running" in _take(tmp_path / "reused")
    _record(tmp_path / "remote", host="elsewhere", pid=1)
    with pytest.raises(LockedError, match=r"taken over 300 s after its last renewal, \d s ago"):
        RunLock(tmp_path / "remote").acquire()
    old = time.time() - run_lock.STALE_S - 60
    os.utime(tmp_path / "remote" / "train.lock", (old, old))
    warning = _take(tmp_path / "remote")
    assert "taking over from pid 1 on host elsewhere" in warning
    assert "host elsewhere has not renewed it for 36" in warning


def test_an_empty_record_is_taken_only_with_a_flock_or_once_old(tmp_path, monkeypatch):
    """Created but never written: its creator died, or is between its create and its write."""
    (tmp_path / "train.lock").write_bytes(b"")
    assert "no holder recorded" in _take(tmp_path)
    monkeypatch.setattr(run_lock, "_flock", lambda fd: None)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "train.lock").write_bytes(b"")
    with pytest.raises(LockedError, match="a run that has not recorded itself yet"):
        RunLock(tmp_path / "b").acquire()


def test_a_lock_taken_over_is_not_removed_by_its_old_holder(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    other = _record(tmp_path, pid=1, host="elsewhere")  # as a taker on another host left it
    lock.release()
    assert (tmp_path / "train.lock").read_bytes() == other


def test_the_heartbeat_renews_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path)
    lock.acquire()
    old = time.time() - 1000
    os.utime(tmp_path / "train.lock", (old, old))
    time.sleep(0.3)
    assert time.time() - (tmp_path / "train.lock").stat().st_mtime < 10
    lock.release()
