"""A pushed manifest or usage report turned into rows (writes; the caller commits).

A manifest push is kept whole as history (:class:`ManifestPush`) and *replaces* the
cluster's current envs and coverage cells: a checkpoint missing from the new push is
gone from the matrix. Each verification record it carries is kept once in
:class:`VerificationEvent`, however many later pushes repeat it, so the cluster page
can show a checkpoint's history even though a manifest holds only the latest result
per device kind.

Cell states come from :func:`rootstock.install.manifest.checkpoint_state`, the same
derivation ``rootstock status`` uses, so ``stale`` means the same thing everywhere.

Times copied into rows (``verified_at``, ``fetched_at``, ``built_at``, an event's
``at``) are stored in UTC (:func:`utc_time`), whatever offset the install wrote:
the views order and pick "latest" by comparing these strings, which is right only
when every one has the same offset. The history body stays as sent.

Only the newest ``keep_bodies`` pushes of a cluster keep their body
(:mod:`rootstock.dashboard.retention`); older history rows keep their metadata.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from datetime import UTC
from typing import Any, cast

from sqlalchemy import Insert, Table, delete, insert, select, update
from sqlalchemy.orm import Session

from rootstock.dashboard.models import (
    INFO,
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
from rootstock.dashboard.retention import DEFAULT_KEEP_BODIES, checked_keep_bodies
from rootstock.install.manifest import Checks, Manifest, checkpoint_state, parse_time

SHORT = 20  # state and device-kind columns
ENV_FIELDS = ("build_id", "source_hash", "built_at", "python", "torch", "rootstock")


class ManifestShapeError(ValueError):
    """A pushed manifest whose structure cannot be stored (the API answers 422)."""


def store_push(
    session: Session,
    cluster: Cluster,
    manifest: Manifest,
    api_key_id: int | None,
    body: str | None = None,
    keep_bodies: int = DEFAULT_KEEP_BODIES,
) -> ManifestPush:
    """Record one push of ``cluster``'s manifest and make it the cluster's current state.

    Writes the history row (``body``, the JSON text as received, when the caller has
    it: re-serialising a 300-checkpoint manifest costs a third of this function;
    otherwise ``manifest`` serialised), replaces the cluster's
    :class:`ClusterEnv` and :class:`CoverageCell` rows, adds verification records not
    stored yet, moves ``cluster.last_push_*``, and drops the bodies of the cluster's
    pushes older than its newest ``keep_bodies`` (this one included). Raises
    :class:`ManifestShapeError` before writing anything when the manifest's structure
    is unusable. Does not commit.
    """
    keep_bodies = checked_keep_bodies(keep_bodies)
    check_manifest_shape(manifest)
    name = cluster.name.strip().lower()
    _lock_cluster(session, cluster)

    envs = manifest.get("envs") or {}
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
        connection.execute(insert(_table(ClusterEnv)), env_rows)
    if cell_rows:
        connection.execute(insert(_table(CoverageCell)), cell_rows)
    _insert_new_events(session, cluster.id, event_rows)

    cluster.last_push_id = push.id
    cluster.last_push_at = push.received_at
    session.flush()
    drop_old_bodies(session, cluster.id, keep_bodies)
    return push


def drop_old_bodies(session: Session, cluster_id: int, keep: int) -> int:
    """Drop the bodies of ``cluster_id``'s pushes older than its newest ``keep``.

    The rows stay (``GET .../pushes`` lists them, with their time and counts); only
    ``body`` becomes null. "Newest" is by id: the caller holds the cluster's row
    lock (:func:`_lock_cluster`), so a cluster's push ids grow in commit order and
    two concurrent pushes can neither both keep nor both drop one body. Returns the
    number of bodies dropped (usually 0 or 1: one per push once the history is full).
    """
    oldest_kept = session.execute(
        select(ManifestPush.id)
        .where(ManifestPush.cluster_id == cluster_id)
        .order_by(ManifestPush.id.desc())
        .offset(keep - 1)
        .limit(1)
    ).scalar()
    if oldest_kept is None:
        return 0
    result = session.connection().execute(
        update(ManifestPush)
        .where(
            ManifestPush.cluster_id == cluster_id,
            ManifestPush.id < oldest_kept,
            ManifestPush.body.is_not(None),
        )
        .values(body=None)
    )
    return result.rowcount


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
        session.connection().execute(insert(_table(UsageCount)), list(rows.values()))
    session.flush()
    return len(rows)


def _table(model: type[Any]) -> Table:
    """The Table a declarative model maps (typed as any FromClause by SQLAlchemy)."""
    return cast(Table, model.__table__)


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
# A checkpoint's info (licence, gating, citation) that a push adds from its env file.
INFO_TEXT = {"licence": INFO, "gated": INFO, "citation": INFO}
RECORD_TEXT = {"at": TIME, "state": SHORT, "device": NAME, "message": None}
RECORD_OBJECTS = ("build", "fingerprint", "checks")
# The times stored in rows at each level, normalised to UTC (utc_time).
ENV_TIMES = ("built_at",)
ENTRY_TIMES = ("fetched_at",)
RECORD_TIMES = ("at",)


@functools.lru_cache(maxsize=4096)
def utc_time(text: str) -> str:
    """``text`` (an ISO-8601 time) as the same instant in UTC, as rows store it.

    ``2026-01-01T10:00:00+05:00`` and ``2026-01-01T05:00:00Z`` both become
    ``2026-01-01T05:00:00+00:00``; a time without an offset is read as UTC (as
    ``rootstock status`` and the pages read it). Fractions of a second are kept, as
    six digits. Raises ValueError for text that is not such a time. Cached: a push
    repeats the same few times across hundreds of records.
    """
    moment = parse_time(text)
    if moment is None:
        raise ValueError("not an ISO-8601 time (e.g. 2026-11-28T10:00:00+00:00)")
    try:
        return moment.astimezone(UTC).isoformat()
    except OverflowError:
        raise ValueError("a time out of the range a UTC time can hold") from None


def _utc_or_none(text: str | None) -> str | None:
    return None if text is None else utc_time(text)


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
        _check_times(env, ENV_TIMES, env_path)
        checkpoints = _object(env.get("checkpoints"), (*env_path, "checkpoints"))
        for checkpoint, entry in checkpoints.items():
            path = (*env_path, "checkpoints", checkpoint)
            _check_name(checkpoint, NAME, path, "checkpoint ids")
            _check_text(_object(entry, path), ENTRY_TEXT, path)
            _check_times(entry, ENTRY_TIMES, path)
            info = entry.get("info")
            if info is not None:
                _check_text(_object(info, (*path, "info")), INFO_TEXT, (*path, "info"))
            verifications = _object(entry.get("verifications"), (*path, "verifications"))
            for cluster, by_kind in verifications.items():
                cluster_path = (*path, "verifications", cluster)
                for kind, record in _object(by_kind, cluster_path).items():
                    record_path = (*cluster_path, kind)
                    _check_name(kind, SHORT, record_path, "device kinds")
                    _check_text(_object(record, record_path), RECORD_TEXT, record_path)
                    _check_times(record, RECORD_TIMES, record_path)
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


def _check_text(obj: dict, fields: Mapping[str, int | None], path: tuple[str, ...]) -> None:
    for field, limit in fields.items():
        value = obj.get(field)
        if value is None or (isinstance(value, str) and (limit is None or len(value) <= limit)):
            continue
        bound = "" if limit is None else f" of at most {limit} characters"
        raise ManifestShapeError(f"{_where(path)}.{field}: must be text{bound}, or null")


def _check_times(obj: dict, fields: tuple[str, ...], path: tuple[str, ...]) -> None:
    # After _check_text: each of these is text or None already.
    for field in fields:
        value = obj.get(field)
        if value is None:
            continue
        try:
            utc_time(value)
        except ValueError as exc:
            raise ManifestShapeError(f"{_where(path)}.{field}: {exc}") from None


def _rows_from_manifest(
    manifest: Manifest, cluster: str, cluster_id: int, push_id: int
) -> tuple[list[dict], list[dict], list[dict]]:
    """The env, cell and verification-event rows one push describes, times in UTC.

    States are derived from the manifest as sent: staleness compares a record's
    build time with its env's as text, which must not see one normalised and the
    other not.
    """
    env_rows: list[dict] = []
    cell_rows: list[dict] = []
    events: dict[tuple, dict] = {}
    for env_name, env in (manifest.get("envs") or {}).items():
        env_rows.append(
            {"cluster_id": cluster_id, "name": env_name, "push_id": push_id}
            | {field: env.get(field) for field in ENV_FIELDS}
            | {"built_at": _utc_or_none(env.get("built_at"))}
        )
        for checkpoint, entry in (env.get("checkpoints") or {}).items():
            cell = checkpoint_state(manifest, env_name, checkpoint, cluster)
            by_kind = (entry.get("verifications") or {}).get(cluster) or {}
            info = cast(Mapping[str, Any], entry).get("info")  # a push-only key
            cell_rows.append(
                {
                    "cluster_id": cluster_id,
                    "env": env_name,
                    "checkpoint": checkpoint,
                    "family": env_name,
                    "state": cell.state,
                    "verified_at": _utc_or_none(cell.at),
                    "fetched_at": _utc_or_none(cell.fetched_at),
                    "device_kind": cell.device_kind,
                    "device": cell.device,
                    "message": cell.message,
                    "push_id": push_id,
                    "described": info is not None,
                    **{field: (info or {}).get(field) for field in INFO_TEXT},
                    "devices": _devices_text(manifest, env_name, checkpoint, cluster, by_kind),
                }
            )
            for kind, record in by_kind.items():
                if not record.get("at"):
                    continue  # a record without a time cannot be placed in history
                at = utc_time(record["at"])
                key = (env_name, checkpoint, kind, at)
                events[key] = {
                    "cluster_id": cluster_id,
                    "env": env_name,
                    "checkpoint": checkpoint,
                    "device_kind": kind,
                    "at": at,
                    "state": record.get("state") or "failed",
                    "device": record.get("device"),
                    "message": record.get("message"),
                    "energy_per_atom": _energy(record.get("fingerprint")),
                    "checks": _checks_text(record.get("checks")),
                    "push_id": push_id,
                }
    return env_rows, cell_rows, list(events.values())


def _devices_text(
    manifest: Manifest, env: str, checkpoint: str, cluster: str, by_kind: Mapping[str, Any]
) -> str | None:
    """The latest result per device kind, each derived as ``status`` derives it, as JSON.

    ``{kind: {"state", "at", "device", "message"}}``, times in UTC; None when the
    cluster has no verification of the checkpoint.
    """
    devices = {}
    for kind in sorted(by_kind):
        state = checkpoint_state(manifest, env, checkpoint, cluster, device_kind=kind)
        devices[kind] = {
            "state": state.state,
            "at": _utc_or_none(state.at),
            "device": state.device,
            "message": state.message,
        }
    return json.dumps(devices, separators=(",", ":")) if devices else None


def _energy(fingerprint: Mapping[str, Any] | None) -> float | None:
    value = (fingerprint or {}).get("energy_per_atom")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _checks_text(checks: Checks | None) -> str | None:
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
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            statement: Insert = sqlite_insert(_table(VerificationEvent)).on_conflict_do_nothing()
        else:
            from sqlalchemy.dialects.postgresql import insert as postgresql_insert

            statement = postgresql_insert(_table(VerificationEvent)).on_conflict_do_nothing()
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
        session.connection().execute(insert(_table(VerificationEvent)), fresh)


def _event_key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    return (row["env"], row["checkpoint"], row["device_kind"], row["at"])
