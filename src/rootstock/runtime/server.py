"""The listening side of a worker connection: a Unix socket in a private directory.

The calculator binds, the worker connects. The socket lives in a fresh directory
made by :func:`tempfile.mkdtemp` (mode 0700) under ``$XDG_RUNTIME_DIR`` or the
system temp dir, so no other user can reach it and no fixed name in ``/tmp`` can be
squatted. The same directory holds the worker's captured output.

Each run directory records its owner (host, pid, the pid's start time and the boot
it started in) in ``owner.json``. A killed owner cannot remove its directory, so
whenever a new one is made, the same user's run directories whose owner is gone
are removed: same host only (``$TMPDIR`` may be shared between nodes, and a pid
says nothing about another host's processes), and only directories with a
readable owner record. A directory's name also carries its maker's pid
(``rootstock-<pid>-XXXXXXXX``), so one whose maker was killed between
:func:`tempfile.mkdtemp` and writing the record is still recognised as abandoned.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rootstock.errors import ProtocolError, WorkerTimeout
from rootstock.install.parsing import NotRegularFile, loads_json, open_regular_file

log = logging.getLogger("rootstock.runtime")

SOCKET_NAME = "worker.sock"
OWNER_FILE = "owner.json"
RUN_DIR_PREFIX = "rootstock-"
#: A run dir of ours with no owner record (its maker was killed between mkdtemp and
#: writing the record, or it predates records) is swept only once it is this old.
UNOWNED_RUN_DIR_AGE_S = 24 * 3600
#: A run dir with no owner record whose name carries its maker's pid is judged by that
#: pid once it is this old (the record is written right after mkdtemp).
UNRECORDED_GRACE_S = 2.0
# mkdtemp's 8 random characters follow "<pid>-".
_MAKER_PID = re.compile(r"-(\d+)-[a-z0-9_]{8}$")
# sun_path holds 108 bytes on Linux (104 on macOS); stay clear of both.
_MAX_SOCKET_PATH = 100
ACCEPT_SLICE_S = 0.1


def runtime_base_dir() -> Path:
    """Where private run directories go: ``$XDG_RUNTIME_DIR`` if usable, else the temp dir."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg)
    return Path(tempfile.gettempdir())


def make_private_dir(prefix: str = RUN_DIR_PREFIX, base: Path | None = None) -> Path:
    """A fresh 0700 directory whose socket path fits in ``sun_path``, with its owner
    recorded; dead owners' run directories next to it are swept first (all of
    rootstock's prefixes start with ``rootstock-``, which the sweep looks for).

    It is made in ``base``, by default :func:`runtime_base_dir`.
    """
    base = runtime_base_dir() if base is None else base
    # The maker's pid tags the name (see _unrecorded_maker_is_gone).
    prefix = f"{prefix}{os.getpid()}-"
    # mkdtemp adds 8 random characters; leave room for "/worker.sock".
    if len(os.fsencode(base)) + len(prefix) + 9 + 1 + len(SOCKET_NAME) > _MAX_SOCKET_PATH:
        # HPC job temp dirs can be long; /tmp itself is short and mkdtemp is still private.
        base = Path("/tmp")
    sweep_dead_run_dirs(base)
    run_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    write_owner(run_dir)
    return run_dir


# --- owners and the sweep ----------------------------------------------------------------


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _process_state(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of ``pid`` from /proc, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # comm may hold spaces and parentheses; the fields after the last ')' do not.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return fields[0].decode(), fields[19].decode()


def owner_record(pid: int | None = None) -> dict:
    """Who owns a run directory: this host, ``pid`` (default: us), its start, the boot."""
    pid = os.getpid() if pid is None else pid
    state = _process_state(pid)
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "started": state[1] if state else None,
        "boot": _boot_id(),
    }


def write_owner(run_dir: Path, record: dict | None = None) -> None:
    """Write ``owner.json`` into ``run_dir`` (written aside, then renamed: never half read)."""
    partial = run_dir / f".{OWNER_FILE}.part"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(owner_record() if record is None else record, fh)
    os.replace(partial, run_dir / OWNER_FILE)


