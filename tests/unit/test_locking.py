"""FileLock in one process: threads, timeouts, release, the mkdir fallback.

Exclusion across processes (a holder in a subprocess, four writers at once) is in
tests/integration/test_locking_processes.py.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

import pytest

from rootstock.errors import LockTimeout
from rootstock.install import locking
from rootstock.install.locking import FileLock, is_locked

pytestmark = pytest.mark.timeout(60)


#: The pid of a local lock owner that is certainly gone: above Linux's PID_MAX_LIMIT
#: (2**22) and macOS's 99999, no process can have it, and kill(pid, 0) says ESRCH.
GONE_PID = 2**22 + 1


def test_release_is_idempotent_and_unheld_release_is_harmless(tmp_path):
    path = tmp_path / "root.lock"
    lock = FileLock(path)
    lock.release()  # never acquired
    lock.acquire()
    lock.release()
    lock.release()
    with FileLock(path, timeout=1):
        pass


def test_lock_creates_its_directory(tmp_path):
    path = tmp_path / "deep" / ".locks" / "x.lock"
    with FileLock(path, timeout=1):
        assert path.exists()


# --- the mkdir fallback, for filesystems without record locks --------------------------


@pytest.fixture
def no_record_locks(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(locking.fcntl, "lockf", refuse)


def test_fallback_uses_a_lock_directory(tmp_path, no_record_locks):
    path = tmp_path / "root.lock"
    with FileLock(path, timeout=1):
        owner = json.loads((tmp_path / "root.lock.d" / "owner.json").read_text())
        assert owner["pid"] == os.getpid()
        assert is_locked(path) is True
    assert not (tmp_path / "root.lock.d").exists()
    assert is_locked(path) is False


def test_fallback_breaks_a_dead_local_owner(tmp_path, no_record_locks):
    lock_dir = tmp_path / "root.lock.d"
    lock_dir.mkdir()
    owner = {"host": socket.gethostname(), "pid": GONE_PID, "t": 0}
    (lock_dir / "owner.json").write_text(json.dumps(owner))
    with FileLock(tmp_path / "root.lock", timeout=2):
        assert json.loads((lock_dir / "owner.json").read_text())["pid"] == os.getpid()


def test_fallback_never_steals_from_another_host(tmp_path, no_record_locks):
    lock_dir = tmp_path / "root.lock.d"
    lock_dir.mkdir()
    (lock_dir / "owner.json").write_text(json.dumps({"host": "other-node", "pid": 1, "t": 0}))
    with pytest.raises(LockTimeout):
        FileLock(tmp_path / "root.lock", timeout=0.2).acquire()
    assert lock_dir.exists()


def test_fallback_never_removes_a_lock_released_and_retaken_meanwhile(
    tmp_path, no_record_locks, monkeypatch
):
    # The race behind a lost manifest update under CI: a waiter finds the holder's
    # record gone (it released), and before the waiter acts on that, a third process
    # takes the lock. Played in order: the holder releases as the waiter reads its
    # record; the third process takes the lock at the waiter's very next step.
    lock_dir = tmp_path / "root.lock.d"
    lock_dir.mkdir()
    (lock_dir / "owner.json").write_text(json.dumps({"host": "node-a", "pid": 1, "t": 0}))
    third = {"host": socket.gethostname(), "pid": os.getpid(), "t": 1.0}
    real_read_bytes, real_exists, real_sleep = Path.read_bytes, Path.exists, time.sleep
    steps: list[str] = []

    def take_over() -> None:
        if steps == ["released"]:
            steps.append("retaken")
            lock_dir.mkdir()
            (lock_dir / "owner.json").write_text(json.dumps(third))

    def read_bytes(self: Path) -> bytes:
        if self.name == "owner.json" and not steps:
            steps.append("released")
            (lock_dir / "owner.json").unlink()
            lock_dir.rmdir()
        return real_read_bytes(self)

    def exists(self: Path, **kwargs) -> bool:
        seen = real_exists(self, **kwargs)
        if self == lock_dir:
            take_over()
        return seen  # what the waiter saw, just before the third process came

    def sleep(seconds: float) -> None:
        take_over()
        real_sleep(seconds)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    monkeypatch.setattr(Path, "exists", exists)
    monkeypatch.setattr(locking.time, "sleep", sleep)
    with pytest.raises(LockTimeout):
        FileLock(tmp_path / "root.lock", timeout=0.3).acquire()
    assert steps == ["released", "retaken"]
    assert json.loads((lock_dir / "owner.json").read_text()) == third


def test_breaking_a_dead_lock_puts_back_one_another_waiter_retook(tmp_path, no_record_locks):
    # Two waiters judged one dead lock stale; the other broke it and a live process
    # took the lock. Breaking on the old judgement must leave the live lock in place.
    judged = {"host": socket.gethostname(), "pid": GONE_PID, "t": 0}
    lock_dir = tmp_path / "root.lock.d"
    lock_dir.mkdir()
    live = {"host": socket.gethostname(), "pid": os.getpid(), "t": 2.0}
    (lock_dir / "owner.json").write_text(json.dumps(live))
    locking._break_stale(lock_dir, judged)
    assert json.loads((lock_dir / "owner.json").read_text()) == live
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root.lock.d"]
    # The dead owner's own lock, still in place, is removed.
    (lock_dir / "owner.json").write_text(json.dumps(judged))
    locking._break_stale(lock_dir, judged)
    assert list(tmp_path.iterdir()) == []
