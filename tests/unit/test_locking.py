"""FileLock: exclusion across processes and threads, timeouts, the mkdir fallback."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rootstock.errors import LockTimeout
from rootstock.install import locking
from rootstock.install.locking import FileLock, is_locked

pytestmark = pytest.mark.timeout(60)

HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from rootstock.install.locking import FileLock

    lock = FileLock(Path(sys.argv[1]), timeout=30)
    lock.acquire()
    print("locked", flush=True)
    sys.stdin.read()          # hold until the test closes our stdin
    lock.release()
    print("released", flush=True)
    """
)

PROBE = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from rootstock.install.locking import is_locked

    print("held" if is_locked(Path(sys.argv[1])) else "free")
    """
)


class Holder:
    """A separate process that holds the lock until told to let go."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self._readline(deadline_s=30)
        assert line == "locked", line

    def _readline(self, deadline_s: float) -> str:
        timer = threading.Timer(deadline_s, self.proc.kill)
        timer.start()
        try:
            return self.proc.stdout.readline().strip()
        finally:
            timer.cancel()

    def release(self) -> None:
        self.proc.stdin.close()
        assert self._readline(deadline_s=30) == "released"
        self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def holder():
    started: list[Holder] = []

    def start(path: Path) -> Holder:
        h = Holder(path)
        started.append(h)
        return h

    yield start
    for h in started:
        h.kill()


def probe_from_another_process(path: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return proc.stdout.strip()


def test_lock_excludes_another_process(tmp_path, holder):
    path = tmp_path / "root.lock"
    other = holder(path)
    start = time.monotonic()
    with pytest.raises(LockTimeout) as info:
        FileLock(path, timeout=0.3, what="install-root lock").acquire()
    assert time.monotonic() - start >= 0.3
    assert "install-root lock" in info.value.message
    assert str(path) in info.value.message
    assert info.value.hint
    assert FileLock(path, timeout=0).acquire(blocking=False) is False

    other.release()
    with FileLock(path, timeout=5):
        pass


def test_waiter_gets_the_lock_once_released(tmp_path, holder):
    path = tmp_path / "root.lock"
    other = holder(path)
    threading.Timer(0.3, other.release).start()
    start = time.monotonic()
    with FileLock(path, timeout=20):
        waited = time.monotonic() - start
    assert waited >= 0.2


def test_is_locked_follows_another_process(tmp_path, holder):
    path = tmp_path / "root.lock"
    assert is_locked(path) is False  # no lock file yet
    other = holder(path)
    assert is_locked(path) is True
    other.release()
    assert is_locked(path) is False
    # A lock held here is seen as held from another process.
    with FileLock(path, timeout=1):
        assert probe_from_another_process(path) == "held"


def test_read_modify_write_under_lock_is_serialised(tmp_path):
    counter, path = tmp_path / "counter", tmp_path / "counter.lock"
    counter.write_text("0")
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from rootstock.install.locking import FileLock
        counter = Path({str(counter)!r})
        for _ in range(40):
            with FileLock(Path({str(path)!r}), timeout=30):
                value = int(counter.read_text())
                counter.write_text(str(value + 1))
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(4)]
    try:
        for proc in procs:
            assert proc.wait(timeout=45) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    assert counter.read_text() == "160"


def test_second_holder_in_process_waits_and_keeps_first_lock(tmp_path):
    path = tmp_path / "root.lock"
    first = FileLock(path, timeout=5)
    first.acquire()
    try:
        # A second FileLock on the same path in this process must wait, and its failure
        # must not drop the first holder's OS lock (POSIX locks belong to the process).
        errors: list[BaseException] = []

        def impatient() -> None:
            try:
                FileLock(path, timeout=0.2).acquire()
            except LockTimeout as exc:
                errors.append(exc)

        thread = threading.Thread(target=impatient)
        thread.start()
        thread.join(timeout=10)
        assert len(errors) == 1
        assert probe_from_another_process(path) == "held"

        acquired = threading.Event()

        def patient() -> None:
            with FileLock(path, timeout=20):
                acquired.set()

        thread = threading.Thread(target=patient)
        thread.start()
        assert not acquired.wait(0.3)
        assert is_locked(path) is True
        assert probe_from_another_process(path) == "held"
    finally:
        first.release()
    thread.join(timeout=20)
    assert acquired.is_set()
    assert is_locked(path) is False


def test_same_thread_reacquire_times_out_instead_of_succeeding(tmp_path):
    path = tmp_path / "root.lock"
    with FileLock(path, timeout=5):
        with pytest.raises(LockTimeout):
            FileLock(path, timeout=0.1).acquire()
        assert probe_from_another_process(path) == "held"


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
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    lock_dir = tmp_path / "root.lock.d"
    lock_dir.mkdir()
    owner = {"host": socket.gethostname(), "pid": dead.pid, "t": 0}
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
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    judged = {"host": socket.gethostname(), "pid": dead.pid, "t": 0}
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
