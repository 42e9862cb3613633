"""``rootstock usage report | compact``: aggregate the usage spool (``usage push`` sends
the report's counts: :func:`rootstock.ops.push.push_usage`).

A monthly rollup (``{usage}/rollups/YYYY-MM.json``) stores, per (env, checkpoint),
the sessions, the force calls and the *set* of user hashes, so distinct-user
counts stay right however many compactions a month sees. It also lists the raw
records it has folded in: a record is deleted only after the rollup naming it is
on disk, and a record already named is never counted again. A ``compact`` killed
at any point therefore leaves a state from which a re-run (or ``report``) gives
the same totals.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import RootstockError, UsageError
from rootstock.install.atomic import atomic_write_json
from rootstock.install.layout import InstallLayout
from rootstock.install.locking import FileLock
from rootstock.install.usage import ROLLUPS_DIR, read_records, record_month

ROLLUP_VERSION = 1
REPORT_VERSION = 1
_MONTH = re.compile(r"^\d{4}-(0[1-9]|1[0-2])$")

Key = tuple[str, str, str]  # (month, env, checkpoint)


class UsageSpoolMissing(RootstockError):
    """The install has no usage spool (collection is off, or the path is wrong)."""


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


def tally_records(records: Iterable[dict[str, Any]]) -> dict[Key, Tally]:
    """Group raw records by (month, env, checkpoint)."""
    tallies: dict[Key, Tally] = {}
    for record in records:
        key = (record_month(record), str(record["env"]), str(record["checkpoint"]))
        tallies.setdefault(key, Tally()).add_record(record)
    return tallies


# --- rollups ---------------------------------------------------------------------------


@dataclass
class Rollup:
    """One month's folded counts and the names of the records folded into them."""

    month: str
    groups: dict[tuple[str, str], Tally] = field(default_factory=dict)
    folded: set[str] = field(default_factory=set)

    def fold(self, name: str, record: dict[str, Any]) -> bool:
        """Fold one record in; False (and no change) when it was folded before."""
        if name in self.folded:
            return False
        key = (str(record["env"]), str(record["checkpoint"]))
        self.groups.setdefault(key, Tally()).add_record(record)
        self.folded.add(name)
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
            "folded": sorted(self.folded),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Rollup:
        """Parse a rollup file's content; raises RootstockError on a newer schema."""
        if int(data.get("version", 0)) > ROLLUP_VERSION:
            raise RootstockError(
                f"usage rollup for {data.get('month')} was written by a newer rootstock",
                hint="upgrade rootstock before compacting or reporting",
            )
        rollup = cls(month=str(data["month"]), folded=set(data.get("folded", [])))
        for group in data.get("groups", []):
            rollup.groups[(group["env"], group["checkpoint"])] = Tally(
                int(group["sessions"]), int(group["force_calls"]), set(group["users"])
            )
        return rollup


def rollup_path(spool: Path, month: str) -> Path:
    return spool / ROLLUPS_DIR / f"{month}.json"


def load_rollups(spool: Path) -> dict[str, Rollup]:
    """Every monthly rollup in the spool, by month."""
    directory = spool / ROLLUPS_DIR
    if not directory.is_dir():
        return {}
    rollups = {}
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith(".") or not _MONTH.match(path.stem):
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RootstockError(
                f"usage rollup {path} is unreadable ({exc})",
                hint="rollups are written atomically; restore it from a backup or remove it",
            ) from None
        rollups[path.stem] = Rollup.from_json(data)
    return rollups


# --- operations -------------------------------------------------------------------------


def spool_of(layout: InstallLayout) -> Path:
    """The install's spool; raises UsageSpoolMissing when there is none."""
    spool = layout.usage_dir
    if not spool.is_dir():
        raise UsageSpoolMissing(
            f"no usage spool at {spool}",
            hint="collection is off for this install; `rootstock setup-perms` creates "
            "the spool (leave out --no-usage-spool)",
        )
    return spool


def check_month(value: str | None) -> str | None:
    """Validate a ``YYYY-MM`` option value."""
    if value is not None and not _MONTH.match(value):
        raise UsageError(f"--since takes a month as YYYY-MM, not {value!r}")
    return value


def usage_report(layout: InstallLayout, since: str | None = None) -> dict[str, Any]:
    """Rollups plus raw records not yet folded, by month, env and checkpoint.

    The returned dict is the ``--json`` shape (``REPORT_VERSION``).
    """
    check_month(since)
    spool = spool_of(layout)
    rollups = load_rollups(spool)
    records, unreadable = read_records(spool)
    folded = set().union(*(r.folded for r in rollups.values())) if rollups else set()
    tallies = tally_records(rec for name, rec in records.items() if name not in folded)
    for month, rollup in rollups.items():
        for (env, checkpoint), tally in rollup.groups.items():
            tallies.setdefault((month, env, checkpoint), Tally()).merge(tally)
    rows = []
    total = Tally()
    for (month, env, checkpoint), tally in sorted(tallies.items()):
        if since and month < since:
            continue
        rows.append(
            {
                "month": month,
                "env": env,
                "checkpoint": checkpoint,
                "users": len(tally.users),
                "sessions": tally.sessions,
                "force_calls": tally.force_calls,
            }
        )
        total.merge(tally)
    return {
        "version": REPORT_VERSION,
        "spool": str(spool),
        "since": since,
        "rows": rows,
        "totals": {
            "users": len(total.users),
            "sessions": total.sessions,
            "force_calls": total.force_calls,
        },
        "unfolded_records": sum(1 for name in records if name not in folded),
        "unreadable_records": len(unreadable),
    }


@dataclass(frozen=True)
class CompactResult:
    """What one ``usage compact`` did."""

    folded: int
    deleted: int
    undeletable: list[str]
    months: list[str]


def compact(layout: InstallLayout, lock_timeout: float | None = 60.0) -> CompactResult:
    """Fold raw records into monthly rollups, then delete the folded records.

    Order makes it crash-safe: each rollup (counts plus the names folded) is
    written atomically and fsynced before any record it names is deleted; a record
    already named is skipped, so a re-run after a kill never counts it twice.
    """
    spool = spool_of(layout)
    (spool / ROLLUPS_DIR).mkdir(mode=0o755, exist_ok=True)
    with FileLock(spool / ROLLUPS_DIR / ".compact.lock", timeout=lock_timeout, what="compact"):
        rollups = load_rollups(spool)
        records, _unreadable = read_records(spool)
        changed: set[str] = set()
        folded = 0
        for name, record in records.items():
            month = record_month(record)
            rollup = rollups.setdefault(month, Rollup(month))
            if rollup.fold(name, record):
                changed.add(month)
                folded += 1
        for month in sorted(changed):
            atomic_write_json(rollup_path(spool, month), rollups[month].to_json(), mode=0o644)
        deleted, undeletable = 0, []
        for name, record in records.items():
            if name not in rollups[record_month(record)].folded:
                continue
            try:
                (spool / name).unlink()
                deleted += 1
            except FileNotFoundError:
                pass
            except OSError:
                # Sticky spool: only the spool's owner (or root) may delete others'
                # records. They stay, named in the rollup, and are never recounted.
                undeletable.append(name)
    return CompactResult(folded, deleted, undeletable, sorted(changed))
