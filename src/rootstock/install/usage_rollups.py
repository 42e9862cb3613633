"""The monthly usage rollup files (``{spool}/rollups/YYYY-MM.json``): model, checks, reading.

A rollup stores, per (env, checkpoint), the sessions, the force calls and the *set*
of user ids, so distinct-user counts stay right however many compactions a month
sees. Of the raw records folded into it, it keeps a count and a digest, and the
names only of those that may still be on disk (``pending``). Writing rollups, and
the order that makes compact crash-safe, is :mod:`rootstock.ops.usage`.

Rollups are read like the spool's records (no link followed, no FIFO waited on,
a size cap), from a ``rollups/`` a maintainer made, and every field is checked:
a rollup that fails raises :class:`UsageRollupError` naming the file and the
field. Entries the dashboard would refuse (written before records were bounded)
are dropped or capped on reading and noted in :attr:`Rollup.repairs`.
"""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from rootstock.errors import RootstockError
from rootstock.install.parsing import ParseProblem, loads_json
from rootstock.install.usage import (
    COUNT_MAX,
    ROLLUPS_DIR,
    is_record_name,
    name_problem,
    read_spool_file,
)

ROLLUP_VERSION = 2
MONTH = re.compile(r"^[0-9]{4}-(0[1-9]|1[0-2])$")  # ASCII digits: the dashboard's month
# Far above a real rollup (a few KB; about 35 bytes a distinct user); rollups/ is
# checked to be a maintainer's, so this only keeps a mistake from being read whole.
ROLLUP_MAX_BYTES = 64 * 2**20


@dataclass
class Tally:
    """Counts for one (month, env, checkpoint)."""

    sessions: int = 0
    force_calls: int = 0
    users: set[str] = field(default_factory=set)

    def add_record(self, record: dict[str, Any]) -> None:
        """Count one raw record (serve records carry no force count)."""
        self.sessions += 1
        self.force_calls += int(record.get("force_calls") or 0)
        self.users.add(str(record["user"]))

    def merge(self, other: Tally) -> None:
        """Add another tally of the same key (user sets are unioned)."""
        self.sessions += other.sessions
        self.force_calls += other.force_calls
        self.users |= other.users


_DIGEST_MOD = 1 << 256
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class UsageRollupError(RootstockError):
    """A monthly rollup file that cannot be read or does not hold a valid rollup."""


def name_digest(names: Iterable[str]) -> int:
    """The order-independent digest of record names: sum of their sha256, mod 2**256.

    A sum rather than XOR, so a name folded twice changes the digest instead of
    cancelling out.
    """
    total = 0
    for name in names:
        total += int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest(), "big")
    return total % _DIGEST_MOD


