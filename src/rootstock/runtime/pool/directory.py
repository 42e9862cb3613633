"""The user's private pool directory and the files each pooled worker keeps there.

A pool daemon (:mod:`rootstock.runtime.pool.daemon`) binds its socket in
``$XDG_RUNTIME_DIR/rootstock``, or, where that variable is unset (common in batch
jobs), in ``/tmp/rootstock-<uid>``. The directory is made with mode 0700; an
existing one is used only if it is a real directory (no symlink) owned by us with
mode exactly 0700. Anything else is refused with the reason and the fix: a
directory someone else can enter could hold a planted socket, and rootstock never
changes the mode of a directory it did not make.

Per worker key (:attr:`~rootstock.runtime.worker_keys.WorkerKey.digest`) the
directory holds ``<digest>.sock`` (the daemon's socket, 0600), ``<digest>.json``
(its state, written aside and renamed), ``<digest>.lock`` (the start lock),
``<digest>.log`` (the daemon's own output) and, when the worker failed ``setup()``,
``<digest>.error.json`` (the worker's ERROR, for the client that started it).

Only regular files are used there. Anything else in one of those names (a FIFO
would hang a plain ``open()``, a link could point anywhere) is skipped with a
warning where it is read, and refused with :class:`PoolFileError` where a file must
be made or removed; both name the path, what is there, and the ``rm`` that clears it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

from rootstock.errors import RootstockError
from rootstock.install.parsing import NotRegularFile, ParseProblem, loads_json, open_regular_file
from rootstock.runtime.server import owner_is_gone

log = logging.getLogger("rootstock.runtime")

POOL_DIR_NAME = "rootstock"
STATE_SCHEMA = 1
# sun_path holds 108 bytes on Linux (104 on macOS); "<16 hex>.sock" must fit under it.
_MAX_SOCKET_PATH = 100
_SOCKET_NAME_LEN = len("0123456789abcdef.sock") + 1
# A state or error file holds a few hundred bytes.
_MAX_JSON_BYTES = 1 << 20


class PoolFileError(RootstockError):
    """A name in the pool directory holds something other than a regular file."""

    def __init__(self, problem: NotRegularFile) -> None:
        super().__init__(
            f"{problem.path} in the pool directory is {problem.kind}, not a regular file",
            hint=f"remove it ({problem.fix}); rootstock makes the file again when it needs it",
        )
        self.path = problem.path


def open_pool_file(path: Path, flags: int) -> int:
    """A descriptor of the pool file ``path`` (made 0600 with ``O_CREAT``), only if it
    is a regular file; :class:`PoolFileError` otherwise."""
    try:
        return open_regular_file(path, flags, 0o600)
    except NotRegularFile as exc:
        raise PoolFileError(exc) from None


def fallback_pool_dir(uid: int | None = None) -> Path:
    """``/tmp/rootstock-<uid>``: the pool dir where ``$XDG_RUNTIME_DIR`` is unset."""
    return Path("/tmp") / f"rootstock-{os.getuid() if uid is None else uid}"


def pool_dir_path(environ: dict[str, str] | None = None) -> Path:
    """Where this user's pool directory is (nothing is checked or made)."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        candidate = Path(xdg) / POOL_DIR_NAME
        # A long runtime dir would make socket paths that cannot be bound.
        if len(os.fsencode(candidate)) + _SOCKET_NAME_LEN <= _MAX_SOCKET_PATH:
            return candidate
    return fallback_pool_dir()


def check_private_dir(path: Path) -> None:
    """Raise RootstockError unless ``path`` is a real directory of ours with mode 0700."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise RootstockError(
            f"cannot inspect the pool directory {path}: {exc.strerror or exc}",
            hint="set XDG_RUNTIME_DIR to a private directory of yours",
        ) from None
    if stat.S_ISLNK(st.st_mode):
        raise RootstockError(
            f"the pool directory {path} is a symbolic link, which could point anywhere",
            hint=f"remove the link (rm {path}) so rootstock can make a private directory",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise RootstockError(
            f"the pool directory {path} exists but is not a directory",
            hint=f"remove it (rm {path}) so rootstock can make a private directory",
        )
    if st.st_uid != os.getuid():
        raise RootstockError(
            f"the pool directory {path} belongs to uid {st.st_uid}, not to you "
            f"(uid {os.getuid()}); another user's directory could hold a planted socket",
            hint="set XDG_RUNTIME_DIR to a private directory of yours, or ask the owner "
            f"to remove {path}",
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700:
        raise RootstockError(
            f"the pool directory {path} has mode {mode:04o}, not 0700, so other users "
            "could reach the pooled workers' sockets",
            hint=f"chmod 700 {path} (or remove it and let rootstock make it again)",
        )


def ensure_pool_dir(environ: dict[str, str] | None = None) -> Path:
    """This user's pool directory, made (0700) if missing, checked either way."""
    path = pool_dir_path(environ)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_private_dir(path)
    return path


class PoolFiles:
    """The paths one pooled worker (one key digest) uses in the pool directory."""

    def __init__(self, directory: Path, digest: str) -> None:
        self.directory = directory
        self.digest = digest
        self.socket = directory / f"{digest}.sock"
        self.state = directory / f"{digest}.json"
        self.lock = directory / f"{digest}.lock"
        self.log = directory / f"{digest}.log"
        self.error = directory / f"{digest}.error.json"

    def remove_leftovers(self) -> None:
        """Remove the socket, state and error files a dead daemon left behind.

        A link or a FIFO in one of their names goes too; a directory is refused
        (:class:`PoolFileError`): it is nobody's leftover, and is not ours to delete.
        """
        for path in (self.socket, self.state, self.error):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EISDIR, errno.EPERM) or not path.is_dir():
                    raise
                raise PoolFileError(NotRegularFile(path, "a directory")) from None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` (0600) aside, then rename: readers never see half.

    The file aside is this thread's own: the daemon publishes its state from its main
    loop and from client threads, and two writers truncating one file aside would
    rename each other's half-written text into place.
    """
    partial = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_native_id()}.part")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, sort_keys=True)
    os.replace(partial, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None when it is missing or unreadable.

    Anything but a regular file is skipped with a warning that says how to clear it.
    """
    try:
        with os.fdopen(open_regular_file(path), "rb") as fh:
            value = loads_json(fh.read(_MAX_JSON_BYTES + 1))
    except NotRegularFile as exc:
        log.warning("skipped %s in the pool directory: %s (remove it: %s)", path, exc, exc.fix)
        return None
    except (OSError, ParseProblem, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_states(directory: Path) -> list[dict[str, Any]]:
    """Every readable state file in the pool directory, oldest first."""
    states = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        if not name.endswith(".json") or name.endswith(".error.json") or name.startswith("."):
            continue
        state = read_json(directory / name)
        if state is not None and state.get("schema") == STATE_SCHEMA:
            states.append(state)
    states.sort(key=lambda s: str(s.get("started", "")))
    return states


def daemon_alive(state: dict[str, Any]) -> bool:
    """Whether the daemon a state file names still runs (pid reuse counts as gone)."""
    record = state.get("daemon")
    if not isinstance(record, dict):
        return False
    return not owner_is_gone(record)


def utc_now() -> str:
    """Now, as the ISO 8601 UTC text state files carry."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
