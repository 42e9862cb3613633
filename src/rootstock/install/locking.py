"""Inter-process locks that work on local disks, NFS and Lustre.

The primary mechanism is a POSIX record lock (``fcntl.lockf``). Unlike ``flock``,
it is forwarded to the server on NFS (lockd on v3, native on v4) and it works on
Lustre when the filesystem is mounted with ``flock``. Where the filesystem refuses
record locks altogether (``ENOLCK``/``ENOSYS``/``EOPNOTSUPP``, as Lustre does when
mounted without ``flock`` or ``localflock``), the lock falls back to an atomic
``mkdir`` of ``<path>.d`` with the owner's host and pid written inside. That
directory is broken as stale only when its owner is on this host and no longer
alive, so the fallback never steals a live lock from another node.

A POSIX read lock needs only read access to the file, and it conflicts with a
writer's exclusive lock. So whoever can open a lock file can stall every writer
that takes it: lock files never grant others any access, and a *private* lock
(``FileLock(..., private=True)``, the install's ``.locks/``) also closes its
directory to everyone but the install's owner and, where it may write, its group.
Readers of an install never take these locks; they rely on atomic renames.

A lock path that is not a regular file (a FIFO, a directory, a symbolic link) is
refused with :class:`LockFileError`: it is opened with ``O_NOFOLLOW`` and
``O_NONBLOCK``, so it can neither redirect the lock elsewhere nor hang the caller.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import shutil
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

from rootstock.errors import LockTimeout, RootstockError
from rootstock.install.parsing import loads_json

_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP}
_POLL_S = 0.05
# O_NOFOLLOW: a symlink could point the lock anywhere; O_NONBLOCK: opening a FIFO
# for reading would wait for a writer for ever.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Linux's struct flock: l_type, l_whence, l_start, l_len, l_pid (F_GETLK's answer).
_FLOCK = struct.Struct("@hhqqi")


class LockFileError(RootstockError):
    """A lock path that cannot be a lock: not a regular file, or not openable."""


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
    :class:`~rootstock.errors.LockTimeout`, which names the holder's pid where the
    filesystem reports it; ``None`` waits forever. ``private`` marks a lock of the
    install's own lock directory: that directory is created, or kept, with no
    access for others (see the module docstring).
    """

    def __init__(
        self,
        path: Path,
        timeout: float | None = 60.0,
        what: str = "lock",
        private: bool = False,
    ) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.what = what
        self.private = private
        self._fd: int | None = None
        self._dir: Path | None = None

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock; with ``blocking=False`` return False instead of waiting."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self._prepare_directory()
        local = _process_lock(self.path)
        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not local.acquire(blocking, wait if blocking else -1):
            if not blocking:
                return False
            raise self._timeout_error(f"pid {os.getpid()} (this process, another thread)")
        try:
            taken = self._acquire_os(blocking, deadline)
        except BaseException:
            local.release()
            raise
        if not taken:
            local.release()
        return taken

    def _prepare_directory(self) -> None:
        directory = self.path.parent
        try:
            directory.mkdir(mode=0o770 if self.private else 0o777, parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise LockFileError(
                f"the lock directory {directory} is not a directory",
                hint=f"remove it (`rm {directory}`); rootstock creates it again",
            ) from None
        except OSError as exc:
            raise LockFileError(
                f"cannot create the lock directory {directory}: {exc.strerror or exc}",
                hint="only the install's maintainers take its locks; "
                "`rootstock check-perms` shows what is wrong",
            ) from None
        if self.private:
            close_lock_directory(directory)

    def _open(self) -> int:
        """The lock file, opened for writing (and created), checked to be a regular file."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o660)
        except OSError as exc:
            raise self._open_error(exc) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._not_regular(_file_kind(st.st_mode))
            _close_lock_file(fd, st, self.path.parent)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_error(self, exc: OSError) -> LockFileError:
        if exc.errno == errno.ELOOP:
            return self._not_regular("a symbolic link")
        if exc.errno == errno.EISDIR:
            return self._not_regular("a directory")
        if exc.errno in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):
            return self._not_regular("a special file")
        return LockFileError(
            f"cannot open the {self.what} file {self.path}: {exc.strerror or exc}",
            hint="only the install's maintainers take its locks; "
            "`rootstock check-perms` shows what is wrong",
        )

    def _not_regular(self, kind: str) -> LockFileError:
        return LockFileError(
            f"the {self.what} file {self.path} is not a regular file ({kind})",
            hint=f"remove it (`rm {self.path}`, or `rmdir` for a directory) once no "
            "rootstock command runs; it is created again as an empty file",
        )

    def _acquire_os(self, blocking: bool, deadline: float | None) -> bool:
        fd = self._open()
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
                pid = _record_lock_holder(fd) if blocking else None
                os.close(fd)
                if not blocking:
                    return False
                raise self._timeout_error(_describe_pid(pid), pid)
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
                raise self._timeout_error(*_describe_owner(holder))
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

    def holder(self) -> str | None:
        """Who holds this lock now (``pid N (user U: command)``), as a timeout names
        it; None when it is free, held in this process, or the holder cannot be told."""
        try:
            fd = os.open(self.path, os.O_RDONLY | _OPEN_FLAGS)
        except OSError:
            return _describe_owner(_read_owner(self.path.with_name(self.path.name + ".d")))[0]
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return _describe_pid(_record_lock_holder(fd))
        finally:
            os.close(fd)

    def _timeout_error(self, holder: str | None = None, pid: int | None = None) -> LockTimeout:
        """The timeout, naming ``holder`` when known; ``pid``: one ``ps`` can show."""
        message = f"timed out after {self.timeout:g} s waiting for the {self.what} ({self.path})"
        hint = "another rootstock process holds it; wait for it to finish, then retry"
        if holder is not None:
            message += f": it is held by {holder}"
        if pid is not None:
            hint = (
                f"see what holds it (`ps -o user,etime,args -p {pid}` on the host that "
                "runs it); wait for it to finish, or stop it, then retry"
            )
        return LockTimeout(message, hint=hint)

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


def close_lock_directory(directory: Path) -> None:
    """Take every access to ``directory`` away from others (and from its group,
    unless the group may write it), when this user owns it; else leave it be.

    A lock directory an older version made world-searchable is closed by its owner's
    next lock. One owned by someone else stays as it is: ``check-perms`` reports it.
    """
    try:
        st = os.stat(directory)
    except OSError:
        return
    mode = stat.S_IMODE(st.st_mode)
    wanted = _private_mode(mode, group_writes=bool(mode & stat.S_IWGRP))
    if wanted != mode and st.st_uid == os.geteuid():
        with contextlib.suppress(OSError):
            os.chmod(directory, wanted)


def _private_mode(mode: int, group_writes: bool) -> int:
    """``mode`` without the others' bits, and without the group's unless it writes."""
    mode &= ~0o007
    return mode if group_writes else mode & ~0o070


def _close_lock_file(fd: int, st: os.stat_result, directory: Path) -> None:
    """Give others no access to a lock file this user owns (nor the group, where the
    group may not write the directory): a read lock needs only read access."""
    if st.st_uid != os.geteuid():
        return
    try:
        group_writes = bool(os.stat(directory).st_mode & stat.S_IWGRP)
    except OSError:
        group_writes = False
    mode = stat.S_IMODE(st.st_mode)
    wanted = _private_mode(mode, group_writes)
    if wanted != mode:
        with contextlib.suppress(OSError):
            os.fchmod(fd, wanted)


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or other special file"


def _record_lock_holder(fd: int) -> int | None:
    """The pid of a process whose record lock conflicts with an exclusive one on
    ``fd`` (``F_GETLK``); None if there is none or it cannot be told.

    Local filesystems report the holder's pid. Over NFS the pid may be another
    node's, or 0; Linux's ``struct flock`` layout is the only one decoded.
    """
    if not sys.platform.startswith("linux"):
        return None
    query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    query += bytes(-len(query) % 8)  # the struct's trailing padding
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
    except OSError:
        return None
    kind, _whence, _start, _length, pid = _FLOCK.unpack_from(answer)
    if kind == fcntl.F_UNLCK or pid <= 0:
        return None
    return pid


def _describe_pid(pid: int | None) -> str | None:
    """``pid N (user U: command)`` for a local process, what /proc lets this user see."""
    if pid is None:
        return None
    proc = Path(f"/proc/{pid}")
    if not proc.is_dir():
        return f"pid {pid} (no such process on this host: on a shared filesystem, another node's)"
    details = []
    try:
        uid_line = next(
            line for line in (proc / "status").read_text().splitlines() if line.startswith("Uid:")
        )
        uid = int(uid_line.split()[1])
        try:
            details.append(f"user {pwd.getpwuid(uid).pw_name}")
        except KeyError:
            details.append(f"uid {uid}")
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        if args.strip():
            details.append(args.strip()[:120])
    except OSError:
        pass
    return f"pid {pid}" + (f" ({': '.join(details)})" if details else "")


def _describe_owner(owner: object) -> tuple[str | None, int | None]:
    """The mkdir fallback's holder from its owner record, and its pid."""
    if not isinstance(owner, dict):
        return None, None
    try:
        pid = int(owner["pid"])
    except (KeyError, TypeError, ValueError, OverflowError):
        return None, None
    host = owner.get("host")
    if host == socket.gethostname():
        return _describe_pid(pid), pid
    return f"pid {pid} on host {host}", pid


def is_locked(path: Path) -> bool:
    """True when another process holds the lock on ``path`` right now (see
    :func:`probe_lock`; a lock this user cannot probe reads as not held)."""
    return probe_lock(path) is True


def probe_lock(path: Path) -> bool | None:
    """Whether the lock on ``path`` is held right now; None when this user cannot tell.

    Read-only: the lock file is opened for reading (never created) and probed with
    a *shared* record lock, which an exclusive holder refuses and which is dropped
    at once. None for a lock file this user may not open (an install's lock files
    are its maintainers' alone) and for one that is not a regular file; the caller
    decides what that means (``status`` looks at the build records instead).
    """
    path = Path(path)
    if _process_lock(path).locked():
        return True
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    except FileNotFoundError:
        return _dir_lock_is_held(path)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return _dir_lock_is_held(path)
        return True if exc.errno in (errno.EACCES, errno.EAGAIN) else None
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
