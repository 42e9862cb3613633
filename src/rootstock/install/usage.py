"""The usage-record spool: one anonymous JSON record per worker session.

The spool is ``{cache_root}/usage`` (``setup-perms`` makes it mode 1777, like
/tmp; ``--no-usage-spool`` makes none, which turns collection off). A session
writes its record only if the spool exists and is writable, and never lets a
broken spool reach the user's calculation: recording swallows every error.

Records are created with ``O_EXCL`` under unique names; the sticky bit keeps
users from deleting each other's. ``usage compact`` folds them into monthly
rollups under ``{usage}/rollups/``. See docs/usage-statistics.md for the fields.

Anyone may write into the spool, so whatever is read from it is checked
(:func:`parse_record`); a record that fails is skipped, never counted, and
deleted by compact once it is :data:`TORN_RECORD_MAX_AGE_S` old.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rootstock.install.parsing import ParseProblem, dumps_json, loads_json
from rootstock.install.usage_id import usage_user_id

log = logging.getLogger("rootstock.usage")

RECORD_VERSION = 1
DISABLE_ENV = "ROOTSTOCK_DISABLE_USAGE_STATS"
ENTRY_POINTS = ("calculator", "serve", "verify", "benchmark")
LOCAL_CHECKPOINT = "(local)"
ROLLUPS_DIR = "rollups"
# Readable by the spool's group (the maintainers) and nobody else; with the spool's
# default ACL the named project group reads it too (docs/permissions.md).
RECORD_MODE = 0o640
# What the dashboard stores (src/rootstock/dashboard/schemas.py: ``INT32`` for every
# count, ``models.NAME`` for env and checkpoint names). The client cannot import the
# dashboard (its packages are an extra), so the bounds are repeated here, once;
# tests/unit/test_usage_bounds.py pins them to the dashboard's.
COUNT_MAX = 2**31 - 1
NAME_MAX = 200
_TRUE = {"1", "true", "yes", "on"}


def recording_disabled() -> bool:
    """True when the user opted out with ``ROOTSTOCK_DISABLE_USAGE_STATS=1``."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE


def public_checkpoint(checkpoint: str) -> str:
    """The checkpoint as recorded: ``(local)`` for user weights, never their path."""
    return LOCAL_CHECKPOINT if checkpoint.endswith(":custom") else checkpoint


# --- writing a record -----------------------------------------------------------------


@dataclass
class SessionUsage:
    """What one worker session will record; the hot path only bumps ``force_calls``.

    ``force_calls`` is None for ``serve``: there the worker talks to the i-PI
    server directly and rootstock never sees the calls.
    """

    spool: Path
    env: str
    checkpoint: str
    device: str
    entry_point: str
    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    force_calls: int | None = 0
    connected: bool = False  # a worker that never connected is no session to count
    _t0: float = field(default_factory=time.monotonic)
    _owner_pid: int = field(default_factory=os.getpid)
    _done: bool = False

    def finish(self) -> Path | None:
        """Drop the record (once, from the starting process). Never raises."""
        if self._done or not self.connected or os.getpid() != self._owner_pid:
            return None
        self._done = True
        try:
            return write_record(self.spool, self.record(time.monotonic() - self._t0))
        # Anything at all (a full disk, NFS trouble) stays out of the calculation.
        except Exception as exc:
            log.debug("usage record not written to %s: %s", self.spool, exc)
            return None

    def record(self, duration_s: float) -> dict[str, Any]:
        """The record's content without the user id (added at write time)."""
        return {
            "version": RECORD_VERSION,
            "env": self.env,
            "checkpoint": public_checkpoint(self.checkpoint),
            "device": self.device,
            "entry_point": self.entry_point,
            "start": self.started.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "duration_s": round(max(duration_s, 0.0), 3),
            "force_calls": self.force_calls,
        }


def start_session_usage(
    usage_dir: Path, env: str, checkpoint: str, device: str, entry_point: str
) -> SessionUsage:
    """Begin counting one session; :meth:`SessionUsage.finish` records it."""
    return SessionUsage(Path(usage_dir), env, checkpoint, device, entry_point)