@dataclass
class Rollup:
    """One month's folded counts, and the names of folded records that may still exist.

    ``folded_digest`` stands for every record ever folded in (no names, so the file
    stays small) and ``folded_count`` for those still counted (all but the sessions
    of an entry :meth:`bound` dropped). ``pending`` names the folded records not
    yet known to be deleted: those of the compaction in progress (or of one that
    was killed before deleting them), and those compact could not delete. A
    record named there is never counted again.
    """

    month: str
    groups: dict[tuple[str, str], Tally] = field(default_factory=dict)
    folded_count: int = 0
    folded_digest: int = 0
    pending: set[str] = field(default_factory=set)
    migrated: bool = False  # read from an older schema: compact rewrites it
    # Entries the dashboard would refuse, dropped or capped on reading (what was done,
    # one line each): written before records were bounded; compact rewrites the file.
    repairs: list[str] = field(default_factory=list)

    def fold(self, name: str, record: dict[str, Any]) -> bool:
        """Fold one record in; False (and no change) when it is pending already."""
        if name in self.pending:
            return False
        key = (str(record["env"]), str(record["checkpoint"]))
        self.groups.setdefault(key, Tally()).add_record(record)
        self.folded_count += 1
        self.folded_digest = (self.folded_digest + name_digest([name])) % _DIGEST_MOD
        self.pending.add(name)
        return True

    def to_json(self) -> dict[str, Any]:
        """The on-disk shape (schema ``ROLLUP_VERSION``)."""
        return {
            "version": ROLLUP_VERSION,
            "month": self.month,
            "groups": [
                {
                    "env": env,
                    "checkpoint": checkpoint,
                    "sessions": t.sessions,
                    "force_calls": t.force_calls,
                    "users": sorted(t.users),
                }
                for (env, checkpoint), t in sorted(self.groups.items())
            ],
            "folded_count": self.folded_count,
            "folded_digest": f"{self.folded_digest:064x}",
            "pending": sorted(self.pending),
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "usage rollup") -> Rollup:
        """Check and parse a rollup file's content (schema 1 or 2).

        Raises :class:`UsageRollupError` naming ``where`` and the JSON path of the
        first bad field, or saying the file is from a newer rootstock.
        """
        check = _Checker(where)
        data = check.of(data, dict, "the file")
        version = check.count(data, "version", "version")
        if version > ROLLUP_VERSION:
            raise UsageRollupError(
                f"{where} has schema version {version}: written by a newer rootstock",
                hint="upgrade rootstock before compacting or reporting",
            )
        if version < 1:
            check.fail("version", f"{version} is not a rollup schema version")
        month = check.of(data.get("month"), str, "month")
        if not MONTH.match(month):
            check.fail("month", f"{month!r} is not a month YYYY-MM")
        rollup = cls(month=month)
        dropped = 0
        for i, group in enumerate(check.of(data.get("groups"), list, "groups")):
            at = f"groups[{i}]"
            group = check.of(group, dict, at)
            key = (check.text(group, "env", at), check.text(group, "checkpoint", at))
            if key in rollup.groups:
                check.fail(at, f"a second entry for env {key[0]!r}, checkpoint {key[1]!r}")
            users = check.of(group.get("users"), list, f"{at}.users")
            for j, user in enumerate(users):
                check.of(user, str, f"{at}.users[{j}]")
            tally = Tally(
                check.count(group, "sessions", at),
                check.count(group, "force_calls", at),
                set(users),
            )
            if rollup.bound(at, key, tally):
                rollup.groups[key] = tally
            else:
                dropped += tally.sessions
        if version == 1:
            # Schema 1 named every folded record; every one may still be on disk.
            names = check.names(data, "folded")
            rollup.folded_count, rollup.folded_digest = len(names), name_digest(names)
            rollup.pending, rollup.migrated = names, True
        else:
            rollup.folded_count = check.count(data, "folded_count", "folded_count")
            digest = check.of(data.get("folded_digest"), str, "folded_digest")
            if not _HEX64.match(digest):
                check.fail("folded_digest", "is not 64 lower-case hex digits")
            rollup.folded_digest = int(digest, 16)
            rollup.pending = check.names(data, "pending")
        sessions = sum(t.sessions for t in rollup.groups.values()) + dropped
        if sessions != rollup.folded_count:
            check.fail(
                "groups",
                f"hold {sessions} session(s) but {rollup.folded_count} record(s) were folded",
            )
        # The sessions of a dropped entry are no longer counted anywhere; the digest
        # still covers their names, so they are never folded again.
        rollup.folded_count -= dropped
        return rollup

    def bound(self, at: str, key: tuple[str, str], tally: Tally) -> bool:
        """Keep ``tally`` within what records can sum to; False to drop it (noted in repairs).

        A name the dashboard refuses drops the entry; force calls above
        :data:`COUNT_MAX` a session are capped at that.
        """
        for field_name, name in zip(("env", "checkpoint"), key, strict=True):
            problem = name_problem(name)
            if problem:
                self.repairs.append(
                    f"{at}: dropped {tally.sessions} session(s) whose {field_name} "
                    f"{_excerpt(name)} {problem}"
                )
                return False
        most = tally.sessions * COUNT_MAX
        if tally.force_calls > most:
            self.repairs.append(
                f"{at} (env {_excerpt(key[0])}, checkpoint {_excerpt(key[1])}): capped "
                f"{tally.force_calls} force calls at {most} ({COUNT_MAX} a session)"
            )
            tally.force_calls = most
        return True


def _excerpt(text: str, length: int = 40) -> str:
    """``text`` for a message: quoted and cut short (``repr`` escapes what is unprintable)."""
    more = len(text) - length
    return repr(text[:length]) + (f" (+{more} characters)" if more > 0 else "")


