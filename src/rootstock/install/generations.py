"""Env generations (``envs/.<name>.<build-id>/``): which are in use, and claiming one.

A running worker holds a shared ``lockf`` lock on its generation's
:data:`~rootstock.wire.generation.GENERATION_LOCK` (see
:mod:`rootstock.wire.generation`). Before ``install`` or ``prune`` renames or
deletes a generation it claims it with :func:`claim_generation`: an exclusive
lock, taken without waiting. Refused means a worker runs from it: skip it.

Byte-range locks are only as good as the filesystem's lock manager. Where they are
not coherent across nodes (NFS without a lock manager, Lustre mounted
``localflock`` or without ``flock``; see :func:`locks_are_coherent`), a lock free
here says nothing about a worker on another node, so callers fall back to keeping
generations by age.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rootstock.wire.generation import GENERATION_LOCK

__all__ = [
    "GENERATION_LOCK",
    "LockCoherence",
    "claim_generation",
    "generation_lock_path",
    "locks_are_coherent",
    "make_generation_lock",
    "remove_old_generations",
]

log = logging.getLogger("rootstock.install")

#: Where locks are not coherent across nodes, a replaced generation is kept until
#: its successor is this old: a worker on another node holds a lock we cannot see.
INCOHERENT_LOCKS_KEEP_S = 24 * 3600


def generation_lock_path(generation: Path) -> Path:
    return generation / GENERATION_LOCK


def make_generation_lock(generation: Path) -> None:
    """Create the (empty, world-readable, group-writable) lock file of a generation."""
    fd = os.open(generation_lock_path(generation), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o664)
    # Whatever the umask: every user's worker opens it to read, and every maintainer
    # of the group must open it for writing to claim it (an exclusive lockf).
    os.fchmod(fd, 0o664)
    os.close(fd)


@contextlib.contextmanager
def claim_generation(generation: Path) -> Iterator[bool | None]:
    """Hold ``generation`` exclusively for the body, if no worker runs from it.

    Yields True when claimed (rename or delete it inside the ``with``), False when a
    worker holds it (leave it), and None when it has no lock file (built before
    generation locks: nothing says whether it is in use; the caller decides by age).
    """
    try:
        fd = os.open(generation_lock_path(generation), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    except OSError:
        yield False  # cannot open it for writing: never delete what we cannot claim
        return
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def remove_old_generations(generations: list[Path], keep: set[Path | None]) -> list[str]:
    """Delete the ``generations`` of one env outside ``keep`` that no worker holds.

    Returns warnings for what was kept. Each is claimed first: one a worker holds
    is kept and reported; one with no lock file (built before generation locks) is
    deleted, as before them. Where locks are not coherent across nodes (see
    :func:`locks_are_coherent`), a lock free here proves nothing about a worker on
    another node, so a generation is kept until :data:`INCOHERENT_LOCKS_KEEP_S`
    after its successor was built (when it stopped being current).
    """
    if not generations:
        return []
    coherence = locks_are_coherent(generations[0].parent)
    by_age = sorted(generations, key=_mtime)
    superseded = {old: _mtime(new) for old, new in itertools.pairwise(by_age)}
    warnings, kept_by_age = [], []
    for generation in by_age:
        if Path(os.path.realpath(generation)) in keep:
            continue
        with claim_generation(generation) as claimed:
            if claimed is False:
                log.info("keeping %s: a running worker holds it", generation)
                warnings.append(
                    f"warning: kept {generation}: a running worker uses it (the next "
                    "install or `rootstock prune` removes it once it is free)"
                )
                continue
            age = time.time() - superseded.get(generation, _mtime(generation))
            if not coherence.coherent and age < INCOHERENT_LOCKS_KEEP_S:
                kept_by_age.append(generation.name)
                continue
            shutil.rmtree(generation, ignore_errors=True)
    if kept_by_age:
        warnings.append(
            f"warning: kept {', '.join(kept_by_age)} for a day after they were replaced: "
            f"{coherence.reason}, so a worker on another node would hold a lock unseen"
        )
    return warnings


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


@dataclass(frozen=True)
class LockCoherence:
    """Whether ``lockf`` locks under a path are seen by every node, and why."""

    coherent: bool
    fstype: str
    reason: str


# Filesystems whose POSIX locks are coherent across nodes only with certain options.
_NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "fuse.sshfs")


def locks_are_coherent(path: Path) -> LockCoherence:
    """Read ``/proc/self/mountinfo`` for the filesystem holding ``path``.

    Local filesystems are coherent (one node). Lustre needs the ``flock`` mount
    option (``localflock`` is node-local); NFS needs a lock manager (``nolock``
    or ``local_lock=posix|all`` make locks node-local); GPFS and BeeGFS are taken
    as coherent (their lock managers are cluster-wide). Anything unknown that looks
    like a network filesystem is not.
    """
    mount = _mount_of(path)
    if mount is None:
        return LockCoherence(True, "unknown", "no /proc/self/mountinfo: taken as local")
    fstype, options = mount
    if fstype == "lustre":
        if "flock" in options:
            return LockCoherence(True, fstype, "Lustre mounted with flock: locks are cluster-wide")
        return LockCoherence(
            False, fstype, "Lustre without the flock mount option: locks are node-local"
        )
    if fstype.startswith("nfs"):
        local = options & {"nolock", "local_lock=posix", "local_lock=all"}
        if local:
            return LockCoherence(False, fstype, f"NFS mounted {sorted(local)[0]}: locks are local")
        return LockCoherence(True, fstype, "NFS with a lock manager: locks are server-side")
    if fstype in ("gpfs", "beegfs"):
        return LockCoherence(True, fstype, f"{fstype}: cluster-wide lock manager")
    if fstype in _NETWORK_FS or fstype.startswith("fuse."):
        return LockCoherence(False, fstype, f"{fstype}: locks are not known to be coherent")
    return LockCoherence(True, fstype, f"{fstype} is a local filesystem")


#: This process's mount table (read by :func:`locks_are_coherent`).
MOUNTINFO = Path("/proc/self/mountinfo")


def _mount_of(path: Path) -> tuple[str, set[str]] | None:
    """(fstype, mount and super options) of the longest mount point above ``path``."""
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[int, str, set[str]] | None = None
    for line in lines:
        fields = line.split()
        try:
            dash = fields.index("-")
        except ValueError:
            continue
        if dash < 6 or len(fields) < dash + 4:
            continue  # not a mountinfo line: never let one bad line hide the table
        # The kernel writes space, tab, newline and backslash as octal escapes.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if target != point and not target.startswith(point.rstrip("/") + "/"):
            continue
        options = set(fields[5].split(",")) | set(fields[dash + 3].split(","))
        if best is None or len(point) >= best[0]:
            best = (len(point), fields[dash + 1], options)
    return None if best is None else (best[1], best[2])
