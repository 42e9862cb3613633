"""Read models shared by the JSON API and the HTML pages (plain JSON-ready dicts).

The shapes are the ones ``docs/dashboard-api.md`` documents. Each view is a fixed,
small number of queries whatever the number of clusters and checkpoints (no query
per row), so the coverage matrix stays fast at 50 clusters x 300 checkpoints.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from rootstock.dashboard.models import (
    Cluster,
    ClusterEnv,
    CoverageCell,
    ManifestPush,
    UsageCount,
    VerificationEvent,
    utc_now,
)

COVERAGE_VERSION = 1
HISTORY_LIMIT = 20  # verification events per checkpoint on the cluster page


def iso_time(moment: datetime | None) -> str | None:
    """A server-made time as ISO-8601 UTC with seconds (``2026-11-29T02:14:51+00:00``)."""
    return None if moment is None else moment.isoformat(timespec="seconds")


# One matrix cell: (env, state, verified_at, device_kind, message).
Cell = tuple[str, str, str | None, str | None, str | None]


@dataclass
class Matrix:
    """The coverage matrix in compact form, shared by the JSON view and the page.

    ``clusters``: the columns as ``(name, last_push_at)``; ``rows``: one
    ``(checkpoint, family, cells)`` per checkpoint, sorted by family then id, where
    ``cells`` lines up with ``clusters`` (None where a cluster lacks the checkpoint).
    """

    generated_at: datetime
    clusters: list[tuple[str, datetime | None]]
    families: list[str]
    rows: list[tuple[str, str, list[Cell | None]]]


def coverage(
    session: Session,
    family: str | None = None,
    state: str | None = None,
    cluster: str | None = None,
) -> dict[str, Any]:
    """The checkpoint x cluster matrix (``GET /api/v1/coverage``); see :func:`matrix`."""
    found = matrix(session, family=family, state=state, cluster=cluster)
    names = [name for name, _ in found.clusters]
    return {
        "version": COVERAGE_VERSION,
        "generated_at": iso_time(found.generated_at),
        "clusters": [{"name": n, "last_push_at": iso_time(at)} for n, at in found.clusters],
        "families": found.families,
        "checkpoints": [
            {
                "checkpoint": checkpoint,
                "family": row_family,
                "cells": {
                    name: {
                        "env": cell[0],
                        "state": cell[1],
                        "verified_at": cell[2],
                        "device_kind": cell[3],
                        "message": cell[4],
                    }
                    for name, cell in zip(names, cells, strict=True)
                    if cell is not None
                },
            }
            for checkpoint, row_family, cells in found.rows
        ],
    }


def matrix(
    session: Session,
    family: str | None = None,
    state: str | None = None,
    cluster: str | None = None,
) -> Matrix:
    """The coverage matrix: three queries whatever its size.

    Columns are the clusters that have pushed; rows are checkpoints sorted by
    family, then id. ``family`` keeps that family's rows, ``state`` the rows with at
    least one (visible) cell in that state, ``cluster`` only that column (and the
    rows it has). ``families`` lists every family, whatever the filters, so a
    filter form can offer them all.
    """
    column_query = select(Cluster.id, Cluster.name, Cluster.last_push_at).where(
        Cluster.last_push_at.is_not(None)
    )
    if cluster:
        column_query = column_query.where(Cluster.name == cluster)
    columns = session.execute(column_query.order_by(Cluster.name)).all()
    index = {cluster_id: i for i, (cluster_id, _, _) in enumerate(columns)}

    cell_query = select(
        CoverageCell.cluster_id,
        CoverageCell.checkpoint,
        CoverageCell.family,
        CoverageCell.env,
        CoverageCell.state,
        CoverageCell.verified_at,
        CoverageCell.device_kind,
        CoverageCell.message,
    )
    if cluster:
        cell_query = cell_query.where(CoverageCell.cluster_id.in_(list(index)))
    if family:
        cell_query = cell_query.where(CoverageCell.family == family)
    if state:
        having_state = select(CoverageCell.checkpoint).where(CoverageCell.state == state)
        if cluster:
            having_state = having_state.where(CoverageCell.cluster_id.in_(list(index)))
        cell_query = cell_query.where(CoverageCell.checkpoint.in_(having_state))
    # Core execution: the ORM's row loading costs a third of this view at 15,000 cells.
    rows = session.connection().execute(cell_query).all()
    families = session.execute(
        select(CoverageCell.family).distinct().order_by(CoverageCell.family)
    ).scalars()
    return Matrix(
        generated_at=utc_now(),
        clusters=[(name, at) for _, name, at in columns],
        families=list(families),
        rows=_group_rows(rows, index),
    )


def _group_rows(
    rows: Sequence[Sequence[Any]], index: dict[int, int]
) -> list[tuple[str, str, list[Cell | None]]]:
    """Group cell rows into one row per checkpoint, cells lined up with the columns.

    One checkpoint id can be served by two envs on one cluster (a ``CLUSTERS``
    variant next to the universal env); the cell shown is then the one verified
    most recently, and the row's family is the env most cells name.
    """
    width = len(index)
    grouped: dict[str, list[Cell | None]] = {}
    first_family: dict[str, str] = {}
    mixed: set[str] = set()  # checkpoints served by more than one env
    for cluster_id, checkpoint, family, env, state, verified_at, kind, message in rows:
        column = index.get(cluster_id)
        if column is None:
            continue  # a cluster that never pushed cannot have cells; be safe anyway
        cells = grouped.get(checkpoint)
        if cells is None:
            cells = grouped[checkpoint] = [None] * width
            first_family[checkpoint] = family
        elif family != first_family[checkpoint]:
            mixed.add(checkpoint)
        current = cells[column]
        if current is not None and (current[2] or "") >= (verified_at or ""):
            continue
        cells[column] = (env, state, verified_at, kind, message)
    out = []
    for checkpoint, cells in grouped.items():
        family = first_family[checkpoint]
        if checkpoint in mixed:
            votes = Counter(cell[0] for cell in cells if cell is not None)  # env = family
            family = min(votes, key=lambda f: (-votes[f], f))
        out.append((checkpoint, family, cells))
    out.sort(key=lambda row: (row[1], row[0]))
    return out


def cluster_list(session: Session) -> dict[str, Any]:
    """Every known cluster with its last push (``GET /api/v1/clusters``)."""
    query = (
        select(
            Cluster.name,
            Cluster.last_push_at,
            ManifestPush.env_count,
            ManifestPush.checkpoint_count,
        )
        .outerjoin(ManifestPush, ManifestPush.id == Cluster.last_push_id)
        .order_by(Cluster.name)
    )
    return {
        "clusters": [
            {
                "name": name,
                "last_push_at": iso_time(at),
                "envs": envs or 0,
                "checkpoints": checkpoints or 0,
            }
            for name, at, envs, checkpoints in session.execute(query)
        ]
    }


def latest_manifest(session: Session, name: str) -> dict[str, Any] | None:
    """The cluster's latest pushed manifest; None when unknown or never pushed."""
    row = session.execute(
        select(ManifestPush.id, ManifestPush.received_at, ManifestPush.body)
        .join(Cluster, Cluster.last_push_id == ManifestPush.id)
        .where(Cluster.name == name)
    ).first()
    if row is None or row.body is None:
        # No body: cannot happen (a cluster's newest push always keeps its body), but
        # a missing manifest is the honest answer if it ever did.
        return None
    return {
        "cluster": name,
        "push_id": row.id,
        "received_at": iso_time(row.received_at),
        "manifest": json.loads(row.body),
    }


