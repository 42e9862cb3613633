"""``rootstock prune``: carry out a confirmed plan, in the crash-safe order.

Everything runs under the root lock and the maintainer umask:

0. a journal an interrupted prune left is finished first;
1. the plan is made again under the lock, and only what is in both the confirmed
   plan and the fresh one is acted on (nothing the user did not see goes, and
   nothing that stopped being prunable meanwhile, such as a generation that a new
   build made live again);
2. one locked manifest transaction drops the records and writes the intent journal
   of the files, envs and registered sources to delete;
3. the files go, then the envs (renamed into ``.trash/``, each generation claimed
   first, then deleted): :func:`rootstock.install.prune_journal.carry_out`;
4. the garbage is collected, each generation claimed before it is renamed;
5. the journal is cleared.

A SIGKILL at any point leaves a manifest that parses and a journal the next
``prune`` (or ``sync``) finishes; everything else is found again by the next plan.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import BuildError
from rootstock.install.build import claim_stale_staging, remove_claimed, root_lock
from rootstock.install.generations import claim_generation
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import Manifest, load_manifest, update_manifest
from rootstock.install.perms import maintainer_umask
from rootstock.install.prune_journal import (
    CarriedOut,
    PruneJournal,
    carry_out,
    clear_journal,
    empty_trash,
    finish_pending_prune,
    freed_by,
    move_to_trash,
    write_journal,
)
from rootstock.install.uv import run_uv
from rootstock.ops.prune_garbage import plan_uv_cache
from rootstock.ops.prune_plan import PruneEntry, PrunePlan, files_to_delete, plan_prune

#: ``uv cache prune`` on a large shared cache walks every entry; give it time.
UV_CACHE_PRUNE_TIMEOUT_S = 1800.0
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_REMOVED = re.compile(r"Removed .*\(([\d.]+)\s*(B|KiB|MiB|GiB|TiB)\)")


@dataclass
class PruneResult:
    """What happened to one plan entry."""

    kind: str
    name: str
    env: str | None
    status: str  # "deleted", "spared" (a worker holds it), "failed" or "skipped"
    bytes: int | None = 0
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``prune --json``'s ``results`` (docs/cli.md)."""
        return {
            "kind": self.kind,
            "name": self.name,
            "env": self.env,
            "status": self.status,
            "bytes": self.bytes,
            "message": self.message,
        }