class _Checker:
    """Type checks for one rollup file, each failure naming the file and the JSON path."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, problem: str) -> NoReturn:
        raise UsageRollupError(
            f"{self.where} is invalid: {path}: {problem}",
            hint="rollups are written only by `rootstock usage compact`; restore this file "
            "from a backup, or move it out of rollups/ (its month's counts go with it)",
        )

    def of(self, value: Any, kind: type, path: str) -> Any:
        # bool is an int to Python, never to a rollup
        if not isinstance(value, kind) or isinstance(value, bool):
            self.fail(path, f"should be {_json_kind(kind)}, is {_json_kind(type(value))}")
        return value

    def count(self, data: dict[str, Any], key: str, at: str) -> int:
        path = key if at == key else f"{at}.{key}"
        value = self.of(data.get(key), int, path)
        if value < 0:
            self.fail(path, f"{value} is negative")
        return value

    def text(self, data: dict[str, Any], key: str, at: str) -> str:
        value = self.of(data.get(key), str, f"{at}.{key}")
        if not value:
            self.fail(f"{at}.{key}", "is empty")
        return value

    def names(self, data: dict[str, Any], key: str) -> set[str]:
        names = self.of(data.get(key), list, key)
        for i, name in enumerate(names):
            if not isinstance(name, str) or not is_record_name(name):
                self.fail(f"{key}[{i}]", f"{name!r} is not a record file name")
        return set(names)


def _json_kind(kind: type) -> str:
    """A Python type as the JSON reader of an error message knows it."""
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        int: "a whole number",
        float: "a fractional number",
        bool: "true or false",
        type(None): "null or missing",
    }.get(kind, kind.__name__)


def rollup_path(spool: Path, month: str) -> Path:
    """Where the rollup of ``month`` lives."""
    return spool / ROLLUPS_DIR / f"{month}.json"


def load_rollups(spool: Path) -> dict[str, Rollup]:
    """Every monthly rollup in the spool, by month; any bad one raises UsageRollupError.

    Each file is read as the spool's records are (no links followed, no FIFO waited
    on), from a ``rollups/`` that :func:`check_rollups_dir` trusts.
    """
    directory = spool / ROLLUPS_DIR
    if not check_rollups_dir(spool):
        return {}
    rollups = {}
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith(".") or not MONTH.match(path.stem):
            continue
        try:
            data = loads_json(read_spool_file(path, ROLLUP_MAX_BYTES))
        except (OSError, ParseProblem) as exc:
            raise UsageRollupError(
                f"usage rollup {path} is unreadable ({exc})",
                hint="rollups are written atomically; restore it from a backup, or move it "
                "out of rollups/ (its month's counts go with it)",
            ) from None
        rollup = Rollup.from_json(data, where=f"usage rollup {path}")
        if rollup.month != path.stem:
            _Checker(f"usage rollup {path}").fail(
                "month", f"{rollup.month!r} is not the month its file name says"
            )
        rollups[path.stem] = rollup
    return rollups


def check_rollups_dir(spool: Path) -> bool:
    """True when ``{spool}/rollups`` is a directory a maintainer made; False when absent.

    The spool is world-writable, so anyone could create ``rollups/`` before the
    first compact and fill it with rollups that block every report and push, or
    that name real records as folded. It is trusted only when it is a real
    directory (not a link) owned by root, by this account, by the spool's owner, or
    by a member of the spool's group (the maintainers, after ``setup-perms``);
    anything else raises :class:`UsageRollupError`.
    """
    directory = spool / ROLLUPS_DIR
    try:
        info = directory.lstat()
    except FileNotFoundError:
        return False
    fix = f"remove {directory} (as its owner, or root); `rootstock usage compact` recreates it"
    if not stat.S_ISDIR(info.st_mode):
        raise UsageRollupError(f"{directory} is not a directory (a link or a file)", hint=fix)
    spool_info = spool.stat()
    if info.st_uid not in (0, os.geteuid(), spool_info.st_uid) and not _in_group(
        info.st_uid, spool_info.st_gid
    ):
        raise UsageRollupError(
            f"{directory} is owned by uid {info.st_uid}, who is not a maintainer of this "
            "spool (its owner or a member of its group): anyone may write into the spool, "
            "so rollups from elsewhere are never read",
            hint=fix,
        )
    return True


def _in_group(uid: int, gid: int) -> bool:
    """Whether account ``uid`` is in group ``gid`` (its primary group, or listed)."""
    try:
        account = pwd.getpwuid(uid)
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return account.pw_gid == gid or account.pw_name in group.gr_mem
