"""What a ``rootstock prune`` plan is made of: its entries, the plan itself, and the
rules both of its planners share (:mod:`rootstock.ops.prune_plan` for what SOURCE
no longer declares, :mod:`rootstock.ops.prune_garbage` for the garbage).

It reads nothing and deletes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from rootstock.install.layout import InstallLayout

#: Entry kinds, in the order the plan lists them.
ENTRY_KINDS = (
    "env",
    "checkpoint",
    "staging",
    "generation",
    "interpreter",
    "lockfile",
    "unattributed",
    "uv-cache",
)
GARBAGE_KINDS = frozenset(ENTRY_KINDS[2:])


class DeclaredSource(Protocol):
    """What the planner needs of an opened SOURCE (:class:`rootstock.ops.sources.EnvSource`)."""

    @property
    def label(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def files(self) -> list[Path]: ...


@dataclass
class PruneEntry:
    """One thing the plan deletes (or, in ``kept``, reports and leaves).

    ``name`` is an env name, a checkpoint id, or a path relative to the root
    (``cache/...`` and ``home/...`` for unattributed content, relative to the cache
    root). ``paths`` are what goes; for a checkpoint, its files (relative to the
    cache root). ``bytes`` is None where it is known only afterwards (uv's cache).
    """

    kind: str
    name: str
    reason: str
    bytes: int | None = 0
    paths: list[str] = field(default_factory=list)
    env: str | None = None
    shared: list[str] = field(default_factory=list)  # a checkpoint's files that stay
    count: int | None = None  # unattributed: how many files
    registered: list[str] = field(default_factory=list)  # an env's files in environments/
    members: list[Path] = field(default_factory=list, repr=False)  # what execution deletes

    @property
    def key(self) -> tuple[str, str | None, str]:
        """What identifies the entry between the confirmed plan and the fresh one."""
        return (self.kind, self.env, self.name)

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``prune --json``'s ``entries`` or ``kept`` (docs/cli.md)."""
        return {
            "kind": self.kind,
            "name": self.name,
            "env": self.env,
            "reason": self.reason,
            "bytes": self.bytes,
            "paths": list(self.paths),
            "shared": list(self.shared),
            "count": self.count,
        }


@dataclass
class Unattributed:
    """Content under ``cache/`` and ``home/`` that no checkpoint record lists."""

    files: int = 0
    bytes: int = 0
    young: int = 0  # of them, younger than --min-age
    dirs: dict[str, list[int]] = field(default_factory=dict)  # top dir -> [files, bytes]

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "bytes": self.bytes,
            "young_files": self.young,
            "dirs": [
                {"path": top, "files": n, "bytes": size}
                for top, (n, size) in sorted(self.dirs.items())
            ],
        }


@dataclass
class PrunePlan:
    """What one prune would delete, what it keeps, and why."""

    root: Path
    cache_root: Path
    cluster: str | None
    source: DeclaredSource | None
    deep: bool
    min_age_s: float
    cluster_arg: str | None = None
    entries: list[PruneEntry] = field(default_factory=list)
    kept: list[PruneEntry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unattributed: Unattributed = field(default_factory=Unattributed)
    pending_journal: bool = False

    @property
    def bytes(self) -> int:
        """What the entries free, as far as it is known before deleting."""
        return sum(e.bytes or 0 for e in self.entries)

    @property
    def empty(self) -> bool:
        """Nothing to delete (uv's cache alone is never pruned) and no journal owed."""
        return not self.pending_journal and all(e.kind == "uv-cache" for e in self.entries)

    def counts(self) -> dict[str, int]:
        """How many entries of each kind."""
        return {k: n for k in ENTRY_KINDS if (n := sum(e.kind == k for e in self.entries))}

    def to_dict(self) -> dict[str, Any]:
        """The ``plan`` of ``prune --json`` (docs/cli.md)."""
        source = self.source
        return {
            "root": str(self.root),
            "cache_root": str(self.cache_root),
            "cluster": self.cluster,
            "source": {"label": source.label, "kind": source.kind} if source else None,
            "deep": self.deep,
            "min_age_hours": self.min_age_s / 3600,
            "pending_journal": self.pending_journal,
            "entries": [e.to_dict() for e in self.entries],
            "kept": [e.to_dict() for e in self.kept],
            "unattributed": self.unattributed.to_dict(),
            "notes": list(self.notes),
            "bytes": self.bytes,
            "counts": self.counts(),
        }


# --- rules every planner shares ------------------------------------------------------


def old_enough(mtime: float, now: float, min_age_s: float) -> bool:
    """The age rule of every garbage entry: at least ``min_age_s`` old."""
    return now - mtime >= min_age_s


class Listed:
    """A set of listed paths, indexed once so that :meth:`covers` is quick.

    A prune asks about every attributed file and every file under cache/ and home/:
    scanning the whole list per question would make a large install quadratic.
    """

    def __init__(self, paths: set[str]) -> None:
        self.paths = paths
        self.parents = {
            str(PurePosixPath(*parts[:i]))
            for parts in (PurePosixPath(p).parts for p in paths)
            for i in range(1, len(parts))
        }

    def covers(self, path: str) -> bool:
        """``path`` is listed, lies under a listed directory, or holds a listed file."""
        if path in self.paths or path in self.parents:
            return True
        parts = PurePosixPath(path).parts
        return any(str(PurePosixPath(*parts[:i])) in self.paths for i in range(1, len(parts)))


def root_relative(layout: InstallLayout, path: Path) -> str:
    """``path`` relative to the install root, as the plan names it."""
    return str(path.relative_to(layout.root))
