"""Reading and writing ``{root}/manifest.json``.

Reads take no lock: every write renames a complete temp file into place, so a
reader sees the old file or the new one. Every write is a short read-modify-write
under ``{root}/.locks/manifest.lock`` (:class:`~rootstock.install.locking.FileLock`:
POSIX record locks, with an ``mkdir`` fallback where the filesystem refuses them),
so concurrent writers never lose each other's updates.

Because a write renames a new file into place, a ``manifest.json`` that is a
symbolic link would be replaced by a plain file, and the link's target would
silently stop getting updates. Every write refuses a link instead of writing
through it: the lock guards this root's writers only, so a write through the
link could race the writers of whatever else shares the target.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from rootstock.errors import ManifestError, UnstorableValue
from rootstock.install.atomic import atomic_write_bytes
from rootstock.install.clusters import sibling_names
from rootstock.install.layout import InstallLayout
from rootstock.install.locking import FileLock
from rootstock.install.manifest.parse import parse_manifest_text
from rootstock.install.manifest.schema import (
    FIX_HINT,
    MANIFEST_VERSION,
    Manifest,
    new_manifest,
    unique,
    utc_now,
)
from rootstock.install.manifest.validate import SchemaProblem, check_manifest
from rootstock.install.parsing import ParseProblem, read_regular_file
from rootstock.names import cluster_name

LOCK_NAME = "manifest.lock"
DEFAULT_LOCK_TIMEOUT = 60.0
ORPHAN_AGE_S = 300.0

T = TypeVar("T")


def manifest_lock_path(layout: InstallLayout) -> Path:
    """The lock file every manifest writer takes (``{root}/.locks/manifest.lock``)."""
    return layout.locks_dir / LOCK_NAME


def load_manifest(layout: InstallLayout) -> Manifest:
    """Read, migrate and check the manifest; an absent file gives a fresh one (not written).

    Raises :class:`ManifestError` for a corrupt file or a newer schema.
    """
    data, _ = _read(layout.manifest_file)
    return data


def _read(path: Path) -> tuple[Manifest, bytes | None]:
    """Return (manifest, the bytes it was parsed from); None bytes when absent.

    Only a regular file is read (a FIFO would block every reader); it has no size
    cap, since a large install's manifest is megabytes.
    """
    try:
        raw = read_regular_file(path, None)
    except FileNotFoundError:
        return new_manifest(), None
    except OSError as exc:
        raise ManifestError(
            f"cannot read {path}: {exc.strerror or exc}",
            hint="check the permissions of the install root (rootstock setup-perms)",
        ) from None
    except ParseProblem as exc:
        raise ManifestError(f"cannot read {path}: {exc}", hint=FIX_HINT) from None
    data, _ = parse_manifest_text(raw, path)
    return data, raw


def update_manifest(
    layout: InstallLayout,
    mutate: Callable[[Manifest], T],
    timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> T:
    """Run ``mutate(manifest)`` in a locked read-modify-write and return its result.

    ``mutate`` edits the dict in place. It must be quick and do no I/O of its own: the
    lock is held while it runs. If it raises, nothing is written. A refused (corrupt
    or newer) manifest raises :class:`ManifestError` before ``mutate`` runs. An
    absent manifest is created; when nothing changed, the file is not rewritten. A
    manifest that is a symbolic link raises :class:`ManifestError` (see the module
    docstring). Raises :class:`~rootstock.errors.LockTimeout` after ``timeout``
    seconds of waiting.
    """
    path = layout.manifest_file
    with FileLock(manifest_lock_path(layout), timeout, "manifest lock", private=True):
        refuse_linked_manifest(path)
        _remove_orphaned_temp_files(path)
        data, raw = _read(path)
        result = mutate(data)
        # Never write what a read would refuse: the change is checked like a read.
        _refuse_unreadable(data, path)
        if raw is None or serialize_manifest(data, path) != raw:
            from rootstock.version import __version__

            data["schema_version"] = MANIFEST_VERSION
            data["updated_at"] = utc_now()
            data["written_by"] = f"rootstock {__version__}"
            atomic_write_bytes(path, serialize_manifest(data, path))
    return result


def serialize_manifest(data: Manifest, path: Path | str = "manifest.json") -> bytes:
    """The bytes written to disk: key-sorted, compact, standard JSON and a newline.

    Compact because an indented dump runs in pure Python and is five times slower
    on a large install; ``rootstock manifest show --json`` pretty-prints. NaN and
    infinities (which Python's ``json`` would write, and no reader accepts) raise
    :class:`~rootstock.errors.UnstorableValue`, as does a value JSON has no type for.
    """
    try:
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError) as exc:
        raise UnstorableValue(f"refusing to write {path}: {exc}", hint=UNSTORABLE_HINT) from None
    return text.encode("utf-8") + b"\n"


UNSTORABLE_HINT = "nothing was written: the manifest is as it was"


def refuse_linked_manifest(path: Path) -> None:
    """Raise :class:`ManifestError` if ``path`` is a symbolic link (a write would replace it)."""
    if not path.is_symlink():
        return
    target = Path(os.path.realpath(path))
    if target.exists():
        hint = (
            f"replace the link by the file it points to: "
            f"cp --remove-destination {target} {path} (nothing was written)"
        )
    else:
        hint = f"replace the link by the file; it points to {target}, which does not exist"
    raise ManifestError(
        f"{path} is a symbolic link to {target}: writing it would replace the link by a "
        "plain file and leave the target behind, out of date",
        hint=hint,
    )


def _refuse_unreadable(data: Manifest, path: Path) -> None:
    try:
        check_manifest(data)
    except SchemaProblem as exc:
        raise UnstorableValue(f"refusing to write {path}: {exc}", hint=UNSTORABLE_HINT) from None


def _remove_orphaned_temp_files(path: Path) -> None:
    # A writer holds the lock for the milliseconds its temp file exists, so a temp
    # file that is minutes old belongs to a writer killed mid-write. The age test
    # (rather than trusting the lock alone) keeps a sweep from ever deleting the
    # file of a live writer that is somehow outside our lock.
    prefix = f".{path.name}.tmp-"
    try:
        names = [n for n in os.listdir(path.parent) if n.startswith(prefix)]
    except OSError:
        return
    cutoff = time.time() - ORPHAN_AGE_S
    for name in names:
        # A file another user owns may not be ours to delete; it is harmless litter.
        with contextlib.suppress(OSError):
            orphan = path.parent / name
            if orphan.stat().st_mtime < cutoff:
                orphan.unlink()


@dataclass(frozen=True)
class ManifestInit:
    """What :func:`ensure_manifest` did."""

    created: bool
    clusters: list[str]
    backup: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "created": self.created,
            "clusters": list(self.clusters),
            "backup": str(self.backup) if self.backup else None,
        }


def ensure_manifest(
    layout: InstallLayout,
    clusters: Iterable[str],
    force: bool = False,
    timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> ManifestInit:
    """``manifest init``: make sure the manifest exists and serves ``clusters``.

    Registry siblings of the root are added too. An existing manifest keeps all its
    state and only gains missing clusters. ``force`` replaces it with a fresh one;
    the old bytes are first saved as ``manifest.json.bak-<time>`` (this is the one
    way to get past a corrupt or newer-schema file).
    """
    wanted = unique([*(cluster_name(c) for c in clusters), *sibling_names(layout.root)])
    path = layout.manifest_file
    if not force:
        existed = path.exists()

        def add_clusters(data: Manifest) -> list[str]:
            data["clusters"] = unique([*data["clusters"], *wanted])
            return list(data["clusters"])

        served = update_manifest(layout, add_clusters, timeout)
        return ManifestInit(created=not existed, clusters=served)
    with FileLock(manifest_lock_path(layout), timeout, "manifest lock", private=True):
        refuse_linked_manifest(path)
        backup = None
        try:
            old: bytes | None = read_regular_file(path, None)
        except (FileNotFoundError, ParseProblem):  # absent, or no file to keep (a FIFO)
            old = None
        if old is not None:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
            backup = path.with_name(f"{path.name}.bak-{stamp}")
            atomic_write_bytes(backup, old)
        from rootstock.version import __version__

        data = new_manifest(wanted)
        data["updated_at"] = data["created_at"]
        data["written_by"] = f"rootstock {__version__}"
        atomic_write_bytes(path, serialize_manifest(data))
    return ManifestInit(created=True, clusters=wanted, backup=backup)