def push_history(session: Session, name: str, limit: int = 50) -> dict[str, Any] | None:
    """The cluster's pushes, newest first (bodies left out); None for an unknown cluster.

    Pushes whose body retention dropped are listed like the others: the history
    shows when each push came and what it counted, never a body.
    """
    cluster_id = session.execute(select(Cluster.id).where(Cluster.name == name)).scalar()
    if cluster_id is None:
        return None
    rows = session.execute(
        select(
            ManifestPush.id,
            ManifestPush.received_at,
            ManifestPush.env_count,
            ManifestPush.checkpoint_count,
        )
        .where(ManifestPush.cluster_id == cluster_id)
        .order_by(ManifestPush.received_at.desc(), ManifestPush.id.desc())
        .limit(max(0, limit))
    )
    return {
        "cluster": name,
        "pushes": [
            {"push_id": i, "received_at": iso_time(at), "envs": envs, "checkpoints": checkpoints}
            for i, at, envs, checkpoints in rows
        ],
    }


def cluster_detail(
    session: Session, name: str, history_limit: int = HISTORY_LIMIT
) -> dict[str, Any] | None:
    """What the cluster page shows; None for an unknown cluster.

    ``envs``: each env of the latest push with its versions; ``checkpoints``: each
    current cell with its verification ``history`` (newest first, every device kind,
    each event with its physics ``checks`` as pushed, or None,
    at most ``history_limit`` per checkpoint, since a nightly smoke-test adds one a
    day); ``retired``: history of checkpoints the latest push no longer carries.
    """
    cluster = session.execute(select(Cluster).where(Cluster.name == name)).scalar()
    if cluster is None:
        return None
    envs = session.execute(
        select(ClusterEnv).where(ClusterEnv.cluster_id == cluster.id).order_by(ClusterEnv.name)
    ).scalars()
    cells = session.execute(
        select(CoverageCell)
        .where(CoverageCell.cluster_id == cluster.id)
        .order_by(CoverageCell.family, CoverageCell.checkpoint)
    ).scalars()
    rank = (
        func.row_number()
        .over(
            partition_by=(VerificationEvent.env, VerificationEvent.checkpoint),
            order_by=(VerificationEvent.at.desc(), VerificationEvent.device_kind),
        )
        .label("rank")
    )
    ranked = (
        select(VerificationEvent.id, rank)
        .where(VerificationEvent.cluster_id == cluster.id)
        .subquery()
    )
    events = session.execute(
        select(VerificationEvent)
        .join(ranked, ranked.c.id == VerificationEvent.id)
        .where(ranked.c.rank <= history_limit)
        .order_by(VerificationEvent.at.desc(), VerificationEvent.device_kind)
    ).scalars()
    history: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        history[(event.env, event.checkpoint)].append(
            {
                "device_kind": event.device_kind,
                "state": event.state,
                "at": event.at,
                "device": event.device,
                "message": event.message,
                "energy_per_atom": event.energy_per_atom,
                "checks": _decoded_checks(event.checks),
            }
        )
    checkpoint_counts: Counter = Counter()
    checkpoints = []
    for cell in cells:
        checkpoint_counts[cell.env] += 1
        checkpoints.append(
            {
                "checkpoint": cell.checkpoint,
                "env": cell.env,
                "family": cell.family,
                "state": cell.state,
                "verified_at": cell.verified_at,
                "fetched_at": cell.fetched_at,
                "device_kind": cell.device_kind,
                "device": cell.device,
                "message": cell.message,
                "history": history.pop((cell.env, cell.checkpoint), []),
            }
        )
    return {
        "cluster": cluster.name,
        "created_at": iso_time(cluster.created_at),
        "last_push_id": cluster.last_push_id,
        "last_push_at": iso_time(cluster.last_push_at),
        "envs": [
            {
                "name": env.name,
                "build_id": env.build_id,
                "source_hash": env.source_hash,
                "built_at": env.built_at,
                "python": env.python,
                "torch": env.torch,
                "rootstock": env.rootstock,
                "checkpoints": checkpoint_counts[env.name],
            }
            for env in envs
        ],
        "checkpoints": checkpoints,
        "retired": [
            {"checkpoint": checkpoint, "env": env, "history": records}
            for (env, checkpoint), records in sorted(history.items(), key=lambda i: i[0][::-1])
        ],
    }


