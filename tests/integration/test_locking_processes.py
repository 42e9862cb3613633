"""FileLock across processes: a holder in a subprocess excludes this one, a waiter
gets the lock once it is let go, and four processes' read-modify-writes serialise.

Moved from tests/unit (which starts no subprocess); the one-process tests stay in
tests/unit/test_locking.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rootstock.errors import LockTimeout
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
