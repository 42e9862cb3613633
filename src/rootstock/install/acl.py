"""Read POSIX ACLs without the ``acl`` package, from their extended attributes.

Linux stores a path's access and default ACLs as the ``system.posix_acl_access``
and ``system.posix_acl_default`` xattrs, in one little-endian binary format on
every filesystem that supports them (ext4, xfs, GPFS, Lustre, tmpfs). Reading
them directly keeps the read-only permission check free of a ``getfacl``
subprocess per path and of a dependency on the ``acl`` package, which compute
and login nodes do not always have. Writing stays with ``setfacl`` (the recipe).
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import struct
from dataclasses import dataclass

ACCESS_XATTR = "system.posix_acl_access"
DEFAULT_XATTR = "system.posix_acl_default"

_VERSION = 2
_HEADER = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")

USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_TAG_NAMES = {USER_OBJ: "user", USER: "user", GROUP_OBJ: "group", GROUP: "group"}
_TAG_NAMES |= {MASK: "mask", OTHER: "other"}

# Errors that mean "this filesystem keeps no POSIX ACLs here", not "no ACL set".
_UNSUPPORTED = {errno.ENOTSUP, errno.EOPNOTSUPP}


class AclUnsupported(OSError):
    """The filesystem does not expose POSIX ACLs (e.g. NFSv4 ACLs, or mounted noacl)."""


@dataclass(frozen=True)
class AclEntry:
    """One ACL entry: a tag, an optional user or group id, and rwx bits (4/2/1)."""

    tag: int
    qualifier: int | None
    perms: int

    @property
    def name(self) -> str:
        """The entry's qualifier as a user or group name (the id if unknown)."""
        if self.qualifier is None:
            return ""
        try:
            if self.tag == USER:
                return pwd.getpwuid(self.qualifier).pw_name
            return grp.getgrgid(self.qualifier).gr_name
        except KeyError:
            return str(self.qualifier)

    def text(self, prefix: str = "") -> str:
        """The entry as getfacl prints it, e.g. ``group:proj:rwx``."""
        return f"{prefix}{_TAG_NAMES[self.tag]}:{self.name}:{perm_text(self.perms)}"


@dataclass(frozen=True)
class Acl:
    """An access or default ACL: the entries in on-disk order."""

    entries: tuple[AclEntry, ...]

    def _first(self, tag: int) -> AclEntry | None:
        return next((e for e in self.entries if e.tag == tag), None)

    @property
    def mask(self) -> int | None:
        entry = self._first(MASK)
        return entry.perms if entry else None

    @property
    def other(self) -> int | None:
        entry = self._first(OTHER)
        return entry.perms if entry else None

    @property
    def named_users(self) -> list[AclEntry]:
        return [e for e in self.entries if e.tag == USER]

    @property
    def named_groups(self) -> list[AclEntry]:
        return [e for e in self.entries if e.tag == GROUP]

    def group_perms(self, gid: int) -> int | None:
        """The bits a named-group entry for ``gid`` grants before the mask, if any."""
        return next((e.perms for e in self.named_groups if e.qualifier == gid), None)


def perm_text(bits: int) -> str:
    """``0b101`` -> ``r-x``."""
    return "".join(ch if bits & b else "-" for ch, b in (("r", 4), ("w", 2), ("x", 1)))


def parse_acl(blob: bytes) -> Acl:
    """Decode the binary xattr value of a POSIX ACL."""
    if len(blob) < _HEADER.size or (len(blob) - _HEADER.size) % _ENTRY.size:
        raise ValueError(f"malformed POSIX ACL xattr ({len(blob)} bytes)")
    (version,) = _HEADER.unpack_from(blob)
    if version != _VERSION:
        raise ValueError(f"unknown POSIX ACL xattr version {version}")
    entries = []
    for offset in range(_HEADER.size, len(blob), _ENTRY.size):
        tag, perms, ident = _ENTRY.unpack_from(blob, offset)
        qualifier = ident if tag in (USER, GROUP) else None
        entries.append(AclEntry(tag, qualifier, perms & 0o7))
    return Acl(tuple(entries))


def read_acl(path: str | os.PathLike, default: bool = False) -> Acl | None:
    """The access (or default) ACL of ``path``; None when only the mode bits apply.

    Raises :class:`AclUnsupported` when the filesystem keeps no POSIX ACLs.
    """
    try:
        blob = os.getxattr(path, DEFAULT_XATTR if default else ACCESS_XATTR)
    except OSError as exc:
        if exc.errno == errno.ENODATA:
            return None
        if exc.errno in _UNSUPPORTED:
            raise AclUnsupported(exc.errno, "POSIX ACLs are not supported", str(path)) from None
        raise
    return parse_acl(blob)
