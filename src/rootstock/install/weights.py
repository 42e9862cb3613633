"""The weight files of a checkpoint: hashed at ``add``, re-checked before verification.

``add`` records each regular file it attributes to a checkpoint (the record's
``files``) with its size, sha256 and mtime (:func:`weigh_files`); hashing reads the
file once, in 1 MiB chunks, at disk speed. Verification (``smoke-test``, ``sync``)
re-checks them first (:func:`check_weights`): by default it compares size and mtime
and re-hashes only a file whose size or mtime changed; ``rehash`` hashes every file.
A file whose size or sha256 differs, or that is gone, is a :class:`WeightChange`.

A worker start only compares size and mtime, and when they differ it leaves a
marker (``{root}/.reverify/``, named by :meth:`InstallLayout.reverify_marker`) so the
next ``smoke-test`` or ``sync`` re-hashes that checkpoint in full; the runtime writes
it, and :func:`marked_for_reverification` reads what it wrote. Anyone who can write
the directory may leave a marker, so a marker is only a request to re-check: what it
says beyond its env and checkpoint is never trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import WeightFile
from rootstock.install.parsing import ParseProblem, loads_json, read_regular_file

CHUNK_BYTES = 1 << 20
# Larger than any marker the runtime writes (an env, an id and a few paths).
MARKER_MAX_BYTES = 64 * 1024
_HASH_SHOWN = 16


@dataclass(frozen=True)
class WeightChange:
    """One recorded weight file that is no longer what ``add`` recorded.

    ``size`` and ``sha256`` are what the file holds now (both None when it is gone;
    ``sha256`` None too when only the size was compared).
    """

    path: str
    recorded: WeightFile
    size: int | None
    sha256: str | None


@dataclass
class WeightCheck:
    """What :func:`check_weights` found.

    ``changed`` lists the files that differ; ``refreshed`` the files whose mtime moved
    but whose size and sha256 are as recorded (their entries with the new mtime, for
    the caller to record so the next check is a stat again); ``hashed`` counts the
    files read in full.
    """

    changed: list[WeightChange] = field(default_factory=list)
    refreshed: dict[str, WeightFile] = field(default_factory=dict)
    hashed: int = 0

    @property
    def ok(self) -> bool:
        """True when every recorded file is as recorded."""
        return not self.changed


def hash_file(path: Path | str) -> WeightFile:
    """Size, sha256 and mtime of the regular file ``path``, read in 1 MiB chunks.

    The size and mtime are those of the open file before it is read. Raises OSError
    (``IsADirectoryError`` and the like for what is not a regular file).
    """
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        buffer = bytearray(CHUNK_BYTES)
        view = memoryview(buffer)
        while True:
            count = handle.readinto(buffer)
            if not count:
                break
            digest.update(view[:count])
    return {"size": info.st_size, "sha256": digest.hexdigest(), "mtime": info.st_mtime}


def is_weight_file(relative: str, info: os.stat_result) -> bool:
    """Whether a listed file is recorded with a hash: a non-empty regular file that is
    not a download's lock file (``*.lock``, which the hub may delete or rewrite)."""
    return stat.S_ISREG(info.st_mode) and info.st_size > 0 and not relative.endswith(".lock")


def weigh_files(cache_root: Path, files: Iterable[str]) -> tuple[dict[str, WeightFile], list[str]]:
    """Hash each weight file among ``files`` (relative to ``cache_root``).

    Returns the entries and the listed paths that are gone. Symlinks are not hashed
    (their targets in the cache root are listed and hashed themselves), nor are empty
    files, lock files and what cannot be read.
    """
    weights: dict[str, WeightFile] = {}
    gone: list[str] = []
    for relative in files:
        path = cache_root / relative
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            gone.append(relative)
            continue
        except OSError:
            continue
        if not is_weight_file(relative, info):
            continue
        try:
            weights[relative] = hash_file(path)
        except OSError:
            continue
    return weights, gone


