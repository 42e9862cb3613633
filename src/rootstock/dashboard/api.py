"""The JSON API (``/api/v1``): manifest and usage pushes, and the public reads.

Writes arrive here already authenticated and scoped by
:class:`rootstock.dashboard.middleware.GuardMiddleware`, which read the body
within the size limit before any of this ran. Handlers are plain functions (run
in the thread pool) with one short SQLAlchemy session each.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from rootstock.dashboard import catalogue, ingest, views
from rootstock.dashboard.db import begin_write
from rootstock.dashboard.models import Cluster
from rootstock.dashboard.schemas import (
    CatalogueOut,
    ClusterListOut,
    CoverageOut,
    ErrorOut,
    ManifestIn,
    ManifestOut,
    PushHistoryOut,
    PushOut,
    State,
    UsageIn,
    UsageOut,
)
from rootstock.names import CLUSTER_NAME_PATTERN

router = APIRouter()

WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "Missing, malformed, unknown or revoked key"},
    403: {"model": ErrorOut, "description": "The key may not write to this cluster"},
    404: {"model": ErrorOut, "description": "The cluster is gone"},
    413: {"model": ErrorOut, "description": "The body is over the size limit"},
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorOut, "description": "Unknown cluster, or nothing pushed yet"}
}
# Filters are compared with stored names; NUL is refused (PostgreSQL text cannot hold it).
Filter = Annotated[str | None, Query(max_length=200, pattern=r"^[^\x00]*$")]


def session_of(request: Request) -> Iterator[Session]:
    """One session per request, closed afterwards (a FastAPI dependency)."""
    session = request.app.state.sessions()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(session_of)]


def unprocessable(loc: list[str], message: str) -> HTTPException:
    """A 422 shaped like FastAPI's validation errors (``detail`` is a list)."""
    return HTTPException(422, [{"type": "value_error", "loc": loc, "msg": message}])


def _known_name(cluster: str) -> bool:
    # A name that could never have been added is unknown without asking the database.
    return bool(CLUSTER_NAME_PATTERN.fullmatch(cluster))


def _writable_cluster(session: Session, name: str) -> Cluster:
    cluster = session.scalars(select(Cluster).where(Cluster.name == name)).one_or_none()
    if cluster is None:
        # The key was scoped to it a moment ago: the cluster was removed since.
        raise HTTPException(404, f"the dashboard has no cluster {name!r}")
    return cluster


def _key_id(request: Request) -> int | None:
    return request.scope.get("state", {}).get("rootstock_api_key_id")


def _body_text(request: Request) -> str | None:
    # The body as received when it is UTF-8 (less a byte-order mark). JSON may also
    # come as UTF-16 or -32, which the parser accepts and whose NUL bytes UTF-8 would
    # let through: then the history keeps the manifest re-serialised instead.
    raw = request.scope.get("state", {}).get("rootstock_body")
    if raw is None or b"\x00" in raw:
        return None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None


def _elapsed_ms(request: Request) -> float | None:
    started = request.scope.get("state", {}).get("rootstock_started")
    return None if started is None else (time.perf_counter() - started) * 1000


@router.put(
    "/clusters/{cluster}/manifest",
    response_model=PushOut,
    responses=WRITE_ERRORS,
    summary="Replace a cluster's manifest (kept as history)",
)
def put_manifest(
    cluster: str, body: ManifestIn, request: Request, session: SessionDep
) -> JSONResponse:
    """Store one cluster's view of an install manifest as its current state."""
    if cluster not in body["clusters"]:
        raise unprocessable(
            ["body", "clusters"], f"the manifest's clusters do not include {cluster!r}"
        )
    # Validated into a fresh dict holding only the keys that were sent.
    manifest = body
    begin_write(session)
    target = _writable_cluster(session, cluster)
    try:
        push = ingest.store_push(
            session,
            target,
            manifest,
            _key_id(request),
            body=_body_text(request),
            keep_bodies=request.app.state.keep_bodies,
        )
    except ingest.ManifestShapeError as exc:
        session.rollback()
        raise unprocessable(["body"], f"the manifest cannot be stored: {exc}") from None
    push.handling_ms = _elapsed_ms(request)
    session.commit()
    return JSONResponse(
        {
            "cluster": cluster,
            "push_id": push.id,
            "received_at": views.iso_time(push.received_at),
            "envs": push.env_count,
            "checkpoints": push.checkpoint_count,
        }
    )


@router.post(
    "/clusters/{cluster}/usage",
    response_model=UsageOut,
    responses=WRITE_ERRORS,
    summary="Store aggregated monthly usage counts",
)
def post_usage(cluster: str, body: UsageIn, session: SessionDep) -> JSONResponse:
    """Replace the cluster's counts for each month the body carries."""
    counts = [count.model_dump() for count in body.counts]
    begin_write(session)
    target = _writable_cluster(session, cluster)
    rows = ingest.store_usage(session, target, counts)
    session.commit()
    return JSONResponse({"cluster": cluster, "rows": rows})


@router.get(
    "/clusters/{cluster}/manifest",
    response_model=ManifestOut,
    responses=NOT_FOUND,
    summary="A cluster's latest manifest",
)
def get_manifest(cluster: str, session: SessionDep) -> JSONResponse:
    """The latest pushed manifest; 404 for an unknown cluster or one that never pushed."""
    found = views.latest_manifest(session, cluster) if _known_name(cluster) else None
    if found is None:
        raise HTTPException(404, f"no manifest was pushed for cluster {cluster!r}")
    return JSONResponse(found)


@router.get(
    "/clusters/{cluster}/pushes",
    response_model=PushHistoryOut,
    responses=NOT_FOUND,
    summary="A cluster's push history, newest first",
)
def get_pushes(
    cluster: str,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> JSONResponse:
    """The cluster's pushes (without bodies); 404 for an unknown cluster."""
    found = views.push_history(session, cluster, limit) if _known_name(cluster) else None
    if found is None:
        raise HTTPException(404, f"the dashboard has no cluster {cluster!r}")
    return JSONResponse(found)


@router.get("/clusters", response_model=ClusterListOut, summary="Every cluster")
def get_clusters(session: SessionDep) -> JSONResponse:
    """Every cluster with its last push."""
    return JSONResponse(views.cluster_list(session))


@router.get("/coverage", response_model=CoverageOut, summary="The checkpoint x cluster matrix")
def get_coverage(
    session: SessionDep,
    family: Filter = None,
    state: State | None = None,
    cluster: Filter = None,
) -> JSONResponse:
    """The coverage matrix, optionally narrowed to a family, a state or a cluster."""
    return JSONResponse(views.coverage(session, family=family, state=state, cluster=cluster))


@router.get(
    "/catalogue",
    response_model=CatalogueOut,
    summary="Every checkpoint across clusters: licence, gating, citation, where verified",
)
def get_catalogue(session: SessionDep) -> JSONResponse:
    """Every checkpoint of the clusters' latest pushes, with what it is and where it runs."""
    return JSONResponse(catalogue.catalogue(session))
