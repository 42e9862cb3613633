"""``prune``'s intent journal: what a prune decided to delete, until it is deleted.

A prune drops manifest records and writes this journal in *one* locked manifest
transaction (:func:`write_journal` is called inside ``update_manifest``'s mutate,
while the manifest lock is held), then deletes what the journal lists, and clears
it last. A prune killed at any moment leaves a valid manifest and a journal of the
deletions still owed; the next ``prune`` or ``sync`` carries them out first
(:func:`finish_pending_prune`). Carrying a journal out is idempotent: what is
already gone is skipped. It is also checked against the manifest it finds: the
journal is written just before the manifest inside that transaction, so a prune
killed between the two leaves a journal whose records are still there, and nothing
a surviving record names (an env, a checkpoint's files) is deleted.

Every path in the journal is relative (files to the cache root, envs and registered
sources to the install root) and is checked to stay inside its base on both write
and read, so a tampered journal cannot delete anything outside the install.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import stat
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from rootstock.errors import ManifestError
from rootstock.install.atomic import atomic_write_json
from rootstock.install.generations import claim_generation
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest.types import Manifest
from rootstock.install.parsing import loads_json

JOURNAL_VERSION = 1


@dataclass
class PruneJournal:
    """What one prune still has to delete.

    ``files``: cache files (relative to the cache root) no surviving checkpoint uses.
    ``envs``: env names whose ``envs/<name>`` link and generations go.
    ``registered``: files under the root (``environments/<n>.py``, its lockfile).
    """

    files: list[str] = field(default_factory=list)
    envs: list[str] = field(default_factory=list)
    registered: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.files or self.envs or self.registered)

    def to_dict(self) -> dict[str, Any]:
        return {
            "journal_version": JOURNAL_VERSION,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "files": sorted(self.files),
            "envs": sorted(self.envs),
            "registered": sorted(self.registered),
        }


@dataclass
class CarriedOut:
    """What carrying out a journal did."""

    deleted: list[str] = field(default_factory=list)
    spared: list[str] = field(default_factory=list)  # generations a worker still uses
    failed: list[str] = field(default_factory=list)  # "path: why" for what could not go
    freed_bytes: int = 0


def safe_relative(text: object) -> str | None:
    """``text`` as a clean relative POSIX path inside its base, or None if it is not one."""
    if not isinstance(text, str) or not text or "\0" in text or text.startswith("/"):
        return None
    parts = PurePosixPath(text).parts
    if any(part in ("..", ".") for part in parts) or not parts:
        return None
    return str(PurePosixPath(*parts))


def _env_name_ok(name: object) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and not name.startswith(".")


def write_journal(layout: InstallLayout, journal: PruneJournal) -> None:
    """Write the journal (call it inside the manifest transaction that drops the records)."""
    bad = [p for p in [*journal.files, *journal.registered] if safe_relative(p) != p]
    bad += [n for n in journal.envs if not _env_name_ok(n)]
    if bad:
        raise ValueError(f"not a clean relative path or env name: {bad}")
    atomic_write_json(layout.prune_journal, journal.to_dict(), mode=0o664)


def read_journal(layout: InstallLayout) -> PruneJournal | None:
    """The pending journal, or None. A journal that cannot be trusted is refused."""
    path = layout.prune_journal
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc}") from None
    try:
        data = loads_json(raw)
    except ValueError as exc:
        raise ManifestError(
            f"{path} is not valid JSON ({exc})",
            hint=f"it lists deletions an interrupted prune still owes; move it aside "
            f"(mv {path} {path}.bad) and run `rootstock prune --dry-run` to see what is left",
        ) from None
    if not isinstance(data, dict) or data.get("journal_version") != JOURNAL_VERSION:
        raise ManifestError(
            f"{path} is not a prune journal this rootstock reads",
            hint="it was written by another rootstock version; finish it with that version, "
            "or move it aside and run `rootstock prune --dry-run`",
        )
    lists = {key: data.get(key) for key in ("files", "envs", "registered")}
    for key, value in lists.items():
        if not isinstance(value, list):
            raise ManifestError(f"{path}: {key!r} is not a list")
    files, envs, registered = lists["files"], lists["envs"], lists["registered"]
    assert isinstance(files, list) and isinstance(envs, list) and isinstance(registered, list)
    unsafe = [p for p in [*files, *registered] if safe_relative(p) != p]
    unsafe += [n for n in envs if not _env_name_ok(n)]
    if unsafe:
        raise ManifestError(
            f"{path} names paths outside the install: {unsafe[:3]}",
            hint=f"do not carry it out: move it aside (mv {path} {path}.bad), "
            "then find out who wrote it",
        )
    return PruneJournal(list(files), list(envs), list(registered))


def clear_journal(layout: InstallLayout) -> None:
    layout.prune_journal.unlink(missing_ok=True)


def freed_by(path: Path) -> int:
    """Bytes deleting ``path`` frees: files with other hard links (uv's cache) do not count."""
    total = 0
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_blocks * 512 if st.st_nlink <= 1 else 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                entry = os.lstat(os.path.join(dirpath, name))
                if entry.st_nlink <= 1:
                    total += entry.st_blocks * 512
    return total


def env_generations(layout: InstallLayout, name: str) -> list[Path]:
    """Every generation directory of env ``name`` (``envs/.<name>.<build-id>``)."""
    try:
        entries = list(layout.envs_dir.iterdir())
    except OSError:
        return []
    prefix = f".{name}."
    # A build id has no dot: ``.a.b.<id>`` is a generation of env ``a.b``, not of ``a``.
    return sorted(
        e
        for e in entries
        if e.name.startswith(prefix)
        and "." not in e.name[len(prefix) :]
        and not e.name.startswith(f"{prefix}link-")
        and e.is_dir()
        and not e.is_symlink()
    )


def move_to_trash(layout: InstallLayout, path: Path) -> Path:
    """Rename ``path`` into ``{root}/.trash/`` (same filesystem: one atomic rename)."""
    layout.trash_dir.mkdir(mode=0o775, exist_ok=True)
    target = layout.trash_dir / f"{path.name.lstrip('.')}.{secrets.token_hex(4)}"
    os.replace(path, target)
    return target


def empty_trash(layout: InstallLayout, done: CarriedOut) -> None:
    """Delete what an earlier step (or a killed prune) renamed into ``.trash/``."""
    try:
        entries = list(layout.trash_dir.iterdir())
    except OSError:
        return
    for entry in entries:
        done.freed_bytes += freed_by(entry)
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink(missing_ok=True)
        except OSError as exc:
            done.failed.append(f".trash/{entry.name}: {exc.strerror or exc}")


def still_recorded(manifest: Manifest) -> tuple[set[str], set[str]]:
    """The env names and cache files (relative) that ``manifest``'s records name."""
    envs = manifest.get("envs", {})
    files = {
        f
        for env in envs.values()
        for entry in (env.get("checkpoints") or {}).values()
        for f in (entry.get("files") or [])
    }
    return set(envs), files


def carry_out(layout: InstallLayout, journal: PruneJournal, manifest: Manifest) -> CarriedOut:
    """Delete what ``journal`` lists, in the crash-safe order (docs/cli.md, ``prune``).

    Files first, then each env: its link goes, each generation no worker holds is
    renamed into ``.trash/``, then the trash is emptied. A generation a worker still
    runs from is spared and reported (a later prune collects it as garbage). What
    ``manifest`` (read after the journal was written) still records is never deleted.
    """
    done = CarriedOut()
    kept_envs, kept_files = still_recorded(manifest)
    journal = PruneJournal(
        [f for f in journal.files if f not in kept_files],
        [n for n in journal.envs if n not in kept_envs],
        [r for r in journal.registered if _registered_env(r) not in kept_envs],
    )
    for relative in journal.files:
        _unlink(layout.cache_root / relative, relative, done)
        _remove_empty_parents(layout, layout.cache_root / relative)
    for relative in journal.registered:
        _unlink(layout.root / relative, relative, done)
    for name in journal.envs:
        link = layout.env_dir(name)
        if link.is_symlink():
            _unlink(link, f"envs/{name}", done)
        for generation in env_generations(layout, name):
            with claim_generation(generation) as claimed:
                if claimed is False:
                    done.spared.append(f"envs/{generation.name}")
                    continue
                try:
                    move_to_trash(layout, generation)
                except OSError as exc:
                    done.failed.append(f"envs/{generation.name}: {exc.strerror or exc}")
                    continue
                done.deleted.append(f"envs/{generation.name}")
    empty_trash(layout, done)
    return done


def _unlink(path: Path, relative: str, done: CarriedOut) -> None:
    """Delete one file; what is gone already (or is a directory) is skipped."""
    freed = freed_by(path)
    try:
        path.unlink()
    except (FileNotFoundError, IsADirectoryError):
        return
    except OSError as exc:
        done.failed.append(f"{relative}: {exc.strerror or exc}")
        return
    done.freed_bytes += freed
    done.deleted.append(relative)


def _registered_env(relative: str) -> str:
    """The env a registered file (``environments/<n>.py`` or ``<n>.py.lock``) belongs to."""
    return PurePosixPath(relative).name.removesuffix(".lock").removesuffix(".py")


def _remove_empty_parents(layout: InstallLayout, path: Path) -> None:
    """Remove the directories a deleted file leaves empty, up to ``cache/`` or ``home/``."""
    tops = (layout.cache_dir, layout.home_dir)
    parent = path.parent
    while parent not in tops and any(parent.is_relative_to(top) for top in tops):
        try:
            parent.rmdir()  # only ever an empty one
        except OSError:
            return
        parent = parent.parent


def finish_pending_prune(layout: InstallLayout) -> CarriedOut | None:
    """Carry out and clear a journal an interrupted prune left; None if there is none.

    Call it under the root lock, like a prune's own deletions.
    """
    from rootstock.install.manifest import load_manifest

    journal = read_journal(layout)
    if journal is None:
        return None
    done = carry_out(layout, journal, load_manifest(layout))
    clear_journal(layout)
    return done
