"""Inter-process locks that work on local disks, NFS and Lustre.

The primary mechanism is a POSIX record lock (``fcntl.lockf``). Unlike ``flock``,
it is forwarded to the server on NFS (lockd on v3, native on v4) and it works on
Lustre when the filesystem is mounted with ``flock``. Where the filesystem refuses
record locks altogether (``ENOLCK``/``ENOSYS``/``EOPNOTSUPP``, as Lustre does when
mounted without ``flock`` or ``localflock``), the lock falls back to an atomic
``mkdir`` of ``<path>.d`` with the owner's host and pid written inside. That
directory is broken as stale only when its owner is on this host and no longer
alive, so the fallback never steals a live lock from another node.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from types import TracebackType

from rootstock.errors import LockTimeout
from rootstock.install.parsing import loads_json

_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP}
_POLL_S = 0.05

# POSIX record locks belong to the process, not the file descriptor: a second lock
# on the same file from this process would "succeed", and closing any descriptor of
# it drops them all. A per-path thread lock keeps holders inside one process apart.
_process_locks: dict[str, threading.Lock] = {}
_process_locks_guard = threading.Lock()


def _process_lock(path: Path) -> threading.Lock:
    key = os.path.realpath(path)
    with _process_locks_guard:
        return _process_locks.setdefault(key, threading.Lock())


class FileLock:
    """An exclusive lock on ``path``, held for the ``with`` block.

    ``timeout`` is how long to wait for another holder before raising
    :class:`~rootstock.errors.LockTimeout`; ``None`` waits forever.
    """

    def __init__(self, path: Path, timeout: float | None = 60.0, what: str = "lock") -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.what = what
        self._fd: int | None = None
        self._dir: Path | None = None

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock; with ``blocking=False`` return False instead of waiting."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self.path.parent.mkdir(parents=True, exist_ok=True)
        local = _process_lock(self.path)
        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not local.acquire(blocking, wait if blocking else -1):
            if not blocking:
                return False
            raise self._timeout_error()
        try:
            taken = self._acquire_os(blocking, deadline)
        except BaseException:
            local.release()
            raise
        if not taken:
            local.release()
        return taken

    def _acquire_os(self, blocking: bool, deadline: float | None) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return True
            except OSError as exc:
                if exc.errno in _UNSUPPORTED:
                    os.close(fd)
                    return self._acquire_dir(blocking, deadline)
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    os.close(fd)
                    raise
            if not blocking or (deadline is not None and time.monotonic() > deadline):
                os.close(fd)
                if not blocking:
                    return False
                raise self._timeout_error()
            time.sleep(_POLL_S)

    def _acquire_dir(self, blocking: bool, deadline: float | None) -> bool:
        lock_dir = self.path.with_name(self.path.name + ".d")
        while True:
            # The owner file is written into a private directory first and the whole
            # directory is renamed into place, so a lock directory never exists
            # without its owner: a holder killed mid-acquire leaves no orphan.
            staging = self.path.with_name(f".{self.path.name}.{os.getpid()}.{time.time_ns()}")
            staging.mkdir()
            owner = {"host": socket.gethostname(), "pid": os.getpid(), "t": time.time()}
            (staging / "owner.json").write_text(json.dumps(owner))
            try:
                os.rename(staging, lock_dir)
                self._dir = lock_dir
                return True
            except OSError as exc:
                shutil.rmtree(staging, ignore_errors=True)
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                # A lock directory whose record is gone is being released: it is
                # never removed here (by now it may be the next holder's); the next
                # rename, after the poll, takes its place.
                holder = _read_owner(lock_dir)
                if isinstance(holder, dict) and _owner_is_dead(holder):
                    _break_stale(lock_dir, holder)
                    continue
            if not blocking:
                return False
            if deadline is not None and time.monotonic() > deadline:
                raise self._timeout_error()
            time.sleep(_POLL_S)

    def release(self) -> None:
        """Release the lock if held."""
        held = self._fd is not None or self._dir is not None
        if self._fd is not None:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if held:
            _process_lock(self.path).release()

    def _timeout_error(self) -> LockTimeout:
        return LockTimeout(
            f"timed out after {self.timeout:.0f} s waiting for the {self.what} ({self.path})",
            hint="another rootstock process holds it; wait for it to finish, then retry",
        )

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def is_locked(path: Path) -> bool:
    """True when another process holds the lock on ``path`` right now.

    Read-only, so ``status`` works for a user who may not write the install: the
    lock file is opened for reading (never created) and probed with a *shared*
    record lock, which an exclusive holder refuses and which needs no write
    access. A lock file this user cannot open at all reads as not held: the
    probe is a hint for display, and guessing "held" would show every env of an
    unreadable install as ``building``.
    """
    path = Path(path)
    if _process_lock(path).locked():
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return _dir_lock_is_held(path)
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return _dir_lock_is_held(path)
        return exc.errno in (errno.EACCES, errno.EAGAIN)
    finally:
        # Closing drops the probe's shared lock (and only this process's locks,
        # of which there are none on this file: the thread-lock check above).
        os.close(fd)
    return False


def _dir_lock_is_held(path: Path) -> bool:
    """The ``mkdir`` fallback's answer, without breaking a stale lock (read-only)."""
    owner = _read_owner(path.with_name(path.name + ".d"))
    if owner is _GONE:
        return False
    return not (isinstance(owner, dict) and _owner_is_dead(owner))


_GONE = object()  # the lock directory's record is gone: released, or being released


def _read_owner(lock_dir: Path) -> object:
    """The owner record of ``lock_dir``; :data:`_GONE` when there is none.

    A record that cannot be read or parsed is returned as None: its owner is
    unknown, so the lock counts as held, never as stale.
    """
    try:
        return loads_json((lock_dir / "owner.json").read_bytes())
    except FileNotFoundError:
        return _GONE
    except (OSError, ValueError):
        return None


def _owner_is_dead(owner: dict) -> bool:
    """True only for an owner on this host whose pid is gone (never another node's)."""
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError, TypeError, OverflowError):
        return False
    return False


def _break_stale(lock_dir: Path, owner: dict) -> None:
    """Remove ``lock_dir`` if it still holds the dead ``owner``'s record.

    Two waiters may judge the same lock stale. Removing it by name could remove a
    fresh lock the other waiter's break let a third process take, so the directory
    is first renamed aside (atomic) and its record compared with the one judged
    dead; one that belongs to somebody else is renamed back at once.
    """
    aside = lock_dir.with_name(f".{lock_dir.name}.stale-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(lock_dir, aside)
    except OSError:
        return  # already broken (or released) by somebody else
    if _read_owner(aside) == owner:
        shutil.rmtree(aside, ignore_errors=True)
        return
    # Should a third process have taken the name in the microseconds between the
    # two renames, this fails and two holders remain: that needs two waiters breaking
    # one dead lock at once and a third arriving between two syscalls, where removal
    # by name (what this replaces) failed whenever the two breaks interleaved.
    with contextlib.suppress(OSError):
        os.rename(aside, lock_dir)
