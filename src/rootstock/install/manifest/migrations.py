"""Schema migrations for ``manifest.json``: one function per step, vN -> vN+1.

Migrations run on read, in memory; the migrated manifest reaches the disk only with
the next locked write. Each step takes the parsed JSON of version N and returns the
JSON of version N+1 (it may build a new dict or edit its argument). To change the
schema: bump ``MANIFEST_VERSION`` in ``schema.py``, add ``MIGRATIONS[N]`` here,
add a test that feeds a version-N file through it, and document the change in
``docs/manifest.md``.

Version 0 is a manifest without ``schema_version``: the draft layout written before
versioning. It named a single ``cluster`` and kept one flat verification per
checkpoint (``verified_at``, ``device``, ``error``) with no record of the env build
it was verified against.

Version 1 kept one ``reference`` fingerprint per cluster and device kind, whatever
setup kwargs set it, so a pass with other kwargs (``add --kwarg modal=R2SCAN``, then
a smoke-test with ``VERIFY_KWARGS``) read as drifted. Version 2 files references by
their kwargs too (``references``) and records the kwargs of each pass (``kwargs``).

Version 3 records each env build's squashfs image (``image``, null for an env built
before images or without one) and how each verifying worker was started
(``staged``, absent in older records and read as null).

Version 4 adds the ``tampered`` verification state (a weight file changed since
``add``) and each checkpoint's optional ``weights`` (size, sha256 and mtime per
file). Nothing in a v3 file changes; the version moves so that a reader of version 3,
which would refuse a ``tampered`` record as corrupt, says instead that a newer
rootstock wrote the file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rootstock.install.manifest.fingerprints import UNRECORDED_KWARGS, device_kind

RawManifest = dict[str, Any]  # any schema version: old ones are not the current shape


def schema_version_of(data: RawManifest) -> int | None:
    """The schema version a parsed manifest declares: 0 when absent, None when invalid."""
    if "schema_version" not in data:
        return 0
    version = data["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        return None
    return version


def migrate(data: RawManifest, target: int) -> RawManifest:
    """Apply the registered steps until ``data`` is at version ``target``.

    The caller has already checked that the version is known and not above target.
    """
    version = schema_version_of(data)
    if version is None:
        raise ValueError("schema_version is not a non-negative integer")
    while version < target:
        step = MIGRATIONS.get(version)
        if step is None:
            raise ValueError(f"no migration from schema version {version}")
        data = step(data)
        if data.get("schema_version") != version + 1:
            raise ValueError(f"migration from version {version} did not reach {version + 1}")
        version += 1
    return data


def _v0_to_v1(old: RawManifest) -> RawManifest:
    """Pre-versioning draft -> v1: a cluster list and per-cluster, per-kind records."""
    cluster = old.get("cluster")
    clusters = [cluster.lower()] if isinstance(cluster, str) and cluster else []
    old_envs = old.get("envs", old.get("environments", {}))
    envs: dict[str, Any] = {}
    for name, entry in (old_envs if isinstance(old_envs, dict) else {}).items():
        if not isinstance(entry, dict):
            continue
        checkpoints = entry.get("checkpoints", {})
        envs[name] = {
            "build_id": None,
            "source_hash": entry.get("source_hash"),
            "lock_hash": entry.get("lock_hash"),
            "built_at": entry.get("built_at"),
            "python": entry.get("python", entry.get("python_version")),
            "python_path": entry.get("python_path"),
            "torch": entry.get("torch", entry.get("torch_version")),
            "rootstock": entry.get("rootstock", entry.get("rootstock_version")),
            "checkpoints": {
                cid: _v0_checkpoint(ck, clusters)
                for cid, ck in (checkpoints if isinstance(checkpoints, dict) else {}).items()
                if isinstance(ck, dict)
            },
        }
    return {
        "schema_version": 1,
        "clusters": clusters,
        "created_at": old.get("created_at"),
        "updated_at": old.get("updated_at"),
        "written_by": old.get("written_by"),
        "envs": envs,
    }


def _v0_checkpoint(old: dict[str, Any], clusters: list[str]) -> dict[str, Any]:
    verified_at = old.get("verified_at")
    error = old.get("error")
    fetched_at = old.get("fetched_at")
    if fetched_at is None and (old.get("fetched") or verified_at):
        fetched_at = verified_at or old.get("updated_at")
    verifications: dict[str, Any] = {}
    if clusters and (verified_at or error):
        device = str(old.get("device") or "cpu")
        kind = device_kind(device)
        verifications[clusters[0]] = {
            kind: {
                "state": "failed" if error else "verified",
                "at": verified_at or old.get("updated_at"),
                "device": device,
                "device_kind": kind,
                "message": _first_line(error),
                "fingerprint": None,
                "reference": None,
                "drift": None,
                # v0 never said which build it verified, so v1 shows the record as
                # stale until the next verification.
                "build": {
                    "build_id": None,
                    "source_hash": None,
                    "built_at": None,
                    "lock_hash": None,
                },
            }
        }
    return {"fetched_at": fetched_at, "verifications": verifications}


def _first_line(error: Any) -> str | None:
    """The first non-blank line of a v0 ``error`` (None when it has none)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] if error else []
    return lines[0] if lines else None


def _v1_to_v2(old: RawManifest) -> RawManifest:
    """v1 -> v2: references filed by setup kwargs; each record says its kwargs.

    A v1 record never said which kwargs its pass or its reference ran with, so its
    ``kwargs`` becomes None (unknown) and its reference is filed under
    :data:`UNRECORDED_KWARGS`, for the next pass to adopt (see ``record_verification``).
    """
    for env in _objects(old.get("envs")):
        for entry in _objects(env.get("checkpoints")):
            for by_kind in _objects(entry.get("verifications")):
                for record in _objects(by_kind):
                    reference = record.get("reference")
                    record.setdefault("kwargs", None)
                    record["references"] = (
                        {UNRECORDED_KWARGS: reference} if isinstance(reference, dict) else {}
                    )
    old["schema_version"] = 2
    return old


def _v2_to_v3(old: RawManifest) -> RawManifest:
    """v2 -> v3: every env says its image; a v2 build had none, so ``image`` is None.

    Verification records gain nothing: their ``staged`` is optional, read as null
    (started from the shared env), which is how every v2 worker was started.
    """
    for env in _objects(old.get("envs")):
        env.setdefault("image", None)
    old["schema_version"] = 3
    return old


def _v3_to_v4(old: RawManifest) -> RawManifest:
    """v3 -> v4: nothing to convert; a v3 checkpoint has no ``weights`` (read as absent:
    recorded before weights were hashed) and no record is ``tampered``."""
    old["schema_version"] = 4
    return old


def _objects(mapping: Any) -> list[dict[str, Any]]:
    """The dict values of ``mapping`` (none when it is not a dict): shape checks come later."""
    if not isinstance(mapping, dict):
        return []
    return [value for value in mapping.values() if isinstance(value, dict)]


MIGRATIONS: dict[int, Callable[[RawManifest], RawManifest]] = {
    0: _v0_to_v1,
    1: _v1_to_v2,
    2: _v2_to_v3,
    3: _v3_to_v4,
}
