"""One writer per MODEL_DIR: the lock a training run holds on MODEL_DIR/train.lock.

Two runs on one MODEL_DIR (a requeued job that starts while the old one still runs) interleave
their saves, metrics and checkpoint clean-ups, and each loses the other's work; the second is
refused before it writes anything. Readers (evaluate, predict, ckpt) never take the lock.

What it relies on:
- On one host, flock(2): the kernel drops it when its holder dies, however it dies. Local file
  systems and NFS (where Linux turns flock into the server's byte-range locks) honour it across
  the host's processes, so a busy flock is a live holder.
- Across hosts flock may not hold (Lustre without `-o flock`, NFS mounted `nolock` or
  `local_lock=all`). There the record decides: it is created with O_EXCL, which is atomic on
  local file systems, NFSv3+ and Lustre, and holds the holder's host, pid and start time.
- A record is stale when its holder is provably gone: on this host, its pid is not running (or
  runs another program: the pid's start time differs); from another host, whose processes
  cannot be asked, its holder has not touched it (every HEARTBEAT_S) for STALE_S. A stale
  record is taken over with a warning; any other is a live holder and the start is refused.
  Without flock, two starters that find the same stale record at the same moment both rewrite
  it; each reads it back after a pause, which catches a rival that wrote within it, but a
  narrower race remains (nothing short of a working lock closes it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from longt5_jax.errors import UsageError

LOCK_NAME = "train.lock"  # one of cli.RUN_FILES: no command writes over it
HEARTBEAT_S = 30.0
STALE_S = 300.0  # ten missed heartbeats: a holder on another host that stopped long ago


class LockedError(UsageError):
    """MODEL_DIR is held by another run."""


def _process_start(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), which tells a reused pid from its first
    owner; None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name may hold spaces or ')'


def _alive(holder: dict) -> bool:
    """Whether the holder's process, on this host, still runs."""
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        pass
    start = _process_start(holder["pid"])
    return start is None or holder.get("process_start") in (None, start)


def describe(holder: dict | None) -> str:
    if not holder:
        return "a run that has not recorded itself yet"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {since})"


def _read(fd: int) -> dict | None:
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and {"host", "pid"} <= holder.keys() else None


def _stale(holder: dict | None, age: float, flocked: bool | None) -> str | None:
    """Why the record's holder is gone, or None while it may still run."""
    if holder is None:  # created but not yet written: by a run that died, or one starting now
        return "no holder recorded" if flocked or age > STALE_S else None
    if holder["host"] == socket.gethostname():
        return None if _alive(holder) else f"pid {holder['pid']} is no longer running"
    if age > STALE_S:
        return f"host {holder['host']} has not renewed it for {age:.0f} s"
    return None


def _flock(fd: int) -> bool | None:
    """True: taken; False: another process holds it; None: this file system has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    return True


class RunLock:
    """MODEL_DIR/train.lock held by this process from `acquire` to `release`."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.path = self.model_dir / LOCK_NAME
        self._fd: int | None = None
        self._made_dir = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> str:
        """Take the lock, or raise LockedError naming its holder; returns a warning line when
        a stale lock was taken over ('' otherwise)."""
        self._made_dir = not self.model_dir.exists()
        self.model_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # each retry follows a holder releasing between two of our steps
            try:
                fd, fresh = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, fresh = os.open(self.path, os.O_RDWR), False
                except FileNotFoundError:
                    continue
            try:
                warning = self._take(fd, fresh)
            except BaseException:
                os.close(fd)
                raise
            if warning is not None:
                self._fd = fd
                self._beat = threading.Thread(target=self._heartbeat, args=(fd,), daemon=True)
                self._beat.start()
                return warning
            os.close(fd)
        raise LockedError(f"{self.path}: changes hands too fast to be taken; try again")

    def _take(self, fd: int, fresh: bool) -> str | None:
        """Record this process in the open lock file: the warning ('' or a takeover), or None
        when the file was removed under us (try again); LockedError for a live holder."""
        flocked, st = _flock(fd), os.fstat(fd)
        age = time.time() - st.st_mtime
        if flocked is False:
            raise self._refusal(_read(fd), age)
        if self._recorded_inode() != st.st_ino:  # its holder removed it after our open
            return None
        warning = ""
        if not fresh:
            holder = _read(fd)
            why = _stale(holder, age, flocked)
            if why is None:
                raise self._refusal(holder, age)
            warning = f"warning: {self.path}: taking over from {describe(holder)}: {why}"
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": _process_start(os.getpid()),
            "started": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
        os.fsync(fd)
        if flocked is None:  # no flock to arbitrate: a taker racing us may have won
            time.sleep(0.1)
            if self._recorded_inode() != st.st_ino or _read(fd) != me:
                raise self._refusal(_read(fd), 0.0)
        return warning

    def _recorded_inode(self) -> int | None:
        try:
            return os.stat(self.path).st_ino
        except FileNotFoundError:
            return None

    def _refusal(self, holder: dict | None, age: float) -> LockedError:
        later = ""
        if holder and holder["host"] != socket.gethostname():
            later = (
                f" (if it is gone, its lock is taken over {STALE_S:.0f} s after its last "
                f"renewal, {age:.0f} s ago)"
            )
        return LockedError(
            f"MODEL_DIR={self.model_dir} is in use by {describe(holder)}{later}, which holds "
            f"{self.path}: two runs on one MODEL_DIR corrupt each other's checkpoints and "
            "metrics; wait for it to end or choose another MODEL_DIR"
        )

    def _heartbeat(self, fd: int) -> None:
        """Renew the record's mtime: what tells hosts without a shared flock that it lives."""
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(fd)

    def release(self) -> None:
        """Remove the record (still holding the flock, so no taker reads it half gone) and the
        MODEL_DIR this lock made, if nothing else was written to it."""
        if self._fd is None:
            return
        self._stop.set()
        assert self._beat is not None  # started when the descriptor was kept
        self._beat.join()  # before the descriptor closes: its number may be reused at once
        record = _read(self._fd) or {}
        if (record.get("host"), record.get("pid")) == (socket.gethostname(), os.getpid()):
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
        if self._made_dir:
            with contextlib.suppress(OSError):  # not empty: the run wrote to it
                self.model_dir.rmdir()


@contextlib.contextmanager
def held(model_dir: str | Path) -> Iterator[None]:
    """The run holds MODEL_DIR while the block runs: process 0 takes the lock and every process
    learns the outcome, so that all stop with the same line or none does.

    One lock for the run, not one per process: the processes of a run write MODEL_DIR together
    (orbax coordinates them), and any two runs meet at their process 0. A lock per process would
    guard nothing more, and would leave records of process ids a run resumed on fewer processes
    no longer has.
    """

    lock, refusal = None, ""
    if jax.process_index() == 0:
        lock = RunLock(model_dir)
        try:
            warning = lock.acquire()
        except LockedError as e:
            refusal = str(e)
        else:
            if warning:
                print(warning, file=sys.stderr, flush=True)
    refusal = _from_process_0(refusal)
    if refusal:
        raise LockedError(refusal)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _from_process_0(text: str, size: int = 2048) -> str:
    """Process 0's `text`, on every process."""

    if jax.process_count() == 1:
        return text

    data = np.frombuffer(text.encode()[:size].ljust(size, b"\0"), np.uint8)
    return bytes(multihost_utils.broadcast_one_to_all(data)).rstrip(b"\0").decode(errors="replace")