def write_record(spool: Path, record: dict[str, Any]) -> Path | None:
    """Create one record file in ``spool`` with O_EXCL; None when recording is off.

    The record gets this account's random ``user`` id
    (:func:`~rootstock.install.usage_id.usage_user_id`), the spool's group and mode
    0640 (see :func:`_in_spool_group` for a writer outside that group). Raises
    OSError when the spool exists but refuses the write.
    """
    if recording_disabled() or not spool.is_dir():
        return None
    body = dict(record, user=usage_user_id())
    data = (dumps_json(body, sort_keys=True) + "\n").encode("utf-8")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = spool / f"{stamp}-{secrets.token_hex(8)}.json"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, RECORD_MODE)
    try:
        # Whatever the umask: the spool's group must read it, and nobody else.
        os.fchmod(fd, RECORD_MODE if _in_spool_group(fd, spool.stat().st_gid) else 0o600)
        os.write(fd, data)  # one small write: readers skip a record they cannot parse
    finally:
        os.close(fd)
    return path


def _in_spool_group(fd: int, gid: int) -> bool:
    """Put the new record in the spool's group ``gid``; False when its group may not read it.

    The spool is not setgid, so a record starts in its writer's own group, and only
    a member of the spool's group may hand it over. A non-member's record stays in
    the writer's group, where 0640 would let that group read it: unless the spool's
    default ACL governs the file (the owning group's entry is then ``---`` and the
    project group's named entry reads it), it is made 0600 instead.
    """
    if os.fstat(fd).st_gid == gid:
        return True
    try:
        os.fchown(fd, -1, gid)
        return True
    except PermissionError:
        pass
    getxattr = getattr(os, "getxattr", None)  # Linux only
    try:
        # The access ACL is stored only when the file has named entries.
        return getxattr is not None and bool(getxattr(fd, "system.posix_acl_access"))
    except OSError:
        return False


# --- reading ---------------------------------------------------------------------------

# Far above any real record (about 250 bytes); anyone can write into the spool, so a
# file this big is junk, and compact should not read gigabytes to find that out.
RECORD_MAX_BYTES = 64 * 1024
# A record compact cannot read is kept this long (by mtime) and then deleted: long
# enough that a session still writing it, or a recent crash, can be inspected first.
TORN_RECORD_MAX_AGE_DAYS = 7
TORN_RECORD_MAX_AGE_S = TORN_RECORD_MAX_AGE_DAYS * 24 * 3600
# The month must be safe to use in a rollup's file name, whoever wrote the record,
# and be what the dashboard takes: ASCII digits only (``\d`` would take any script's).
_START = re.compile(r"^[0-9]{4}-(0[1-9]|1[0-2])-[0-9]{2}T")
_REQUIRED_TEXT = ("env", "checkpoint", "user")


def record_month(record: dict[str, Any]) -> str:
    """``YYYY-MM`` of a record's (UTC) start time."""
    return str(record["start"])[:7]


def is_record_name(name: str) -> bool:
    """Raw record files: ``<utc>-<random>.json``, never dot-files or temp files."""
    return (
        name.endswith(".json")
        and not name.startswith(".")
        and "/" not in name
        and "\0" not in name
        and len(name) <= 255
    )


def parse_record(raw: bytes) -> dict[str, Any]:
    """One record's content, checked; raises :class:`ParseProblem` saying what is wrong.

    Required: ``start`` (``YYYY-MM-DDT...``), ``env``, ``checkpoint`` and ``user``
    (see :func:`name_problem`), and ``force_calls`` a count up to :data:`COUNT_MAX`
    or null when present. Anything past the dashboard's bounds is refused here, so
    no record can make ``usage push`` fail.
    """
    record = loads_json(raw)
    if not isinstance(record, dict):
        raise ParseProblem("not a JSON object")
    start = record.get("start")
    if not isinstance(start, str) or not _START.match(start):
        raise ParseProblem("start is not a UTC time YYYY-MM-DDTHH:MM:SSZ")
    for key in _REQUIRED_TEXT:
        problem = name_problem(record.get(key))
        if problem:
            raise ParseProblem(f"{key} {problem}")
    calls = record.get("force_calls")
    if calls is not None and (type(calls) is not int or not 0 <= calls <= COUNT_MAX):
        raise ParseProblem(f"force_calls is neither a count up to {COUNT_MAX} nor null")
    return record


