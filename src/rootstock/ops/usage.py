"""``rootstock usage report | compact``: aggregate the usage spool (``usage push`` sends
the report's counts: :func:`rootstock.ops.push.push_usage`).

A monthly rollup (:mod:`rootstock.install.usage_rollups`) stores, per (env,
checkpoint), the sessions, the force calls and the *set* of user ids, and of the
raw records folded into it a count, a digest, and the names of those that may
still be on disk (``pending``): a record is deleted only after the rollup naming
it is on disk, and a record named there is never counted again. A ``compact``
killed at any point therefore leaves a state from which a re-run (or ``report``)
gives the same totals. Schema 1 rollups (every folded name listed) are read and
rewritten as schema 2 by the next compact.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import RootstockError, UsageError
from rootstock.install.atomic import atomic_write_json
from rootstock.install.layout import InstallLayout
from rootstock.install.locking import FileLock
from rootstock.install.usage import (
    ROLLUPS_DIR,
    expire_torn_records,
    read_records,
    record_month,
)
from rootstock.install.usage_rollups import (
    MONTH,
    ROLLUP_VERSION,
    Rollup,
    Tally,
    UsageRollupError,
    check_rollups_dir,
    load_rollups,
    name_digest,
    rollup_path,
)

# Re-exported: the rollup model is rootstock.install.usage_rollups.
__all__ = [
    "ROLLUP_VERSION",
    "CompactResult",
    "Rollup",
    "Tally",
    "UsageRollupError",
    "UsageSpoolMissing",
    "check_month",
    "compact",
    "load_rollups",
    "name_digest",
    "pending_names",
    "spool_of",
    "tally_records",
    "usage_report",
]

OLD_SALT_NAME = ".salt"  # written by rootstock before random user ids; compact deletes it
REPORT_VERSION = 1

Key = tuple[str, str, str]  # (month, env, checkpoint)


class UsageSpoolMissing(RootstockError):
    """The install has no usage spool (collection is off, or the path is wrong)."""


def tally_records(records: Iterable[dict[str, Any]]) -> dict[Key, Tally]:
    """Group raw records by (month, env, checkpoint)."""
    tallies: dict[Key, Tally] = {}
    for record in records:
        key = (record_month(record), str(record["env"]), str(record["checkpoint"]))
        tallies.setdefault(key, Tally()).add_record(record)
    return tallies


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
    if value is not None and not MONTH.match(value):
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
    folded = pending_names(rollups)
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
        "rollup_entries_out_of_bounds": sum(len(r.repairs) for r in rollups.values()),
    }


def pending_names(rollups: dict[str, Rollup]) -> set[str]:
    """Names of folded records that may still be on disk: never to be counted again."""
    return set().union(*(r.pending for r in rollups.values())) if rollups else set()


@dataclass(frozen=True)
class CompactResult:
    """What one ``usage compact`` did.

    ``torn_removed`` and ``torn_kept`` count the unreadable records deleted for
    being over 7 days old and those kept (younger, or not ours to delete).
    ``repaired`` says, by month, what was dropped from or capped in a rollup that
    held entries the dashboard refuses (:meth:`Rollup.bound`). ``salt_removed`` is
    True when compact deleted the salt older rootstocks hashed account names with.
    """

    folded: int
    deleted: int
    undeletable: list[str]
    months: list[str]
    torn_removed: int = 0
    torn_kept: int = 0
    repaired: dict[str, list[str]] = field(default_factory=dict)
    salt_removed: bool = False


def _delete_record(path: Path) -> None:
    """Delete one folded record (a seam: tests make it fail to stage a crash)."""
    path.unlink()


def compact(layout: InstallLayout, lock_timeout: float | None = 60.0) -> CompactResult:
    """Fold raw records into monthly rollups, then delete the folded records.

    The order makes it crash-safe:

    1. every rollup that gained records is written (atomically, fsynced) with its
       counts and, in ``pending``, the names of the records just folded;
    2. then the records named in any ``pending`` are deleted;
    3. then those rollups are written again with ``pending`` emptied of what was
       deleted (an undeletable record stays named).

    A record named in ``pending`` is never counted again, so a compact killed
    after step 1 and re-run (or a ``report`` in between) gives the same totals.
    A bad rollup raises :class:`UsageRollupError` before anything is written.
    """
    spool = spool_of(layout)
    if not check_rollups_dir(spool):
        with contextlib.suppress(FileExistsError):  # made since: checked next
            (spool / ROLLUPS_DIR).mkdir(mode=0o755)
        check_rollups_dir(spool)
    with FileLock(spool / ROLLUPS_DIR / ".compact.lock", timeout=lock_timeout, what="compact"):
        rollups = load_rollups(spool)
        records, unreadable = read_records(spool)
        already = pending_names(rollups)
        changed: set[str] = set()
        folded = 0
        for name, record in records.items():
            if name in already:
                continue
            month = record_month(record)
            if rollups.setdefault(month, Rollup(month)).fold(name, record):
                changed.add(month)
                folded += 1
        for month in sorted(changed):
            _write_rollup(spool, rollups[month])
        deleted, undeletable = 0, []
        settled = {m for m, rollup in rollups.items() if rollup.migrated or rollup.repairs}
        for month, rollup in sorted(rollups.items()):
            still: set[str] = set()
            for name in sorted(rollup.pending):
                try:
                    _delete_record(spool / name)
                    deleted += 1
                except FileNotFoundError:
                    pass
                except OSError:
                    # Sticky spool: only the spool's owner (or root) may delete others'
                    # records. They stay, named in pending, and are never recounted.
                    undeletable.append(name)
                    still.add(name)
            if still != rollup.pending:
                rollup.pending = still
                settled.add(month)
        for month in sorted(settled):
            _write_rollup(spool, rollups[month])
        torn = expire_torn_records(spool, unreadable)
        salt_removed = _remove_old_salt(spool)
    repaired = {month: r.repairs for month, r in sorted(rollups.items()) if r.repairs}
    return CompactResult(
        folded,
        deleted,
        undeletable,
        sorted(changed),
        len(torn.removed),
        len(torn.kept),
        repaired,
        salt_removed,
    )


def _remove_old_salt(spool: Path) -> bool:
    """Delete ``{spool}/.salt``, which older rootstocks hashed account names with.

    Records now carry a random id (:mod:`rootstock.install.usage_id`), so nothing
    needs the salt, and anyone who can read it can recompute the old records'
    hashes from account names. Only the spool's owner (or root) may delete it.
    """
    try:
        os.unlink(spool / OLD_SALT_NAME)
    except OSError:
        return False
    return True


def _write_rollup(spool: Path, rollup: Rollup) -> None:
    atomic_write_json(rollup_path(spool, rollup.month), rollup.to_json(), mode=0o644)
