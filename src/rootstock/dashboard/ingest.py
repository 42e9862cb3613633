"""A pushed manifest or usage report turned into rows (writes; the caller commits).

A manifest push is kept whole as history (:class:`ManifestPush`) and *replaces* the
cluster's current envs and coverage cells: a checkpoint missing from the new push is
gone from the matrix. Each verification record it carries is kept once in
:class:`VerificationEvent`, however many later pushes repeat it, so the cluster page
can show a checkpoint's history even though a manifest holds only the latest result
per device kind.

Cell states come from :func:`rootstock.install.manifest.checkpoint_state`, the same
derivation ``rootstock status`` uses, so ``stale`` means the same thing everywhere.
"""

from __future__ import annotations

import json
import math
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from rootstock.dashboard.models import (
    NAME,
    TIME,
    Cluster,
    ClusterEnv,
    CoverageCell,
    ManifestPush,
    UsageCount,
    VerificationEvent,
    utc_now,
)
from rootstock.install.manifest import checkpoint_state

SHORT = 20  # state and device-kind columns
ENV_FIELDS = ("build_id", "source_hash", "built_at", "python", "torch", "rootstock")


class ManifestShapeError(ValueError):
    """A pushed manifest whose structure cannot be stored (the API answers 422)."""


def store_push(
    session: Session,
    cluster: Cluster,
    manifest: dict[str, Any],
    api_key_id: int | None,
    body: str | None = None,
) -> ManifestPush:
    """Record one push of ``cluster``'s manifest and make it the cluster's current state.

    Writes the history row (``body``, the JSON text as received, when the caller has
    it: re-serialising a 300-checkpoint manifest costs a third of this function;
    otherwise ``manifest`` serialised), replaces the cluster's
    :class:`ClusterEnv` and :class:`CoverageCell` rows, adds verification records not
    stored yet, and moves ``cluster.last_push_*``. Raises :class:`ManifestShapeError`
    before writing anything when the manifest's structure is unusable. Does not commit.
    """
    check_manifest_shape(manifest)
    name = cluster.name.strip().lower()
    _lock_cluster(session, cluster)

    envs: dict[str, dict[str, Any]] = manifest.get("envs") or {}
    push = ManifestPush(
        cluster_id=cluster.id,
        api_key_id=api_key_id,
        received_at=utc_now(),
        schema_version=int(manifest["schema_version"]),
        env_count=len(envs),
        checkpoint_count=sum(len(env.get("checkpoints") or {}) for env in envs.values()),
        body=body if body is not None else json.dumps(manifest, separators=(",", ":")),
    )
    session.add(push)
    session.flush()  # assigns push.id

    env_rows, cell_rows, event_rows = _rows_from_manifest(manifest, name, cluster.id, push.id)
    # Core statements on the session's connection: one executemany per table. (The
    # ORM's bulk insert splits the rows into a batch per pattern of None values.)
    connection = session.connection()
    connection.execute(delete(ClusterEnv).where(ClusterEnv.cluster_id == cluster.id))
    connection.execute(delete(CoverageCell).where(CoverageCell.cluster_id == cluster.id))
    if env_rows:
        connection.execute(insert(ClusterEnv.__table__), env_rows)
    if cell_rows:
        connection.execute(insert(CoverageCell.__table__), cell_rows)
    _insert_new_events(session, cluster.id, event_rows)

    cluster.last_push_id = push.id
    cluster.last_push_at = push.received_at
    session.flush()
    return push


