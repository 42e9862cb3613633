"""Whether an install root is shared with other users, or private to its owner.

Only a shared root owes others anything, so only a shared root draws the permission
warnings of ``install``, ``add`` and ``sync`` (``check-perms`` checks any root it is
pointed at). ``layout.json`` records the choice as ``"shared": true`` or ``false``:
``init --shared/--private`` writes it, and ``setup-perms --apply`` records ``true``.

A ``layout.json`` without the field (written before it existed) is read from what
the root shows. It is shared when:

* the cluster registry names it (a cluster install);
* it has the setgid bit, which ``setup-perms`` sets and ``init`` never does;
* it is world-writable, or group-writable by a group that holds someone besides its
  owner. ``init`` makes roots with umask 002, so a personal root is group-writable
  by its owner's own group (the user-private-group scheme); that lets nobody in.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rootstock.errors import ConfigError
from rootstock.install.clusters import clusters_for_root
from rootstock.install.layout import InstallLayout, read_layout

#: The ``layout.json`` key that records the choice.
SHARED_KEY = "shared"


@dataclass(frozen=True)
class SharingDefault:
    """What ``init`` records when no flag says: ``shared`` is None where it must ask."""

    shared: bool | None
    reason: str


def root_is_shared(layout: InstallLayout) -> bool:
    """Whether others use ``layout``'s root: as ``layout.json`` records it, else as it looks.

    Raises :class:`~rootstock.errors.LayoutError` for a ``layout.json`` that
    :func:`~rootstock.install.layout.read_layout` refuses.
    """
    recorded = (read_layout(layout.root) or {}).get(SHARED_KEY)
    if isinstance(recorded, bool):
        return recorded
    return looks_shared(layout.root)


def looks_shared(root: Path) -> bool:
    """Whether ``root`` is registered as a cluster install, or its mode lets others in."""
    try:
        if clusters_for_root(root):
            return True
    except ConfigError:
        # A broken registry is reported by the commands that resolve through it; this
        # advisory answer goes on without it.
        pass
    try:
        st = os.stat(root)
    except OSError:
        return False
    if st.st_mode & (stat.S_ISGID | stat.S_IWOTH):
        return True
    return bool(st.st_mode & stat.S_IWGRP) and not _owners_own_group(st.st_uid, st.st_gid)


def sharing_default(root: Path) -> SharingDefault:
    """What ``init`` records for ``root`` when neither ``--shared`` nor ``--private`` is given.

    A root that already looks shared (``setup-perms`` ran on it, or the registry
    names it) is shared; one under ``$HOME`` or a temp dir is private; elsewhere
    the answer is the maintainer's to give.
    """
    if looks_shared(root):
        return SharingDefault(True, "set up for others or registered as a cluster install")
    if _is_personal_place(root):
        return SharingDefault(False, "under your home directory or a temp directory")
    return SharingDefault(None, "outside your home directory and the temp directories")


def _owners_own_group(uid: int, gid: int) -> bool:
    """True for a user-private group: its owner's primary group, named after them, no one else."""
    try:
        user = pwd.getpwuid(uid)
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return (
        user.pw_gid == gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}
    )


def personal_places() -> list[str]:
    """Where a root is private unless said otherwise: ``$HOME``, ``/tmp``, the temp dir."""
    return ["/tmp", tempfile.gettempdir(), os.path.expanduser("~")]


def _is_personal_place(root: Path) -> bool:
    target = os.path.realpath(root)
    for place in personal_places():
        resolved = os.path.realpath(place)
        if resolved != "/" and (target == resolved or target.startswith(resolved + os.sep)):
            return True
    return False