def check_weights(
    cache_root: Path, recorded: Mapping[str, WeightFile], *, rehash: bool = False
) -> WeightCheck:
    """Compare each recorded file with the disk; ``rehash`` hashes every one.

    Without ``rehash`` a file whose size and mtime are as recorded is taken as
    unchanged (a stat only); one whose mtime moved is hashed, and counts as changed
    only if its size or sha256 differs.
    """
    check = WeightCheck()
    for relative in sorted(recorded):
        entry = recorded[relative]
        path = cache_root / relative
        try:
            info = os.stat(path)
        except OSError:
            check.changed.append(WeightChange(relative, entry, None, None))
            continue
        if not rehash and info.st_size == entry["size"] and info.st_mtime == entry["mtime"]:
            continue
        try:
            now = hash_file(path)
        except OSError:
            check.changed.append(WeightChange(relative, entry, None, None))
            continue
        check.hashed += 1
        if now["size"] != entry["size"] or now["sha256"] != entry["sha256"]:
            check.changed.append(WeightChange(relative, entry, now["size"], now["sha256"]))
        elif now["mtime"] != entry["mtime"]:
            check.refreshed[relative] = now
    return check


def human_size(size: int | None) -> str:
    """``11 MB``, ``1.2 GB``, ``512 B`` (decimal units); ``?`` for None."""
    if size is None:
        return "?"
    value = float(size)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")  # pragma: no cover


def _short(digest: str | None) -> str:
    return "?" if digest is None else f"{digest[:_HASH_SHOWN]}…"


def describe_change(checkpoint: str, changes: list[WeightChange]) -> str:
    """The one-line reason a checkpoint is ``tampered``: the first changed file, both
    hashes and sizes, how many more, and how to accept the new files."""
    first = changes[0]
    recorded = first.recorded
    if first.size is None:
        what = (
            f"{first.path} is gone or unreadable "
            f"(sha256 {_short(recorded['sha256'])}, size {human_size(recorded['size'])})"
        )
    else:
        what = (
            f"{first.path} sha256 {_short(recorded['sha256'])} ≠ {_short(first.sha256)} "
            f"(size {human_size(recorded['size'])} → {human_size(first.size)})"
        )
    more = f" and {len(changes) - 1} more file(s)" if len(changes) > 1 else ""
    return (
        f"weights of {checkpoint} changed since add: {what}{more}; "
        f"re-run rootstock add {checkpoint} to accept the new file"
    )


def stat_mismatches(cache_root: Path, recorded: Mapping[str, WeightFile]) -> list[str]:
    """The recorded files whose size or mtime differ now (or that are gone): stat only."""
    mismatched = []
    for relative, entry in sorted(recorded.items()):
        try:
            info = os.stat(cache_root / relative)
        except OSError:
            mismatched.append(relative)
            continue
        if info.st_size != entry["size"] or info.st_mtime != entry["mtime"]:
            mismatched.append(relative)
    return mismatched


def marked_for_reverification(layout: InstallLayout, env_name: str, checkpoint: str) -> bool:
    """True when a worker start left a marker for this checkpoint (its own, by name and
    content); an unreadable or foreign file in the marker's place counts as none."""
    path = layout.reverify_marker(env_name, checkpoint)
    try:
        raw = read_regular_file(path, MARKER_MAX_BYTES)
        data = loads_json(raw)
    except (OSError, ParseProblem, ValueError):
        return False
    return (
        isinstance(data, dict)
        and data.get("env") == env_name
        and data.get("checkpoint") == checkpoint
    )


def clear_reverification_mark(layout: InstallLayout, env_name: str, checkpoint: str) -> None:
    """Remove the checkpoint's marker once it has been re-checked (best effort)."""
    with contextlib.suppress(OSError):
        layout.reverify_marker(env_name, checkpoint).unlink()
