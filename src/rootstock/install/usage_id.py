"""The random id that stands for an account in usage records.

Each account keeps 128 random bits in ``usage-id`` beside its ``config.toml``
(:func:`~rootstock.install.config.config_path`: ``$ROOTSTOCK_CONFIG``'s directory,
else ``$XDG_CONFIG_HOME/rootstock`` or ``~/.config/rootstock``), mode 0600 in a
directory created 0700. Nothing can derive it from the account name or from the
spool, so a record cannot be traced back to a person by hashing names, as the
salted hash it replaces could. The same account gets the same id in every month,
which keeps distinct-user counts right.

Where that file cannot be kept (a read-only or missing home, a damaged or foreign
file), the process uses a random id of its own: its records are still written and
counted, as one more distinct user, and are never traced back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
from pathlib import Path

from rootstock.install.config import config_path

log = logging.getLogger("rootstock.usage")

USER_ID_NAME = "usage-id"
USER_ID_MODE = 0o600
_ID_BYTES = 16
_ID = re.compile(r"^[0-9a-f]{32}$")
_process_id: str | None = None


def user_id_path() -> Path:
    """Where this account's usage id lives: beside config.toml."""
    return config_path().parent / USER_ID_NAME


def usage_user_id() -> str:
    """This account's usage id, created on first use; never raises.

    Falls back to :func:`process_user_id` when the file cannot be read or created.
    """
    path = user_id_path()
    try:
        return read_or_create_user_id(path)
    except (OSError, ValueError) as exc:
        log.debug("usage id %s unusable, using one for this process: %s", path, exc)
        return process_user_id()


def process_user_id() -> str:
    """A random id for this process alone (the same for all its sessions)."""
    global _process_id
    if _process_id is None:
        _process_id = secrets.token_hex(_ID_BYTES)
    return _process_id


def read_or_create_user_id(path: Path) -> str:
    """The id in ``path``, created once (0600, its directory 0700 if new).

    The id is written to a private temp name and published with ``link()``, which
    fails if ``path`` exists: concurrent first sessions agree on one id and none
    reads a half-written file. Raises OSError when the directory refuses, and
    ValueError when the file exists but holds no id (it is left as it is).
    """
    with contextlib.suppress(FileNotFoundError):
        return _read_user_id(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, USER_ID_MODE)
    try:
        os.fchmod(fd, USER_ID_MODE)  # whatever the umask: no one else may read it
        os.write(fd, secrets.token_hex(_ID_BYTES).encode("ascii") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another session won the race; use its id
    finally:
        tmp.unlink(missing_ok=True)
    return _read_user_id(path)


def _read_user_id(path: Path) -> str:
    """The id in ``path``: a regular file of this account's, never through a link.

    A file others can read is made private (whoever reads it could tell this
    account's records apart).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise ValueError(f"{path} is not a regular file of this account's")
        if stat.S_IMODE(info.st_mode) != USER_ID_MODE:
            os.fchmod(fd, USER_ID_MODE)
        text = os.read(fd, 64).decode("ascii", errors="replace").strip()
    finally:
        os.close(fd)
    if not _ID.match(text):
        raise ValueError(f"{path} holds no usage id")
    return text
