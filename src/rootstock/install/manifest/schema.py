"""The ``manifest.json`` schema: its version, field names and an empty manifest.

Cluster names are case-insensitive, as in the registry, and stored lower-case
(:func:`rootstock.names.cluster_name`). Parsing is in :mod:`.parse`. Nothing here
writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from rootstock.install.manifest.types import Manifest
from rootstock.names import cluster_name

MANIFEST_VERSION = 4
VERIFICATION_STATES = ("verified", "failed", "drifted", "tampered")
ENV_BUILD_FIELDS = (
    "build_id",
    "source_hash",
    "lock_hash",
    "built_at",
    "python",
    "python_path",
    "torch",
    "rootstock",
    "image",
)
BUILD_REF_FIELDS = ("build_id", "source_hash", "built_at", "lock_hash")
IMAGE_FIELDS = ("file", "sha256", "size", "compression")
WEIGHT_FIELDS = ("size", "sha256", "mtime")
#: How a verifying worker was started, when not from the shared env: from a squashfuse
#: mount of the env's image, or from a node-local extracted copy.
STAGED_MODES = ("mount", "copy")

FIX_HINT = (
    "the file was left untouched. Restore it from a backup or fix it by hand; "
    "`rootstock manifest init --cluster NAME --force` starts a fresh manifest "
    "(the old file is kept next to it as manifest.json.bak-<time>)"
)


def utc_now() -> str:
    """The current time as ISO-8601 UTC with seconds, as every manifest timestamp."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def unique(items: Iterable[str]) -> list[str]:
    """``items`` without repeats, in first-seen order."""
    return list(dict.fromkeys(items))


def new_manifest(clusters: Iterable[str] = ()) -> Manifest:
    """An empty manifest of the current schema serving ``clusters``."""
    return {
        "schema_version": MANIFEST_VERSION,
        "clusters": unique(cluster_name(c) for c in clusters),
        "created_at": utc_now(),
        "updated_at": None,
        "written_by": None,
        "envs": {},
    }