def name_problem(value: Any) -> str | None:
    """Why ``value`` cannot be an env, checkpoint or user in a record or rollup, or None.

    A name is a non-empty string of at most :data:`NAME_MAX` characters that every
    dashboard database can store: no NUL, no unpaired surrogate (JSON's ``\\ud800``).
    """
    if not isinstance(value, str) or not value:
        return "is not a non-empty string"
    if len(value) > NAME_MAX:
        return f"is longer than {NAME_MAX} characters"
    if "\0" in value:
        return "holds a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "holds an unpaired surrogate"
    return None


def read_spool_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` in the spool; raises OSError or ParseProblem.

    Anyone may create anything in the spool, so the entry is looked at without
    following it (``lstat``), then opened without following links and without
    blocking (a FIFO would otherwise wait for a writer forever), checked again on
    the open file (the name may have been swapped in between), and read up to
    ``max_bytes``: a larger file is refused, not read to the end.
    """
    if not stat.S_ISREG(path.lstat().st_mode):
        raise ParseProblem("not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ParseProblem("not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise ParseProblem(f"larger than {max_bytes} bytes")
    return raw


def read_record_file(path: Path) -> dict[str, Any]:
    """Read and check one record; raises OSError or :class:`ParseProblem`."""
    return parse_record(read_spool_file(path, RECORD_MAX_BYTES))


def read_records(spool: Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Raw records by file name, plus the names that could not be read or parsed.

    Every entry named like a record counts: one that is not a regular file (a
    FIFO, a symlink, a directory) is unreadable, as is one being written right
    now. Unreadable records are skipped here, and :func:`expire_torn_records`
    removes them only once they are old.
    """
    records: dict[str, dict[str, Any]] = {}
    unreadable: list[str] = []
    for entry in sorted(os.scandir(spool), key=lambda e: e.name):
        if not is_record_name(entry.name):
            continue
        try:
            records[entry.name] = read_record_file(Path(entry.path))
        except FileNotFoundError:
            continue  # deleted since the listing (a concurrent compact): not a record now
        except (OSError, ParseProblem):
            unreadable.append(entry.name)
    return records, unreadable


@dataclass(frozen=True)
class TornRecords:
    """What :func:`expire_torn_records` did with the records nobody can read."""

    removed: list[str]
    kept: list[str]


def expire_torn_records(spool: Path, names: list[str], now: float | None = None) -> TornRecords:
    """Delete the unreadable records ``names`` last modified over 7 days ago.

    A younger one is kept: its session may still be writing it (records are
    written in one call right after they are created, so that window is short), or
    its crash is recent enough to look at. One that cannot be deleted (another
    user's, in a sticky spool) is kept too, and so is a directory. A FIFO or a
    symlink is removed like a file (the link itself, never its target; its age is
    the link's own). ``now`` is a ``time.time()`` value.
    """
    now = time.time() if now is None else now
    removed: list[str] = []
    kept: list[str] = []
    for name in names:
        path = spool / name
        try:
            info = path.lstat()
            if stat.S_ISDIR(info.st_mode) or now - info.st_mtime <= TORN_RECORD_MAX_AGE_S:
                kept.append(name)
                continue
            path.unlink()
        except FileNotFoundError:
            continue  # gone already: nothing to remove or keep
        except OSError:
            kept.append(name)
            continue
        removed.append(name)
    return TornRecords(removed, kept)


_entry_point: contextvars.ContextVar[str] = contextvars.ContextVar(
    "rootstock_usage_entry_point", default="calculator"
)


def current_entry_point() -> str:
    """The entry point sessions started here record (``calculator`` unless set)."""
    return _entry_point.get()


@contextlib.contextmanager
def entry_point(name: str) -> Iterator[None]:
    """Sessions started inside the block record ``name`` (verification uses this)."""
    token = _entry_point.set(name)
    try:
        yield
    finally:
        _entry_point.reset(token)