def store_usage(session: Session, cluster: Cluster, counts: list[dict[str, Any]]) -> int:
    """Store aggregated monthly counts; returns the number of rows written.

    Re-sending a month *replaces* that month's rows for this cluster (a retried
    ``rootstock usage push`` never double-counts); months not in ``counts`` are kept.
    A key repeated within ``counts`` keeps its last value. Does not commit.
    """
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    now = utc_now()
    for count in counts:
        key = (str(count["month"]), str(count["env"]), str(count["checkpoint"]))
        rows[key] = {
            "cluster_id": cluster.id,
            "month": key[0],
            "env": key[1],
            "checkpoint": key[2],
            "sessions": int(count.get("sessions") or 0),
            "distinct_users": int(count.get("distinct_users") or 0),
            "force_calls": int(count.get("force_calls") or 0),
            "updated_at": now,
        }
    months = sorted({key[0] for key in rows})
    if months:
        # The cluster row lock store_push takes: two concurrent replaces of one month
        # would otherwise both delete, then both insert the same rows (PostgreSQL).
        _lock_cluster(session, cluster)
        session.execute(
            delete(UsageCount).where(
                UsageCount.cluster_id == cluster.id, UsageCount.month.in_(months)
            )
        )
        session.connection().execute(insert(UsageCount.__table__), list(rows.values()))
    session.flush()
    return len(rows)


def _lock_cluster(session: Session, cluster: Cluster) -> None:
    """Hold ``cluster``'s row until the transaction ends, serialising its writes.

    On PostgreSQL, two server processes replacing the same cluster's rows at once
    would otherwise both delete, then both insert the same keys. SQLite ignores
    ``FOR UPDATE`` and serialises writers anyway.
    """
    session.execute(select(Cluster.id).where(Cluster.id == cluster.id).with_for_update())


# The stored text fields at each level, with their column's length limit.
ENV_TEXT = {field: NAME for field in ENV_FIELDS}
ENTRY_TEXT = {"fetched_at": TIME}
RECORD_TEXT = {"at": TIME, "state": SHORT, "device": NAME, "message": None}
RECORD_OBJECTS = ("build", "fingerprint", "checks")


def check_manifest_shape(manifest: Any) -> None:
    """Refuse a manifest whose structure cannot be stored, naming the bad part.

    Only what the dashboard reads is checked (envs, checkpoints, verification
    records, the lengths of stored names and times); unknown keys are ignored.
    Every push runs it, so the path to a part is kept as a tuple of keys and only
    spelled out on failure.
    """
    if not isinstance(manifest, dict):
        raise ManifestShapeError("the manifest must be a JSON object")
    version = manifest.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestShapeError("schema_version must be an integer")
    for env_name, env in _object(manifest.get("envs"), ("envs",)).items():
        env_path = ("envs", env_name)
        _check_name(env_name, NAME, env_path, "env names")
        _check_text(_object(env, env_path), ENV_TEXT, env_path)
        checkpoints = _object(env.get("checkpoints"), (*env_path, "checkpoints"))
        for checkpoint, entry in checkpoints.items():
            path = (*env_path, "checkpoints", checkpoint)
            _check_name(checkpoint, NAME, path, "checkpoint ids")
            _check_text(_object(entry, path), ENTRY_TEXT, path)
            verifications = _object(entry.get("verifications"), (*path, "verifications"))
            for cluster, by_kind in verifications.items():
                cluster_path = (*path, "verifications", cluster)
                for kind, record in _object(by_kind, cluster_path).items():
                    record_path = (*cluster_path, kind)
                    _check_name(kind, SHORT, record_path, "device kinds")
                    _check_text(_object(record, record_path), RECORD_TEXT, record_path)
                    for field in RECORD_OBJECTS:
                        if not isinstance(record.get(field), dict | None):
                            raise ManifestShapeError(
                                f"{_where(record_path)}.{field}: not an object"
                            )


def _where(path: tuple[str, ...]) -> str:
    """``envs['mace'].checkpoints['mace-small']`` (long keys cut short)."""
    text = path[0]
    for index, key in enumerate(path[1:], start=1):
        text += f"[{key[:40]!r}]" if index % 2 else f".{key}"
    return text