@dataclass
class PruneReport:
    """Everything one prune did."""

    plan: PrunePlan
    results: list[PruneResult] = field(default_factory=list)
    finished_journal: CarriedOut | None = None

    @property
    def ok(self) -> bool:
        """True unless a deletion failed (spared and skipped entries are fine)."""
        failed = self.finished_journal.failed if self.finished_journal else []
        return not failed and all(r.status != "failed" for r in self.results)

    @property
    def reclaimed_bytes(self) -> int:
        """What the deletions freed, the finished journal's included."""
        journal = self.finished_journal.freed_bytes if self.finished_journal else 0
        return journal + sum(r.bytes or 0 for r in self.results if r.status == "deleted")

    @property
    def dropped_records(self) -> bool:
        """True when manifest records were dropped (the dashboard should hear of it)."""
        return any(r.kind in ("env", "checkpoint") and r.status != "skipped" for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        """The ``prune --json`` document after a prune ran (docs/cli.md)."""
        journal = self.finished_journal
        return {
            "dry_run": False,
            "plan": self.plan.to_dict(),
            "results": [r.to_dict() for r in self.results],
            "finished_journal": None
            if journal is None
            else {
                "deleted": journal.deleted,
                "spared": journal.spared,
                "failed": journal.failed,
                "bytes": journal.freed_bytes,
            },
            "reclaimed_bytes": self.reclaimed_bytes,
            "ok": self.ok,
        }


def prune(
    layout: InstallLayout,
    plan: PrunePlan,
    *,
    step: Callable[[str], None] = lambda _msg: None,
    now: float | None = None,
) -> PruneReport:
    """Delete what ``plan`` lists (and is still prunable), in the crash-safe order."""
    report = PruneReport(plan)
    with maintainer_umask(), root_lock(layout):
        report.finished_journal = finish_pending_prune(layout)
        if report.finished_journal is not None:
            step("finished the journal an interrupted prune left")
        # The registered sources are listed afresh: the journal may have removed some.
        registered = plan.source is None or plan.source.kind == "registered"
        fresh = plan_prune(
            layout,
            None if registered else plan.source,
            deep=plan.deep,
            min_age_s=plan.min_age_s,
            now=time.time() if now is None else now,
            cluster=plan.cluster_arg,
        )
        confirmed = {e.key for e in plan.entries}
        if fresh.empty and any(e.kind == "uv-cache" for e in plan.entries):
            plan_uv_cache(layout, fresh)  # confirmed; only a finished journal emptied the rest
        fresh_keys = {e.key for e in fresh.entries}
        for entry in plan.entries:
            if entry.key not in fresh_keys:
                report.results.append(_result(entry, "skipped", 0, "no longer to be pruned"))
        act = [e for e in fresh.entries if e.key in confirmed]
        records = [e for e in act if e.kind in ("env", "checkpoint")]
        if records:
            step("dropping the records and writing the journal")
            journal = drop_records(layout, records)
            step("deleting the files and envs the journal lists")
            _carry_out(layout, journal, load_manifest(layout), records, report)
        for entry in act:
            if entry.kind in ("env", "checkpoint"):
                continue
            step(f"collecting {entry.kind} {entry.name}")
            report.results.append(collect(layout, entry))
        empty_trash(layout, CarriedOut())  # what a killed prune renamed and never deleted
        clear_journal(layout)
    return report


def drop_records(layout: InstallLayout, entries: list[PruneEntry]) -> PruneJournal:
    """Step 1: drop the records and write the journal, in one manifest transaction.

    The files to delete are reference-counted against the manifest as it is under
    the lock, so a checkpoint recorded since the plan keeps its files.
    """
    envs = {e.name for e in entries if e.kind == "env"}
    records = {(e.env, e.name) for e in entries if e.kind == "checkpoint" and e.env}
    registered = sorted({p for e in entries if e.kind == "env" for p in e.registered})

    def mutate(data: Manifest) -> PruneJournal:
        deleted, _shared = files_to_delete(data, records, envs)
        files = sorted({f for paths in deleted.values() for f in paths})
        for name in envs:
            data["envs"].pop(name, None)
        for env, checkpoint in records:
            with contextlib.suppress(KeyError):
                del data["envs"][env]["checkpoints"][checkpoint]
        journal = PruneJournal(files, sorted(envs), registered)
        # Written before the manifest (inside its lock): a kill between the two leaves
        # a journal whose records still exist, and carry_out spares what they name.
        write_journal(layout, journal)
        return journal

    return update_manifest(layout, mutate)


def _carry_out(
    layout: InstallLayout,
    journal: PruneJournal,
    manifest: Manifest,
    entries: list[PruneEntry],
    report: PruneReport,
) -> None:
    """Steps 2 and 3, with each entry's outcome measured around the journal's deletions."""
    owed = set(journal.files) | set(journal.registered)
    before = {
        id(e): {
            p: n
            for p, n in _sizes(layout, e).items()
            # A file a record gained since the plan stays (the transaction re-counted).
            if e.kind != "checkpoint" or p in owed
        }
        for e in entries
    }
    done = carry_out(layout, journal, manifest)
    spared = set(done.spared)
    failed = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in done.failed}
    for entry in entries:
        sizes = before[id(entry)]
        gone = {p: n for p, n in sizes.items() if not _exists(layout, entry, p)}
        kept = [p for p in sizes if p in spared]
        errors = [f"{p}: {failed[p]}" for p in sizes if p in failed]
        left = [p for p in sizes if p not in gone and p not in spared and p not in failed]
        freed = sum(gone.values())
        if errors or left:
            message = "; ".join(errors + [f"{p}: still there" for p in left])
            report.results.append(_result(entry, "failed", freed, message))
        elif kept:
            message = f"in use, kept: {', '.join(kept)} (a later prune collects it)"
            report.results.append(_result(entry, "spared", freed, message))
        else:
            report.results.append(_result(entry, "deleted", freed))


def _sizes(layout: InstallLayout, entry: PruneEntry) -> dict[str, int]:
    """What each of an entry's paths frees now (checkpoint files: under the cache root)."""
    base = layout.cache_root if entry.kind == "checkpoint" else layout.root
    return {p: freed_by(base / p) for p in entry.paths}