def owner_is_gone(record: object) -> bool:
    """True only when ``record`` names a process of this host that no longer runs.

    Another host's owner, or a record we cannot read, is never called gone. Where
    ``/proc`` says when the pid started, a pid reused by a newer process counts as
    gone, as does any pid from before a reboot.
    """
    if not isinstance(record, dict) or record.get("host") != socket.gethostname():
        return False
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    boot = _boot_id()
    if record.get("boot") and boot and record["boot"] != boot:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return True  # the pid now belongs to another user: our owner is long gone
    state = _process_state(pid)
    if state is None:
        return False  # no /proc: the pid's existence is all we know
    if state[0] in ("Z", "X"):
        return True
    return bool(record.get("started")) and record["started"] != state[1]


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started (epoch seconds), from ``/proc``; None if unknown."""
    state = _process_state(pid)
    try:
        stat_lines = Path("/proc/stat").read_text().splitlines()
        btime = next(int(line.split()[1]) for line in stat_lines if line.startswith("btime "))
    except (OSError, ValueError, StopIteration):
        return None
    return None if state is None else btime + int(state[1]) / os.sysconf("SC_CLK_TCK")


def _unrecorded_maker_is_gone(name: str, made: float) -> bool:
    """Whether a run dir with no owner record (made at ``made``) was abandoned.

    Its maker writes the record right after mkdtemp, so a record missing for longer
    than ``UNRECORDED_GRACE_S`` means the maker was killed in between: the pid in the
    name tells whether that maker still runs here (a pid that started after the
    directory was made is a reuse). A name without a pid (an older rootstock's) is
    judged by age alone.
    """
    age = time.time() - made
    if age > UNOWNED_RUN_DIR_AGE_S:
        return True
    match = _MAKER_PID.search(name)
    if match is None or age < UNRECORDED_GRACE_S:
        return False
    pid = int(match.group(1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return True  # the pid now belongs to another user
    state = _process_state(pid)
    if state is None:
        return False
    started = process_start_time(pid)
    return state[0] in ("Z", "X") or (started is not None and started > made + 1.0)


def sweep_dead_run_dirs(base: Path) -> list[Path]:
    """Remove our run directories in ``base`` whose owner is gone; the ones removed."""
    removed: list[Path] = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(RUN_DIR_PREFIX)]
    except OSError:
        return removed
    # rootstock-<uid> is the user's own lasting directory (the pool, the compiler
    # cache fallback), never a run dir, however old it is.
    lasting = f"{RUN_DIR_PREFIX}{os.getuid()}"
    for name in names:
        if name == lasting:
            continue
        path = Path(base) / name
        try:
            st = os.lstat(path)
        except OSError:
            continue  # gone already: another process swept it first
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        try:
            with os.fdopen(open_regular_file(path / OWNER_FILE), "rb") as fh:
                record = loads_json(fh.read(4096))
        except NotRegularFile as exc:
            # Not judged, so not removed; a hand-made mess only its user can clear.
            log.warning("skipped %s: %s (remove it: %s)", path / OWNER_FILE, exc, exc.fix)
            continue
        except FileNotFoundError:
            # Still being made (fresh), or its maker died before the record.
            if _unrecorded_maker_is_gone(name, st.st_mtime):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        except (OSError, ValueError):
            continue  # not a run dir of ours
        if owner_is_gone(record):
            shutil.rmtree(path, ignore_errors=True)
            log.debug("removed %s (its owner, pid %s, is gone)", path, record.get("pid"))
            removed.append(path)
    return removed


# --- private directories of ours ---------------------------------------------------------


def is_private_dir(path: Path) -> bool:
    """True if ``path`` is a real directory (no symlink) we own with mode exactly 0700.

    A directory of ours that others may only read or list is tightened to 0700
    first; one that anybody else could write may hold planted files and is refused.
    """
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        if stat.S_IMODE(st.st_mode) != 0o700:
            if st.st_mode & 0o022:
                return False
            os.chmod(path, 0o700)
        return stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    except OSError:
        return False


def can_create_files(path: Path) -> bool:
    """Whether we can really create a file in ``path``.

    ``os.access`` is no answer: for root it says yes to any directory, even one on a
    read-only filesystem.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=".rootstock-probe-", dir=path)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return True


class WorkerListener:
    """A listening Unix socket for exactly one worker connection."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self.run_dir = run_dir or make_private_dir()
        self.path = self.run_dir / SOCKET_NAME
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(str(self.path))
            self._sock.listen(1)
        except OSError:
            self.cleanup()
            raise

    def accept(
        self, timeout: float | None, on_wait: Callable[[], None] | None = None
    ) -> socket.socket:
        """Wait for the worker to connect, calling ``on_wait`` (a liveness check) often.

        The listener is closed afterwards: one worker per listener.
        """
        if self._sock is None:
            raise ProtocolError("the worker listener is already closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._sock.settimeout(ACCEPT_SLICE_S)
        while True:
            try:
                conn, _ = self._sock.accept()
                break
            except TimeoutError:
                if on_wait is not None:
                    on_wait()
                if deadline is not None and time.monotonic() >= deadline:
                    raise WorkerTimeout(
                        f"the worker did not connect within {timeout:g} s",
                        hint="raise timeout= if the env is on a slow filesystem",
                    ) from None
        self.close()
        _check_peer(conn)
        return conn

    def close(self) -> None:
        """Stop listening and remove the socket file (the directory stays)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def cleanup(self) -> None:
        """Close and remove the whole private directory."""
        self.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def peer_uid(conn: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (None: not on Linux)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _check_peer(conn: socket.socket) -> None:
    """Refuse a connection from another user (defence in depth on top of 0700)."""
    uid = peer_uid(conn)
    if uid is not None and uid != os.getuid():
        conn.close()
        raise ProtocolError(f"refused a worker connection from uid {uid}")