def _decoded_checks(text: str | None) -> dict[str, Any] | None:
    """A history event's physics checks, decoded from the JSON text stored with it."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def usage_summary(session: Session) -> dict[str, Any]:
    """Monthly usage per checkpoint, summed over clusters, for the ``/usage`` page.

    ``distinct_users`` summed over clusters counts a person who uses two clusters
    twice: clusters send counts, never identities, so they cannot be merged.
    """
    rows = session.execute(
        select(
            UsageCount.month,
            Cluster.name,
            UsageCount.env,
            UsageCount.checkpoint,
            UsageCount.sessions,
            UsageCount.distinct_users,
            UsageCount.force_calls,
        )
        .join(Cluster, Cluster.id == UsageCount.cluster_id)
        .order_by(UsageCount.month, UsageCount.checkpoint, Cluster.name)
    ).all()
    months: set[str] = set()
    totals: dict[tuple[str, str], dict[str, Any]] = {}
    for month, _cluster, env, checkpoint, sessions, users, calls in rows:
        months.add(month)
        total = totals.setdefault(
            (month, checkpoint),
            {
                "month": month,
                "checkpoint": checkpoint,
                "envs": [],
                "clusters": 0,
                "sessions": 0,
                "distinct_users": 0,
                "force_calls": 0,
            },
        )
        if env not in total["envs"]:
            total["envs"].append(env)
        total["clusters"] += 1
        total["sessions"] += sessions
        total["distinct_users"] += users
        total["force_calls"] += calls
    by_month: dict[str, list[dict[str, Any]]] = {month: [] for month in sorted(months)}
    for (month, _), total in totals.items():
        by_month[month].append(total)
    for entries in by_month.values():
        entries.sort(key=lambda t: (-t["sessions"], -t["distinct_users"], t["checkpoint"]))
    return {
        "months": sorted(months, reverse=True),
        "by_month": by_month,
        "rows": [
            {
                "month": month,
                "cluster": cluster,
                "env": env,
                "checkpoint": checkpoint,
                "sessions": sessions,
                "distinct_users": users,
                "force_calls": calls,
            }
            for month, cluster, env, checkpoint, sessions, users, calls in rows
        ],
    }
