"""Crash-safe writes for files that many processes on a shared filesystem read.

A writer never edits a file in place: it writes a temp file in the same directory,
flushes it to disk, and renames it over the target. Readers see the old file or the
new one, never half of either.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def current_umask() -> int:
    """Return the process umask without changing it for longer than a call."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` through a same-directory temp file and a rename.

    ``mode`` defaults to ``0o666`` less the umask, as ``open()`` would give a new
    file; temp-file helpers create 0600 files, which would break a world-readable
    shared install.
    """
    path = Path(path)
    if mode is None:
        mode = 0o666 & ~current_umask()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Text flavour of :func:`atomic_write_bytes` (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: Path, obj: Any, mode: int | None = None) -> None:
    """Write ``obj`` as indented, key-sorted JSON with a trailing newline.

    Standard JSON only: NaN or an infinity raises ``ValueError`` before anything is
    written (Python would write ``NaN``, which no other JSON reader accepts).
    """
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False)
    atomic_write_text(path, text + "\n", mode)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory; the rename stands
    finally:
        os.close(fd)
