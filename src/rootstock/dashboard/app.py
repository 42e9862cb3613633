"""The dashboard's ASGI application: the JSON API under ``/api/v1`` and the HTML pages.

:func:`create_app` wires the pieces: the database (sessions in
``app.state.sessions``), the guard middleware (credentials before the body, body
limit, ``Server-Timing``), the API sub-application with its own OpenAPI schema at
``/api/v1/openapi.json``, and the pages router. It does not migrate the database:
``rootstock dashboard serve`` and the test fixtures call
:func:`rootstock.dashboard.db.migrate` first.

Errors are answered as JSON with the status the API reference documents. A
database that cannot be used (unreachable, out of connections) is a ``503`` with
``Retry-After``, and logged: the client's retry is the fix. A conflicting concurrent
write that could not be settled is a ``409``; a value the database refused is a
``422``. Anything else escaping a handler would be a bug, and stays a ``500``.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rootstock.dashboard import api, pages
from rootstock.dashboard.db import make_engine, make_sessionmaker
from rootstock.dashboard.middleware import GuardMiddleware
from rootstock.dashboard.retention import DEFAULT_KEEP_BODIES, checked_keep_bodies

DEFAULT_MAX_BODY = 16 * 2**20
log = logging.getLogger("rootstock.dashboard")


def _version() -> str:
    try:
        return version("rootstock")
    except PackageNotFoundError:
        return "0+unknown"


def create_app(
    db_url: str, *, max_body: int = DEFAULT_MAX_BODY, keep_bodies: int = DEFAULT_KEEP_BODIES
) -> FastAPI:
    """The dashboard application for the (already migrated) database at ``db_url``.

    ``keep_bodies``: how many manifest bodies each cluster's history keeps (the
    newest; see :mod:`rootstock.dashboard.retention`); ValueError outside its range.
    """
    keep_bodies = checked_keep_bodies(keep_bodies)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)

    app = FastAPI(title="Rootstock dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    api_app = FastAPI(
        title="Rootstock dashboard API",
        version=_version(),
        description="Manifest and usage pushes from rootstock installs, and the "
        "public coverage matrix. See docs/dashboard-api.md.",
        openapi_url="/openapi.json",
        docs_url="/docs",
        redoc_url=None,
    )
    api_app.include_router(api.router)
    for target in (app, api_app):
        target.state.engine = engine
        target.state.sessions = sessions
        target.state.max_body = max_body
        target.state.keep_bodies = keep_bodies
        _add_error_handlers(target)
    app.mount("/api/v1", api_app)
    app.include_router(pages.router)
    app.add_middleware(GuardMiddleware, sessions=sessions, max_body=max_body)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and request.method not in ("GET", "HEAD", "OPTIONS"):
            # FastAPI answers 400 for a body that is not UTF-8; the API promises 422
            # for every body that is not JSON.
            error = {"type": "json_invalid", "loc": ["body"], "msg": "the body is not UTF-8 JSON"}
            return JSONResponse({"detail": [error]}, status_code=422)
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes each error's input: the whole body for a model-level
        # error (megabytes, and a NaN in it could not even be encoded as JSON).
        errors = [
            {"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(IntegrityError)
    async def conflict(request: Request, exc: IntegrityError) -> JSONResponse:
        log.warning("conflicting write on %s: %s", request.url.path, exc.orig)
        return JSONResponse(
            {"detail": "a concurrent write conflicted with this one; retry"}, status_code=409
        )

    @app.exception_handler(DataError)
    async def refused(request: Request, exc: DataError) -> JSONResponse:
        # The database refused a value that validation let through: a gap in the
        # validation, but the request's own value, so a 422 rather than a 500.
        log.error("database refused a value on %s: %s", request.url.path, exc.orig)
        error = {"type": "value_error", "loc": ["body"], "msg": "the database refused a value"}
        return JSONResponse({"detail": [error]}, 422)

    @app.exception_handler(SQLAlchemyError)
    async def unavailable(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        # Unreachable, restarting, out of connections, or its schema not what this
        # server expects: the server's problem, which the client can only wait out.
        log.error("database error on %s: %s", request.url.path, getattr(exc, "orig", exc))
        return JSONResponse(
            {"detail": "the dashboard database is unavailable; retry later"},
            status_code=503,
            headers={"Retry-After": "5"},
        )