def _exists(layout: InstallLayout, entry: PruneEntry, relative: str) -> bool:
    base = layout.cache_root if entry.kind == "checkpoint" else layout.root
    return os.path.lexists(base / relative)


def _result(
    entry: PruneEntry, status: str, freed: int | None, message: str | None = None
) -> PruneResult:
    return PruneResult(entry.kind, entry.name, entry.env, status, freed, message)


def collect(layout: InstallLayout, entry: PruneEntry) -> PruneResult:
    """Step 4 for one garbage entry of the fresh plan; never raises for a filesystem error."""
    try:
        if entry.kind == "staging":
            return _collect_staging(layout, entry)
        if entry.kind == "generation":
            return _collect_generation(layout, entry)
        if entry.kind == "uv-cache":
            return _prune_uv_cache(layout, entry)
        if entry.kind == "unattributed":
            return _collect_files(layout, entry)
        return _collect_paths(layout, entry)  # interpreters, lockfiles
    except OSError as exc:
        return _result(entry, "failed", 0, f"{exc.filename or entry.name}: {exc.strerror or exc}")


def _collect_staging(layout: InstallLayout, entry: PruneEntry) -> PruneResult:
    freed = sum(freed_by(m) for m in entry.members)
    remove_claimed(claim_stale_staging(layout, only={entry.name.removeprefix(".build/")}))
    left = [m.name for m in entry.members if os.path.lexists(m)]
    if left:
        return _result(entry, "failed", 0, f"still there: {', '.join(left)}")
    return _result(entry, "deleted", freed)


def _collect_generation(layout: InstallLayout, entry: PruneEntry) -> PruneResult:
    generation = entry.members[0]
    with claim_generation(generation) as claimed:
        if claimed is False:
            return _result(entry, "spared", 0, "in use: a worker runs from it")
        freed = freed_by(generation)
        # Renamed while claimed: no worker can start from it once it is in the trash.
        trashed = move_to_trash(layout, generation)
    return _remove(entry, trashed, freed)


def _collect_paths(layout: InstallLayout, entry: PruneEntry) -> PruneResult:
    freed = 0
    for path in entry.members:
        freed += freed_by(path)
        if path.is_dir() and not path.is_symlink():
            result = _remove(entry, move_to_trash(layout, path), 0)
            if result.status == "failed":
                return result
        else:
            path.unlink(missing_ok=True)
    return _result(entry, "deleted", freed)


def _remove(entry: PruneEntry, path: Path, freed: int) -> PruneResult:
    try:
        shutil.rmtree(path)
    except OSError as exc:
        return _result(entry, "failed", 0, f"{exc.filename or path}: {exc.strerror or exc}")
    return _result(entry, "deleted", freed)


def _collect_files(layout: InstallLayout, entry: PruneEntry) -> PruneResult:
    """``--deep``: the fresh plan's unattributed files, then the directories they leave empty."""
    freed, errors = 0, []
    for path in entry.members:
        size = freed_by(path)
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror or exc}")
            continue
        freed += size
    top = layout.cache_root / entry.name
    if top.is_dir() and not top.is_symlink():
        for dirpath, _dirs, _files in sorted(os.walk(top), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)  # only empty ones go; cache/ and home/ themselves stay
    if errors:
        return _result(entry, "failed", freed, "; ".join(errors[:5]))
    return _result(entry, "deleted", freed)


def _prune_uv_cache(layout: InstallLayout, entry: PruneEntry) -> PruneResult:
    """``uv cache prune`` through :func:`run_uv`; the bytes are what uv says it removed."""
    try:
        output = run_uv(
            layout,
            ["cache", "prune"],
            what="pruning its cache",
            timeout=UV_CACHE_PRUNE_TIMEOUT_S,
        )
    except BuildError as exc:
        return _result(entry, "failed", 0, exc.message)
    return _result(entry, "deleted", uv_removed_bytes(output), _last_line(output))


def uv_removed_bytes(output: str) -> int:
    """The bytes of uv's ``Removed N files (1.5MiB)`` line; 0 when it removed nothing."""
    match = _REMOVED.search(output)
    if match is None:
        return 0
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _last_line(output: str) -> str | None:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else None
