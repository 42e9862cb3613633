"""A worker's hold on the env generation it runs from (stdlib only).

Every build gets an empty, world-readable ``.rootstock-generation.lock`` in its
directory (``envs/.<name>.<build-id>/``). A worker takes a *shared* ``lockf`` lock on
it at start and keeps it for its whole life; ``lockf`` needs only a read-only
descriptor for a shared lock, so users outside the maintainers' group hold it too.
``install`` and ``prune`` take the lock *exclusively* (without waiting) before they
rename or delete a generation, so a generation some worker runs from is never
pulled from under it: see :mod:`rootstock.install.generations`.

The descriptor is deliberately never closed: POSIX record locks are dropped when
the process closes *any* descriptor of the file, and released by the kernel when
the process exits, however it dies.
"""

from __future__ import annotations

import fcntl
import os
import sys

#: The lock file's name inside a generation directory.
GENERATION_LOCK = ".rootstock-generation.lock"
#: Set for a worker started from a node-local stage: the shared generation it was
#: staged from, which it holds instead of its own prefix (the stage).
GENERATION_ENV = "ROOTSTOCK_GENERATION"

_held: list[int] = []


def hold_generation(prefix: str | None = None, *, resolved: bool = False) -> str | None:
    """Take the shared lock of the generation ``prefix`` (default ``sys.prefix``) is;
    ``resolved``: ``prefix`` is already the real path (no lookups to resolve it).

    Returns the generation directory locked, or None when there is nothing to hold
    (an env built before generation locks existed, a plain venv) or the lock is
    refused right now (a prune holds it exclusively: it is about to go, and the
    worker runs on regardless, as it always did).
    """
    generation = prefix if resolved and prefix else os.path.realpath(prefix or sys.prefix)
    try:
        fd = os.open(os.path.join(generation, GENERATION_LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    _held.append(fd)
    return generation
