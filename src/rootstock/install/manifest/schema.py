"""The ``manifest.json`` schema: version, field names, parsing and shape checks.

Parsing migrates an older schema in memory (:mod:`.migrations`) and refuses a
corrupt file or a newer schema with :class:`~rootstock.errors.ManifestError`, whose
message says what is wrong and what to do. Nothing here writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rootstock.errors import ManifestError
from rootstock.install.manifest.migrations import migrate, schema_version_of
from rootstock.names import cluster_name

MANIFEST_VERSION = 2
VERIFICATION_STATES = ("verified", "failed", "drifted")
ENV_BUILD_FIELDS = (
    "build_id",
    "source_hash",
    "lock_hash",
    "built_at",
    "python",
    "python_path",
    "torch",
    "rootstock",
)
BUILD_REF_FIELDS = ("build_id", "source_hash", "built_at", "lock_hash")

Manifest = dict[str, Any]

FIX_HINT = (
    "the file was left untouched. Restore it from a backup or fix it by hand; "
    "`rootstock manifest init --cluster NAME --force` starts a fresh manifest "
    "(the old file is kept next to it as manifest.json.bak-<time>)"
)


def utc_now() -> str:
    """The current time as ISO-8601 UTC with seconds, as every manifest timestamp."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def normalize_cluster(name: str) -> str:
    """Cluster names are case-insensitive, as in the registry: store them lower-case.

    Refuses a name outside the one rule (:func:`rootstock.names.cluster_name`).
    """
    return cluster_name(name)


def unique(items: Iterable[str]) -> list[str]:
    """``items`` without repeats, in first-seen order."""
    return list(dict.fromkeys(items))


def new_manifest(clusters: Iterable[str] = ()) -> Manifest:
    """An empty manifest of the current schema serving ``clusters``."""
    return {
        "schema_version": MANIFEST_VERSION,
        "clusters": unique(normalize_cluster(c) for c in clusters),
        "created_at": utc_now(),
        "updated_at": None,
        "written_by": None,
        "envs": {},
    }


def parse_manifest(raw: str | bytes, path: Path | str = "manifest.json") -> Manifest:
    """Parse manifest JSON, migrating an older schema; refuse anything invalid."""
    data, _ = parse_manifest_text(raw, Path(path))
    return data


def parse_manifest_text(raw: str | bytes, path: Path) -> tuple[Manifest, bool]:
    """Like :func:`parse_manifest`, also saying whether a migration ran."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise ManifestError(f"{path} is corrupt: not UTF-8 text", hint=FIX_HINT) from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise ManifestError(
            f"{path} is corrupt: invalid JSON ({exc.msg} at {where})", hint=FIX_HINT
        ) from None
    if not isinstance(data, dict):
        raise ManifestError(
            f"{path} is corrupt: it holds a JSON {type(data).__name__}, not an object",
            hint=FIX_HINT,
        )
    version = schema_version_of(data)
    if version is None:
        raise ManifestError(
            f"{path} is corrupt: schema_version {data['schema_version']!r} "
            "is not a non-negative integer",
            hint=FIX_HINT,
        )
    if version > MANIFEST_VERSION:
        raise ManifestError(
            f"{path} has schema version {version}, but this rootstock understands "
            f"only up to {MANIFEST_VERSION}: a newer rootstock wrote it",
            hint="upgrade rootstock (pip install -U rootstock); the file was left untouched",
        )
    migrated = version < MANIFEST_VERSION
    if migrated:
        try:
            data = migrate(data, MANIFEST_VERSION)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ManifestError(
                f"{path} (schema version {version}) could not be migrated: {exc}",
                hint=FIX_HINT,
            ) from None
    problem = shape_problem(data)
    if problem:
        raise ManifestError(f"{path} is corrupt: {problem}", hint=FIX_HINT)
    return data, migrated


def shape_problem(data: Manifest) -> str | None:
    """What is structurally wrong with a current-schema manifest, or None.

    Only the nesting the code walks is checked; leaf values are not policed.
    """
    clusters = data.get("clusters")
    if not isinstance(clusters, list) or not all(isinstance(c, str) for c in clusters):
        return "clusters must be a list of names"
    envs = data.get("envs")
    if not isinstance(envs, dict):
        return "envs must be an object"
    for env_name, env in envs.items():
        if not isinstance(env, dict):
            return f"envs[{env_name!r}] must be an object"
        checkpoints = env.get("checkpoints", {})
        if not isinstance(checkpoints, dict):
            return f"envs[{env_name!r}].checkpoints must be an object"
        for cid, ck in checkpoints.items():
            where = f"envs[{env_name!r}].checkpoints[{cid!r}]"
            if not isinstance(ck, dict):
                return f"{where} must be an object"
            verifications = ck.get("verifications", {})
            if not isinstance(verifications, dict):
                return f"{where}.verifications must be an object"
            for cluster, by_kind in verifications.items():
                if not isinstance(by_kind, dict) or not all(
                    isinstance(r, dict) for r in by_kind.values()
                ):
                    return f"{where}.verifications[{cluster!r}] must map device kinds to objects"
    return None
