"""The checkpoint catalogue: every checkpoint across clusters, what it is and where it runs.

A read model over the coverage cells the latest pushes left (``GET
/api/v1/catalogue`` and the ``/catalogue`` page): one query, whatever the size.
Per checkpoint it gives:

* its licence, gated status and citation, from the env file's ``CHECKPOINT_INFO``
  as the pushes carried it. Clusters may run different versions of an env file, so
  the values come from the cluster that pushed most recently among those whose push
  described the checkpoint. ``described`` is false when no push did (clients from
  before issue #33 send no ``info``): the licence and gating are then unknown;
* each cluster that has it, with the cell's state and the latest result per device
  kind (state, device, time and message, derived as ``rootstock status`` derives
  them, ``stale`` included); ``verified_on`` names the clusters where at least one
  device kind is ``verified``.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from rootstock.dashboard.models import Cluster, CoverageCell, utc_now
from rootstock.dashboard.views import iso_time

CATALOGUE_VERSION = 1


def catalogue(session: Session) -> dict[str, Any]:
    """Every checkpoint of the clusters' latest pushes, sorted by family then id."""
    query = select(
        CoverageCell.checkpoint,
        CoverageCell.env,
        CoverageCell.state,
        CoverageCell.verified_at,
        CoverageCell.device_kind,
        CoverageCell.device,
        CoverageCell.message,
        CoverageCell.described,
        CoverageCell.licence,
        CoverageCell.gated,
        CoverageCell.citation,
        CoverageCell.devices,
        Cluster.name,
        Cluster.last_push_at,
    ).join(Cluster, Cluster.id == CoverageCell.cluster_id)
    by_checkpoint: dict[str, list[Any]] = defaultdict(list)
    for row in session.connection().execute(query):
        by_checkpoint[row.checkpoint].append(row)
    # One smoke-test run stamps many cells with the same results: decode each once.
    decoded: dict[str, list[dict[str, Any]]] = {}
    entries = [_entry(checkpoint, rows, decoded) for checkpoint, rows in by_checkpoint.items()]
    entries.sort(key=lambda entry: (entry["family"], entry["checkpoint"]))
    return {
        "version": CATALOGUE_VERSION,
        "generated_at": iso_time(utc_now()),
        "checkpoints": entries,
    }


def _entry(
    checkpoint: str, rows: list[Any], decoded: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """One checkpoint's catalogue entry from its cells on every cluster."""
    # The family is the env most cells name (one id may be served by a CLUSTERS
    # variant next to the universal env), as on the coverage matrix.
    votes = Counter(row.env for row in rows)
    family = min(votes, key=lambda env: (-votes[env], env))
    described = [row for row in rows if row.described]
    newest = max(described, key=lambda row: (row.last_push_at, row.name), default=None)
    clusters = []
    for row in sorted(rows, key=lambda row: (row.name, row.env)):
        clusters.append(
            {
                "cluster": row.name,
                "env": row.env,
                "state": row.state,
                "message": row.message,
                "devices": _devices(row, decoded),
            }
        )
    verified_on = sorted(
        {c["cluster"] for c in clusters if any(d["state"] == "verified" for d in c["devices"])}
    )
    return {
        "checkpoint": checkpoint,
        "family": family,
        "described": newest is not None,
        "licence": newest.licence if newest is not None else None,
        "gated": newest.gated if newest is not None else None,
        "citation": newest.citation if newest is not None else None,
        "verified_on": verified_on,
        "clusters": clusters,
    }


def _devices(row: Any, cache: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The cell's latest result per device kind, sorted by kind.

    A cell stored before revision 0004 has no per-kind results: its own latest
    result (of any kind) stands in for them until the cluster pushes again. Lists
    decoded from the same text are shared through ``cache`` (read them, never change
    them).
    """
    if row.devices and row.devices in cache:
        return cache[row.devices]
    try:
        decoded = json.loads(row.devices) if row.devices else None
    except ValueError:
        decoded = None
    if isinstance(decoded, dict):
        cache[row.devices] = _listed(decoded)
        return cache[row.devices]
    if not row.device_kind:
        return []
    return _listed(
        {
            row.device_kind: {
                "state": row.state,
                "at": row.verified_at,
                "device": row.device,
                "message": row.message,
            }
        }
    )


def _listed(decoded: dict[str, Any]) -> list[dict[str, Any]]:
    """``{kind: result}`` as the API's list of devices, sorted by kind."""
    return [
        {
            "device_kind": kind,
            "device": result.get("device"),
            "state": result.get("state"),
            "at": result.get("at"),
            "message": result.get("message"),
        }
        for kind, result in sorted(decoded.items())
        if isinstance(result, dict)
    ]
