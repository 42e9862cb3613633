"""The usage-record spool: one anonymous JSON record per worker session.

The spool is ``{cache_root}/usage`` (``setup-perms`` makes it mode 1777, like
/tmp; ``--no-usage-spool`` makes none, which turns collection off). A session
writes its record only if the spool exists and is writable, and never lets a
broken spool reach the user's calculation: recording swallows every error.

Records are created with ``O_EXCL`` under unique names; the sticky bit keeps
users from deleting each other's. ``usage compact`` folds them into monthly
rollups under ``{usage}/rollups/``. See docs/usage-statistics.md for the fields.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import pwd
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("rootstock.usage")

RECORD_VERSION = 1
DISABLE_ENV = "ROOTSTOCK_DISABLE_USAGE_STATS"
ENTRY_POINTS = ("calculator", "serve", "verify", "benchmark")
LOCAL_CHECKPOINT = "(local)"
SALT_NAME = ".salt"
ROLLUPS_DIR = "rollups"
RECORD_MODE = 0o644
_SALT_BYTES = 32
_TRUE = {"1", "true", "yes", "on"}


def recording_disabled() -> bool:
    """True when the user opted out with ``ROOTSTOCK_DISABLE_USAGE_STATS=1``."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE


def public_checkpoint(checkpoint: str) -> str:
    """The checkpoint as recorded: ``(local)`` for user weights, never their path."""
    return LOCAL_CHECKPOINT if checkpoint.endswith(":custom") else checkpoint


def current_username() -> str:
    """The account this process runs as (from the uid, not from $USER)."""
    uid = os.getuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid:{uid}"


# --- the salt -------------------------------------------------------------------------


def read_or_create_salt(spool: Path) -> bytes:
    """The spool's salt, created once (by whoever first needs it) and world-readable.

    The salt is written to a private temp name and published with ``link()``, which
    fails if ``.salt`` exists: so concurrent first sessions agree on one salt and no
    reader ever sees a half-written file. Raises OSError when the spool refuses.
    """
    path = spool / SALT_NAME
    with contextlib.suppress(FileNotFoundError):
        return _read_salt(path)
    tmp = spool / f".salt.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, RECORD_MODE)
    try:
        os.fchmod(fd, RECORD_MODE)
        os.write(fd, secrets.token_hex(_SALT_BYTES).encode("ascii") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another session won the race; use its salt
    finally:
        tmp.unlink(missing_ok=True)
    return _read_salt(path)


def _read_salt(path: Path) -> bytes:
    salt = path.read_bytes().strip()
    if len(salt) < 16:
        raise OSError(f"usage salt {path} is truncated")
    return salt


def user_hash(salt: bytes, username: str) -> str:
    """The salted hash that stands for a user in records and rollups."""
    return hashlib.sha256(salt + b"\0" + username.encode("utf-8")).hexdigest()[:32]


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
        # Anything at all (a full disk, a bad salt, NFS trouble) stays out of the calculation.
        except Exception as exc:
            log.debug("usage record not written to %s: %s", self.spool, exc)
            return None

    def record(self, duration_s: float) -> dict[str, Any]:
        """The record's content without the user hash (added at write time)."""
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

    Raises OSError when the spool exists but refuses the write.
    """
    if recording_disabled() or not spool.is_dir():
        return None
    salt = read_or_create_salt(spool)
    body = dict(record, user=user_hash(salt, current_username()))
    data = (json.dumps(body, sort_keys=True) + "\n").encode("utf-8")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = spool / f"{stamp}-{secrets.token_hex(8)}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, RECORD_MODE)
    try:
        os.fchmod(fd, RECORD_MODE)  # whatever the umask, the collector must read it
        os.write(fd, data)  # one small write: readers skip a record they cannot parse
    finally:
        os.close(fd)
    return path


# --- reading ---------------------------------------------------------------------------


def record_month(record: dict[str, Any]) -> str:
    """``YYYY-MM`` of a record's (UTC) start time."""
    return str(record["start"])[:7]


def is_record_name(name: str) -> bool:
    """Raw record files: ``<utc>-<random>.json``, never dot-files or temp files."""
    return name.endswith(".json") and not name.startswith(".")


def read_records(spool: Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Raw records by file name, plus the names that could not be read or parsed.

    A record being written right now may be unreadable; it is skipped, not removed.
    """
    records: dict[str, dict[str, Any]] = {}
    unreadable: list[str] = []
    for entry in sorted(os.scandir(spool), key=lambda e: e.name):
        if not is_record_name(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            record = json.loads(Path(entry.path).read_text(encoding="utf-8"))
            if not isinstance(record, dict):
                raise ValueError("not an object")
            record_month(record)
            str(record["env"]), str(record["checkpoint"]), str(record["user"])
        except (OSError, ValueError, KeyError, TypeError):
            unreadable.append(entry.name)
            continue
        records[entry.name] = record
    return records, unreadable


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
