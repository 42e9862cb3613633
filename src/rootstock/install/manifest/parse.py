"""Parsing ``manifest.json``: strict JSON, migrated, every field checked.

Parsing is strict JSON (:func:`rootstock.install.parsing.loads_json`), migrates an
older schema in memory (:mod:`.migrations`), checks every field (:mod:`.validate`)
and refuses a corrupt file or a newer schema with
:class:`~rootstock.errors.ManifestError`, whose message says what is wrong (with
the JSON path of the field) and what to do. Nothing here writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from rootstock.errors import UPGRADE_HINT, ManifestError
from rootstock.install.manifest.migrations import RawManifest, migrate, schema_version_of
from rootstock.install.manifest.schema import FIX_HINT, MANIFEST_VERSION
from rootstock.install.manifest.types import Manifest
from rootstock.install.manifest.validate import (
    SchemaProblem,
    StoredName,
    check_manifest,
    describe,
)
from rootstock.install.parsing import ParseProblem, check_depth, loads_json
from rootstock.names import CLUSTER_NAME_RULE, DEVICE_RULE, warn_stored_name


def parse_manifest(raw: str | bytes, path: Path | str = "manifest.json") -> Manifest:
    """Parse manifest JSON, migrating an older schema; refuse anything invalid."""
    data, _ = parse_manifest_text(raw, Path(path))
    return data


def parse_manifest_text(raw: str | bytes, path: Path) -> tuple[Manifest, bool]:
    """Like :func:`parse_manifest`, also saying whether a migration ran.

    Every field is checked (:mod:`.validate`); a refusal names the field's JSON
    path. A stored name today's rule refuses is read, with a
    :class:`~rootstock.names.StoredNameWarning` naming the fix.
    """
    try:
        data = loads_json(raw, walked_by_caller=True)
    except ParseProblem as exc:
        raise ManifestError(f"{path} is corrupt: {exc}", hint=FIX_HINT) from None
    if not isinstance(data, dict):
        raise ManifestError(
            f"{path} is corrupt: it holds {describe(data)}, not a JSON object", hint=FIX_HINT
        )
    version = schema_version_of(data)
    if version is None:
        raise ManifestError(
            f"{path} is corrupt: schema_version: must be a non-negative integer, "
            f"not {describe(data['schema_version'])}",
            hint=FIX_HINT,
        )
    if version > MANIFEST_VERSION:
        raise ManifestError(
            f"{path} has schema version {version}, but this rootstock understands "
            f"only up to {MANIFEST_VERSION}: a newer rootstock wrote it",
            hint=f"{UPGRADE_HINT}; the file was left untouched",
        )
    migrated = version < MANIFEST_VERSION
    raw_data: RawManifest = data
    if migrated:
        raw_data = _migrated(raw_data, version, path)
    try:
        stored = check_manifest(raw_data)
    except SchemaProblem as exc:
        after = f" (as migrated from schema version {version})" if migrated else ""
        raise ManifestError(f"{path} is corrupt: {exc}{after}", hint=FIX_HINT) from None
    _warn_stored_names(stored, path)
    # The one place untrusted JSON becomes a Manifest: check_manifest has just
    # checked every field the TypedDicts declare.
    return cast(Manifest, raw_data), migrated


def _warn_stored_names(stored: list[StoredName], path: Path) -> None:
    """One warning per distinct refused name (a cluster's name recurs in every record)."""
    places: dict[tuple[str, str], list[str]] = {}
    for name in stored:
        places.setdefault((name.kind, name.value), []).append(name.where)
    for (kind, value), wheres in places.items():
        more = f" (and {len(wheres) - 1} more places)" if len(wheres) > 1 else ""
        warn_stored_name(kind, value, f"{path} at {wheres[0]}{more}", _fix(kind))


def _migrated(data: RawManifest, version: int, path: Path) -> RawManifest:
    """``data`` migrated to the current schema, or a refusal saying why not."""
    try:
        # An old file skipped the walk the current schema gets; the migration steps
        # copy and stringify its values, so bound its depth first.
        check_depth(data)
        return migrate(data, MANIFEST_VERSION)
    except ParseProblem as exc:
        raise ManifestError(f"{path} is corrupt: {exc}", hint=FIX_HINT) from None
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
        raise ManifestError(
            f"{path} (schema version {version}) could not be migrated: {exc}",
            hint=FIX_HINT,
        ) from None


def _fix(kind: str) -> str:
    if kind == "cluster name":
        return (
            "rename it by hand in the file (in `clusters` and under each checkpoint's "
            f"`verifications`) to a valid name: {CLUSTER_NAME_RULE}; "
            "until then, results cannot be recorded for it"
        )
    if kind == "device":
        return f"re-verify on a valid device ({DEVICE_RULE}) to replace the record"
    return (
        "the record is kept but never replaced: delete it by hand, then re-verify "
        "(device kinds are cpu, gpu and xpu)"
    )