def _object(value: Any, path: tuple[str, ...]) -> dict:
    """``value`` as an object (None is an empty one), or a refusal naming ``path``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ManifestShapeError(f"{_where(path)} must be an object")
    return value


def _check_name(name: str, limit: int, path: tuple[str, ...], what: str) -> None:
    if not 0 < len(name) <= limit:
        raise ManifestShapeError(f"{_where(path)}: {what} are 1-{limit} characters")


def _check_text(obj: dict, fields: dict[str, int | None], path: tuple[str, ...]) -> None:
    for field, limit in fields.items():
        value = obj.get(field)
        if value is None or (isinstance(value, str) and (limit is None or len(value) <= limit)):
            continue
        bound = "" if limit is None else f" of at most {limit} characters"
        raise ManifestShapeError(f"{_where(path)}.{field}: must be text{bound}, or null")


def _rows_from_manifest(
    manifest: dict[str, Any], cluster: str, cluster_id: int, push_id: int
) -> tuple[list[dict], list[dict], list[dict]]:
    """The env, cell and verification-event rows one push describes."""
    env_rows: list[dict] = []
    cell_rows: list[dict] = []
    events: dict[tuple, dict] = {}
    for env_name, env in (manifest.get("envs") or {}).items():
        env_rows.append(
            {"cluster_id": cluster_id, "name": env_name, "push_id": push_id}
            | {field: env.get(field) for field in ENV_FIELDS}
        )
        for checkpoint, entry in (env.get("checkpoints") or {}).items():
            cell = checkpoint_state(manifest, env_name, checkpoint, cluster)
            cell_rows.append(
                {
                    "cluster_id": cluster_id,
                    "env": env_name,
                    "checkpoint": checkpoint,
                    "family": env_name,
                    "state": cell.state,
                    "verified_at": cell.at,
                    "fetched_at": cell.fetched_at,
                    "device_kind": cell.device_kind,
                    "device": cell.device,
                    "message": cell.message,
                    "push_id": push_id,
                }
            )
            by_kind = (entry.get("verifications") or {}).get(cluster) or {}
            for kind, record in by_kind.items():
                if not record.get("at"):
                    continue  # a record without a time cannot be placed in history
                key = (env_name, checkpoint, kind, record["at"])
                events[key] = {
                    "cluster_id": cluster_id,
                    "env": env_name,
                    "checkpoint": checkpoint,
                    "device_kind": kind,
                    "at": record["at"],
                    "state": record.get("state") or "failed",
                    "device": record.get("device"),
                    "message": record.get("message"),
                    "energy_per_atom": _energy(record.get("fingerprint")),
                    "checks": _checks_text(record.get("checks")),
                    "push_id": push_id,
                }
    return env_rows, cell_rows, list(events.values())


def _energy(fingerprint: dict[str, Any] | None) -> float | None:
    value = (fingerprint or {}).get("energy_per_atom")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _checks_text(checks: dict[str, Any] | None) -> str | None:
    """A record's physics checks as the compact JSON text the history column keeps."""
    if not isinstance(checks, dict):
        return None
    return json.dumps(checks, separators=(",", ":"), sort_keys=True)


def _insert_new_events(session: Session, cluster_id: int, rows: list[dict]) -> None:
    """Insert the verification events not stored yet (unique per cluster/env/id/kind/at)."""
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    if dialect in ("sqlite", "postgresql"):
        # ON CONFLICT DO NOTHING also settles a race between two pushes of one record.
        if dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as upsert
        else:
            from sqlalchemy.dialects.postgresql import insert as upsert
        statement = upsert(VerificationEvent.__table__).on_conflict_do_nothing()
        session.connection().execute(statement, rows)
        return
    columns = (
        VerificationEvent.env,
        VerificationEvent.checkpoint,
        VerificationEvent.device_kind,
        VerificationEvent.at,
    )
    query = select(*columns).where(VerificationEvent.cluster_id == cluster_id)
    stored = {tuple(row) for row in session.execute(query)}
    fresh = [r for r in rows if _event_key(r) not in stored]
    if fresh:
        session.connection().execute(insert(VerificationEvent.__table__), fresh)


def _event_key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    return (row["env"], row["checkpoint"], row["device_kind"], row["at"])
